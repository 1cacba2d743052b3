package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/kmod"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// applyOutput is what passage apply --json prints.
type applyOutput struct {
	Profile   string              `json:"profile"`
	DryRun    bool                `json:"dry_run"`
	Lockdown  string              `json:"lockdown,omitempty"`
	Problems  []string            `json:"problems,omitempty"`
	ATS       []firmware.Finding  `json:"ats"`
	Audit     []vfiobind.Finding  `json:"audit"`
	KernelArg string              `json:"kernel_arg"`
	ACS       apply.Report        `json:"acs"`
	VFIO      *vfiobind.Report    `json:"vfio,omitempty"`
	Units     []topology.UnitJSON `json:"units"`
	Stages    map[string]string   `json:"stages"`

	// names labels the functions in the text report (pciids.DB.Label), by address.
	names map[string]string
}

// applyEnv is what apply writes through; tests put a simulated kernel here.
type applyEnv struct {
	sysfs   func(root string) vfiobind.Sysfs
	modules func(root, release string) vfiobind.ModuleLoader
}

// cmdApply does on a running node what the boot does before the manifest: decide
// (label, ATS, audit, ACS targets), then write ACS and bind to vfio-pci. With --dry-run
// it writes nothing and reports the decision against the live node.
func cmdApply(args []string, stdout, stderr io.Writer) int {
	return runApply(args, stdout, stderr, applyEnv{})
}

func runApply(args []string, stdout, stderr io.Writer, env applyEnv) int {
	fs := newFlags("apply", stderr)
	root := fs.String("root", "/", "root of the sysfs (and /proc) tree to read and write")
	dryRun := fs.Bool("dry-run", false, "write nothing: report the decision and what ACS would change")
	profile := fs.String("profile", "b300", "built-in profile ("+strings.Join(topology.Builtins(), ", ")+") or a YAML/JSON file")
	ats := fs.String("ats", "", "ATS policy for NIC functions without ATS: prefer or require (default: passage.ats= from the command line, else prefer)")
	erasePol := fs.String("erase", "", "erase policy: off, auto or require (default: passage.erase= from the command line, else the profile's); apply itself erases nothing, so under auto or require its units end degraded or failed: passage recycle erases a running node's unit")
	cmdline := fs.String("cmdline", "", "kernel command line (default: <root>/proc/cmdline); a pci=config_acs= on it makes matching ports verify-only")
	release := fs.String("kernel", "", "running kernel release for the advice (default: <root>/proc/sys/kernel/osrelease)")
	noBind := fs.Bool("no-bind", false, "program ACS only; leave drivers as they are")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	modulesFromRoot := fs.Bool("modules-from-root", false, "with --root DIR other than /, load the vfio stack from DIR/lib/modules/<release> into the running kernel (default: load nothing from another tree)")
	var names namesFlag
	names.register(fs)
	planFile := fs.String("plan", "", "execute the decision saved by plan -o `FILE`, and only if the node still matches it (profile and policy come from the file)")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	usageErr := func(err error) int {
		fmt.Fprintf(stderr, "passage apply: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
		return 2
	}
	live, err := decision.ReadLive(*root)
	if err != nil {
		return usageErr(err)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if set["cmdline"] {
		live.Cmdline = *cmdline
	}
	if set["kernel"] {
		live.Release = *release
	}
	var saved *decision.Saved
	if *planFile != "" {
		if set["profile"] || set["ats"] || set["erase"] {
			return usageErr(fmt.Errorf("--plan takes the profile and the ATS and erase policies from the plan: drop --profile, --ats and --erase"))
		}
		b, err := manifest.ReadRegular(*planFile, decision.MaxSaved)
		if err != nil {
			return usageErr(err)
		}
		saved, err = decision.ReadSaved(bytes.NewReader(b))
		if err != nil {
			return usageErr(fmt.Errorf("%s: %w", *planFile, err))
		}
		if saved.For != decision.CommandApply {
			return usageErr(fmt.Errorf("%s is a plan for %s, not for apply (what apply ends with differs: it does not erase); make it with plan --for apply --out %s", *planFile, saved.For, *planFile))
		}
		*ats = string(saved.ATS)
		*erasePol, set["erase"] = string(saved.Erase), true
	} else if !set["ats"] {
		*ats = string(initramfs.ParseCmdline(live.Cmdline).ATS)
	}
	ep, err := erasePolicy(set["erase"], *erasePol, live.Cmdline)
	if err != nil {
		return usageErr(err)
	}
	policy, err := firmware.ParsePolicy(*ats)
	if err != nil {
		return usageErr(fmt.Errorf("--ats: %w", err))
	}
	var prof *topology.Profile
	if saved != nil {
		prof, err = saved.LoadProfile()
	} else {
		prof, err = topology.LoadProfile(*profile)
	}
	if err != nil {
		return usageErr(err)
	}
	tree, err := pci.Scan(*root)
	if err != nil {
		return usageErr(err)
	}
	db, err := names.open(tree)
	if err != nil {
		return usageErr(err)
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: prof, ATS: policy, Erase: ep, Live: live, For: decision.CommandApply})
	if err != nil {
		return usageErr(err)
	}
	if saved != nil {
		if diff := saved.Diff(d); len(diff) > 0 {
			fmt.Fprintf(stderr, "passage apply: the node no longer matches the plan in %s; nothing written:\n", *planFile)
			for _, l := range diff {
				fmt.Fprintf(stderr, "  %s\n", l)
			}
			return 1
		}
	}

	out := applyOutput{Profile: prof.Name, DryRun: *dryRun, Lockdown: live.Lockdown, Stages: map[string]string{},
		ATS: d.ATS, Audit: d.Audit, KernelArg: d.KernelArg, names: map[string]string{}}
	for _, fn := range tree.Devices {
		out.names[fn.Addr.String()] = db.Label(fn.VendorID, fn.DeviceID)
	}
	out.Problems = append(out.Problems, d.Labels.Problems...)
	if d.LabelErr != nil {
		// Labels that contradict each other name the wrong functions for passthrough:
		// nothing may be written on their strength.
		out.Problems = append(out.Problems, d.LabelErr.Error())
		out.Stages["label"] = "failed: nothing written"
		vs := d.Decided()
		out.Units = d.UnitsJSON(vs)
		writeApply(stdout, stderr, out, *asJSON)
		return 1
	}
	out.Stages["label"] = fmt.Sprintf("%d units", len(d.Units()))
	if d.NoUnits != "" {
		out.Problems = append(out.Problems, d.NoUnits)
	}
	out.Stages["ats"] = fmt.Sprintf("%d functions checked, %d without ATS (policy %s)", len(d.ATS), len(firmware.NoDT(d.ATS)), policy)

	ctx := context.Background()
	cfg := pci.SysfsConfig{Root: *root}
	x := decision.Execution{DryRun: *dryRun, Binding: !*dryRun && !*noBind}
	if d.Erase.Active() {
		// apply never releases a unit a tenant may hold, so it erases nothing; the
		// decision, knowing so, failed (require) or degraded (auto) the units before any
		// write, and the ports of failed units are left alone.
		out.Stages["erase"] = fmt.Sprintf("not run (policy %s): apply does not erase; the boot and passage recycle do", d.Erase)
	}
	out.ACS, err = d.ExecuteACS(ctx, cfg, *dryRun)
	if err != nil {
		return usageErr(err)
	}
	x.ACS = &out.ACS
	out.Stages["acs"] = fmt.Sprintf("%d ports, %d written", len(out.ACS.Changes), out.ACS.Writes())

	switch {
	case *dryRun:
		out.Stages["vfio"] = "dry run: audited only"
	case *noBind:
		out.Stages["vfio"] = "skipped (--no-bind)"
	default:
		sys := vfiobind.Sysfs(vfiobind.Root(*root))
		if env.sysfs != nil {
			sys = env.sysfs(*root)
		}
		var opts vfiobind.Options
		switch {
		case env.modules != nil:
			opts.Modules = env.modules(*root, live.Release)
		case *root == "/" || *modulesFromRoot:
			// Modules go into the running kernel: only from the running system's own
			// directory, unless the operator says otherwise, and never through a release
			// that is not a plain name (a tree's /proc may say "../../tmp").
			ix, err := kmod.OpenRelease(*root, live.Release)
			if errors.Is(err, kmod.ErrRelease) {
				return usageErr(fmt.Errorf("%w; no module loaded", err))
			}
			if err == nil {
				opts.Modules = &vfiobind.Kmod{Index: ix}
			}
		default:
			// Another root: its modules are not loaded into this kernel; vfio-pci must
			// already be registered (binding checks).
		}
		out.VFIO, x.BindErr = d.ExecuteBind(ctx, sys, x.ACS, nil, opts)
		x.Bind = out.VFIO
		if x.BindErr != nil && out.VFIO == nil {
			return usageErr(x.BindErr)
		}
		if x.BindErr != nil {
			out.Problems = append(out.Problems, x.BindErr.Error())
		}
		bound := 0
		for _, u := range out.VFIO.Units {
			if u.Bound() {
				bound++
			}
		}
		out.Stages["vfio"] = fmt.Sprintf("%d of %d units bound", bound, len(out.VFIO.Units))
		if out.VFIO.ModulesErr != "" {
			out.Stages["vfio"] += "; vfio stack: " + out.VFIO.ModulesErr
		}
	}
	vs := d.Conclude(x)
	out.Units = d.UnitsJSON(vs)
	writeApply(stdout, stderr, out, *asJSON)
	if decision.Failed(vs) || d.Err() != nil {
		return 1
	}
	return 0
}

func writeApply(stdout, stderr io.Writer, out applyOutput, asJSON bool) {
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(out); err != nil {
			fmt.Fprintf(stderr, "passage apply: %v\n", err)
		}
		return
	}
	w := func(format string, args ...any) { fmt.Fprintf(stdout, format+"\n", args...) }
	mode := ""
	if out.DryRun {
		mode = " (dry run: nothing written)"
	}
	w("passage apply: profile %s%s", out.Profile, mode)
	for _, p := range out.Problems {
		w("problem: %s", strings.ReplaceAll(p, "\n", "; "))
	}
	for _, st := range []string{"label", "ats", "erase", "acs", "vfio"} {
		if s, ok := out.Stages[st]; ok {
			w("%-5s %s", st+":", s)
		}
	}
	for _, f := range out.ATS {
		if f.Missing() {
			w("  %s", f)
		}
	}
	for _, c := range out.ACS.Changes {
		w("  %s", c)
	}
	if out.ACS.ConfigACS != "" {
		w("  kernel argument for this plan: %s", out.ACS.ConfigACS)
	}
	for _, a := range out.ACS.Advice {
		w("advice: %s", a)
	}
	for _, f := range out.Audit {
		w("  isolation audit: %s", f)
	}
	if out.VFIO != nil {
		for _, u := range out.VFIO.Units {
			for _, fr := range u.Functions {
				line := fmt.Sprintf("  vfio %s: %s group %d: %s -> %s", u.ID, fr.Addr, fr.Group, unbindDriverName(fr.DriverBefore), unbindDriverName(fr.DriverAfter))
				if n := out.names[fr.Addr.String()]; n != "" {
					line += " (" + n + ")"
				}
				if fr.Err != "" {
					line += ": " + fr.Err
				}
				if fr.RolledBack {
					line += " (rolled back)"
				}
				w("%s", line)
			}
		}
	}
	for _, u := range out.Units {
		line := fmt.Sprintf("%s %s: %s", u.ID, u.GPU, u.Status)
		if len(u.Reasons) > 0 {
			line += ": " + strings.Join(u.Reasons, "; ")
		}
		w("%s", line)
	}
}
