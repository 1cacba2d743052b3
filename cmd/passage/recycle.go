package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// recycleEnv is what recycle writes through and erases with; nil fields are the kernel
// under --root. Tests put a simulated kernel and NVMe controllers here.
type recycleEnv struct {
	sysfs vfiobind.Sysfs
	open  erase.Opener
}

// cmdRecycle hands units to the next tenant on a running host (package recycle).
func cmdRecycle(args []string, stdout, stderr io.Writer) int {
	return runRecycle(args, stdout, stderr, recycleEnv{})
}

func runRecycle(args []string, stdout, stderr io.Writer, env recycleEnv) int {
	fs := newFlags("recycle", stderr)
	root := fs.String("root", "/", "root of the node (/proc, /sys, /dev, /run)")
	var units unitList
	units.register(fs, "`UNITS` to recycle: gpuN or N, repeatable or comma-separated", false)
	profile := fs.String("profile", "", "role profile (default: passage.profile= of /proc/cmdline, else b300)")
	var rf recordFlags
	rf.register(fs)
	policy := fs.String("erase", "require", "auto or require: what a unit not erased, verified and reset ends as")
	overwrite := fs.Bool("overwrite", false, "allow Sanitize overwrite after every other method (hours on a large drive)")
	timeout := fs.Duration("timeout", 30*time.Minute, "bound on the whole recycle")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	ids := units.units()
	p, err := erase.ParsePolicy(*policy)
	if len(ids) == 0 || err != nil || !p.Active() {
		fmt.Fprintln(stderr, "passage recycle: give --unit, and --erase auto or require")
		return 2
	}
	if *profile == "" {
		*profile = "b300"
		if b, err := os.ReadFile(filepath.Join(*root, "proc/cmdline")); err == nil {
			*profile = initramfs.ParseCmdline(string(b)).Profile
		}
	}
	o := recycle.Options{Root: *root, Profile: *profile, Units: ids, Policy: p, Log: stdout, Sysfs: env.sysfs, Open: env.open,
		Who: "passage recycle " + units.String()}
	o.Erase.Erase.Overwrite = *overwrite
	done, code := rf.apply("recycle", *root, &o, stderr)
	defer done()
	if code != 0 {
		return code
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	res, err := recycle.Run(ctx, o)
	if err != nil {
		fmt.Fprintf(stderr, "passage recycle: %v\n", err)
		return 1
	}
	for _, v := range res.Verdicts {
		fmt.Fprintf(stdout, "%s %s", v.Unit, v.Status)
		for _, r := range v.Reasons {
			fmt.Fprintf(stdout, "\n  %s", r)
		}
		fmt.Fprintln(stdout)
	}
	for _, u := range res.Erase.Units {
		for _, n := range u.NVMe {
			fmt.Fprintf(stdout, "%s %s: %s, %d LBAs verified\n", n.Addr, n.Controller, orNone(string(n.Method)), n.VerifiedLBAs)
		}
	}
	fmt.Fprintf(stdout, "manifest generation %d (%s) %s\n", res.Final, res.Manifest.GenerationSource, res.Signed.Digest)
	if code := rf.unattested("recycle", res.Unattested, stderr); code != 0 {
		return code
	}
	for _, v := range res.Verdicts {
		if v.Status == topology.StatusFailed {
			return 1
		}
	}
	return 0
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}
