package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/kmod"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// applyOutput is what passage apply --json prints.
type applyOutput struct {
	Profile  string              `json:"profile"`
	DryRun   bool                `json:"dry_run"`
	Problems []string            `json:"problems,omitempty"`
	ATS      []firmware.Finding  `json:"ats"`
	ACS      apply.Report        `json:"acs"`
	VFIO     *vfiobind.Report    `json:"vfio,omitempty"`
	Audit    []vfiobind.Finding  `json:"vfio_audit,omitempty"`
	Units    []topology.UnitJSON `json:"units"`
	Stages   map[string]string   `json:"stages"`
}

// cmdApply does on a running node what the boot stage does before the manifest: label,
// check ATS, program ACS, bind to vfio-pci. With --dry-run it writes nothing and says what
// it would write; binding is then only audited.
func cmdApply(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("apply", flag.ContinueOnError)
	fs.SetOutput(stderr)
	root := fs.String("root", "/", "root of the sysfs (and /proc) tree to read and write")
	dryRun := fs.Bool("dry-run", false, "write nothing: report what ACS would change and audit binding")
	profile := fs.String("profile", "b300", "built-in profile ("+strings.Join(topology.Builtins(), ", ")+") or a YAML/JSON file")
	ats := fs.String("ats", "", "ATS policy for NIC functions without ATS: prefer or require (default: passage.ats= from the command line, else prefer)")
	cmdline := fs.String("cmdline", "", "kernel command line (default: <root>/proc/cmdline); a pci=config_acs= on it makes matching ports verify-only")
	release := fs.String("kernel", "", "running kernel release for the advice (default: <root>/proc/sys/kernel/osrelease)")
	noBind := fs.Bool("no-bind", false, "program ACS only; leave drivers as they are")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "passage apply: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	usageErr := func(err error) int {
		fmt.Fprintf(stderr, "passage apply: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
		return 2
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["cmdline"] {
		s, err := readProcFile(*root, "proc/cmdline")
		if err != nil {
			return usageErr(err)
		}
		*cmdline = s
	}
	if !set["kernel"] {
		s, err := readProcFile(*root, "proc/sys/kernel/osrelease")
		if err != nil {
			return usageErr(err)
		}
		*release = s
	}
	if !set["ats"] {
		*ats = string(initramfs.ParseCmdline(*cmdline).ATS)
	}
	policy, err := firmware.ParsePolicy(*ats)
	if err != nil {
		return usageErr(fmt.Errorf("--ats: %w", err))
	}
	prof, err := topology.LoadProfile(*profile)
	if err != nil {
		return usageErr(err)
	}
	tree, err := pci.Scan(*root)
	if err != nil {
		return usageErr(err)
	}

	out := applyOutput{Profile: prof.Name, DryRun: *dryRun, Stages: map[string]string{}}
	labels, err := topology.Label(tree, prof)
	if labels == nil {
		return usageErr(err)
	}
	if err != nil {
		// Labels that contradict each other name the wrong functions for passthrough:
		// nothing may be written on their strength.
		out.Problems = append(out.Problems, err.Error())
		out.Stages["label"] = "failed: nothing written"
		out.Units = labels.UnitsJSON()
		writeApply(stdout, stderr, out, *asJSON)
		return 1
	}
	out.Problems = append(out.Problems, labels.Problems...)
	out.Stages["label"] = fmt.Sprintf("%d units", len(labels.Units))
	units := labels.Units

	out.ATS = firmware.CheckATS(units, policy)
	out.Stages["ats"] = fmt.Sprintf("%d functions checked, %d without ATS (policy %s)", len(out.ATS), len(firmware.NoDT(out.ATS)), policy)

	plan := firmware.DropDT(topology.ACSPlan(units), out.ATS)
	ctx := context.Background()
	cfg := pci.SysfsConfig{Root: *root}
	out.ACS, err = apply.ACS(ctx, plan, units, apply.Options{
		IO: cfg, Cmdline: *cmdline, KernelRelease: *release, DryRun: *dryRun,
	})
	if err != nil {
		return usageErr(err)
	}
	out.Stages["acs"] = fmt.Sprintf("%d ports, %d written", len(out.ACS.Changes), out.ACS.Writes())

	switch {
	case *dryRun:
		out.Audit = vfiobind.AuditLive(tree, units, cfg)
		out.Stages["vfio"] = "dry run: audited only"
	case *noBind:
		out.Stages["vfio"] = "skipped (--no-bind)"
	default:
		// The tree was scanned before the ACS writes: the groups in it stand (the kernel
		// forms them at enumeration only), the ports' ACS Control is read again.
		opts := vfiobind.Options{Config: cfg}
		// Load the vfio stack from the node's own modules when it has them; a tree
		// without /lib/modules (a synthetic root) relies on vfio-pci being registered.
		if *release != "" {
			if ix, err := kmod.Open(filepath.Join(*root, "lib", "modules", *release)); err == nil {
				opts.Modules = &vfiobind.Kmod{Index: ix}
			}
		}
		out.VFIO, err = vfiobind.Bind(ctx, vfiobind.Root(*root), tree, units, opts)
		if err != nil && out.VFIO == nil {
			return usageErr(err)
		}
		if err != nil {
			out.Problems = append(out.Problems, err.Error())
		}
		bound := 0
		for _, u := range out.VFIO.Units {
			if u.Status != topology.StatusFailed {
				bound++
			}
		}
		out.Stages["vfio"] = fmt.Sprintf("%d of %d units bound", bound, len(out.VFIO.Units))
		if out.VFIO.ModulesErr != "" {
			out.Stages["vfio"] += "; vfio stack: " + out.VFIO.ModulesErr
		}
	}
	out.Units = labels.UnitsJSON()
	writeApply(stdout, stderr, out, *asJSON)
	for _, u := range units {
		if u.Status != topology.StatusReady {
			return 1
		}
	}
	if out.ACS.Failed() {
		return 1
	}
	return 0
}

// readProcFile reads a one-line /proc file under root; a tree without /proc (a synthetic
// one, a snapshot) reads as "".
func readProcFile(root, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(root, name))
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
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
	for _, st := range []string{"label", "ats", "acs", "vfio"} {
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
		w("  vfio audit: %s", f)
	}
	if out.VFIO != nil {
		for _, u := range out.VFIO.Units {
			for _, fr := range u.Functions {
				line := fmt.Sprintf("  vfio unit %d: %s group %d: %s -> %s", u.ID, fr.Addr, fr.Group, unbindDriverName(fr.DriverBefore), unbindDriverName(fr.DriverAfter))
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
		line := fmt.Sprintf("unit %d gpu %s: %s", u.ID, u.GPU, u.Status)
		if len(u.Reasons) > 0 {
			line += ": " + strings.Join(u.Reasons, "; ")
		}
		w("%s", line)
	}
}
