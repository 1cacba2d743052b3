package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// unbindEnv is what unbind writes through; tests put a simulated kernel here.
type unbindEnv struct {
	sysfs func(root string) vfiobind.Sysfs
}

// cmdUnbind returns a unit's functions (or the listed BDFs) to their host drivers for
// maintenance: clear driver_override, unbind vfio-pci, drivers_probe, then read each
// function's driver link to report where it ended. Whole IOMMU groups only: handing one
// member of a group in use to a host driver breaks the guest's isolation. Exit 1 when a
// function is still on vfio-pci afterwards (or its link cannot be read), naming it.
func cmdUnbind(args []string, stdout, stderr io.Writer) int {
	return runUnbind(args, stdout, stderr, unbindEnv{})
}

func runUnbind(args []string, stdout, stderr io.Writer, env unbindEnv) int {
	if env.sysfs == nil {
		env.sysfs = func(root string) vfiobind.Sysfs { return vfiobind.Root(root) }
	}
	fs := newFlags("unbind", stderr)
	root := fs.String("root", "/", "root of the sysfs tree to read and write")
	var units unitList
	units.register(fs, "`UNITS` to return to their host drivers: gpuN or N (as passage plan labels them), repeatable or comma-separated", false)
	profile := fs.String("profile", "b300", "role profile that labels the units: a built-in name or a file")
	bdfs := fs.String("bdf", "", "comma-separated functions to return instead of a unit (DDDD:BB:DD.F)")
	asJSON := fs.Bool("json", false, "print the per-function report as JSON")
	var rf recordFlags
	rf.register(fs)
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	if (len(units.ids) == 0) == (*bdfs == "") {
		fmt.Fprintln(stderr, "passage unbind: give exactly one of --unit or --bdf")
		return 2
	}
	tree, err := pci.Scan(*root)
	if err != nil {
		fmt.Fprintf(stderr, "passage unbind: %v\n", err)
		return 2
	}
	var fns []*pci.Device
	if len(units.ids) > 0 {
		fns, err = unbindUnitFunctions(tree, units.ids, *profile, stderr)
	} else {
		fns, err = unbindBDFs(tree, *bdfs)
	}
	if err != nil {
		fmt.Fprintf(stderr, "passage unbind: %v\n", err)
		return 2
	}
	if err := vfiobind.CheckWholeGroups(tree, fns); err != nil {
		fmt.Fprintf(stderr, "passage unbind: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
		return 2
	}
	code, unattested := withdraw(*root, *profile, fns, rf, stdout, stderr)
	if code != 0 {
		return code
	}
	reps, err := vfiobind.Release(context.Background(), env.sysfs(*root), fns, vfiobind.Options{})
	// Release reads every function's driver link after its writes and fails one still on
	// vfio-pci; the report is checked here too, so no line claims a release that did not
	// happen.
	failed := 0
	for i := range reps {
		r := &reps[i]
		if r.Err == "" && r.DriverAfter == vfiobind.VFIODriver {
			r.Err = fmt.Sprintf("%s: still on %s after release", r.Addr, vfiobind.VFIODriver)
			err = errors.Join(err, errors.New(r.Err))
		}
		if r.Err != "" {
			failed++
		}
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if jerr := enc.Encode(reps); jerr != nil {
			fmt.Fprintf(stderr, "passage unbind: %v\n", jerr)
			return 1
		}
	} else {
		for _, r := range reps {
			line := fmt.Sprintf("%s group %d: %s -> %s (%v)", r.Addr, r.Group, unbindDriverName(r.DriverBefore), unbindDriverName(r.DriverAfter), r.Duration.Round(1000))
			if r.Err != "" {
				line += ": NOT RELEASED: " + r.Err
			}
			fmt.Fprintln(stdout, line)
		}
	}
	if err != nil {
		msg := strings.ReplaceAll(err.Error(), "\n", "; ")
		if failed > 0 {
			msg = fmt.Sprintf("%d of %d functions not released: %s", failed, len(fns), msg)
		}
		fmt.Fprintf(stderr, "passage unbind: %s\n", msg)
		rf.unattested("unbind", unattested, stderr)
		return 1
	}
	// The withdrawn generation says failed whether or not it is attested, so the release
	// went ahead; a --nonce left unanswered still fails the command.
	return rf.unattested("unbind", unattested, stderr)
}

func unbindDriverName(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

// unbindUnitFunctions labels the tree as passage plan and passage boot do and returns the
// units' passthrough functions.
func unbindUnitFunctions(tree *pci.Tree, ids []topology.UnitID, profile string, stderr io.Writer) ([]*pci.Device, error) {
	p, err := topology.LoadProfile(profile)
	if err != nil {
		return nil, err
	}
	labels, err := topology.Label(tree, p)
	if labels == nil {
		return nil, err
	}
	if err != nil {
		// A labelling problem elsewhere in the tree does not change which functions
		// these units hold; the whole-group check still guards what is released.
		fmt.Fprintf(stderr, "passage unbind: warning: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
	}
	var fns []*pci.Device
	for _, id := range ids {
		u := labels.Unit(id)
		if u == nil {
			var have []string
			for _, o := range labels.Units {
				have = append(have, o.ID.String())
			}
			return nil, fmt.Errorf("--unit %s: no such unit under profile %s (have %s)", id, profile, strings.Join(have, " "))
		}
		for _, d := range u.Functions() {
			if d != nil {
				fns = append(fns, d)
			}
		}
	}
	return fns, nil
}

func unbindBDFs(tree *pci.Tree, list string) ([]*pci.Device, error) {
	var fns []*pci.Device
	seen := map[pci.Address]bool{}
	for _, s := range strings.Split(list, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		a, err := pci.ParseAddress(s)
		if err != nil {
			return nil, fmt.Errorf("--bdf: %w", err)
		}
		d := tree.Lookup(a)
		if d == nil {
			return nil, fmt.Errorf("--bdf %s: no such function under %s", a, tree.Root)
		}
		if !seen[a] {
			seen[a] = true
			fns = append(fns, d)
		}
	}
	if len(fns) == 0 {
		return nil, fmt.Errorf("--bdf %q: no function", list)
	}
	return fns, nil
}

// withdraw refuses while anything holds the functions' groups or device cdevs, and when
// the node has a signed manifest (the boot's, in --dir) first writes a generation
// in which every unit holding one of the functions is failed (recycle.Withdraw): the
// last signed manifest must not say ready for a unit about to leave vfio-pci. Without a
// manifest there is nothing to contradict, and the holders are still checked. unattested
// says why the generation written has no attestation although one was asked for.
func withdraw(root, profile string, fns []*pci.Device, rf recordFlags, stdout, stderr io.Writer) (code int, unattested error) {
	addrs := make([]pci.Address, 0, len(fns))
	groups := make([]int, 0, len(fns))
	for _, f := range fns {
		addrs = append(addrs, f.Addr)
		groups = append(groups, f.IOMMUGroup)
	}
	if _, err := os.Lstat(filepath.Join(root, rf.dir, recycle.EnvelopeName)); err != nil {
		hs, err := recycle.Holders(root, groups, fns)
		if len(hs) > 0 {
			err = fmt.Errorf("%w: %s", recycle.ErrHeld, hs[0])
		}
		if err != nil {
			fmt.Fprintf(stderr, "passage unbind: %s\n", oneLine(err))
			return 1, nil
		}
		return 0, nil
	}
	o := recycle.Options{Root: root, Profile: profile, Who: "passage unbind"}
	done, code := rf.apply("unbind", root, &o, stderr)
	defer done()
	if code != 0 {
		return code, nil
	}
	m, unattested, err := recycle.Withdraw(context.Background(), o, addrs, "unbind: returned to host drivers; not ready until a later boot or recycle says so")
	if err != nil {
		fmt.Fprintf(stderr, "passage unbind: nothing released: %s\n", oneLine(err))
		return 1, nil
	}
	if m != nil {
		fmt.Fprintf(stdout, "manifest generation %d (%s)%s\n", m.Generation, m.GenerationSource, failedUnits(m))
	}
	return 0, unattested
}
