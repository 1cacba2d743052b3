package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
)

// cmdRecycle hands units to the next tenant on a running host (package recycle).
func cmdRecycle(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("recycle", flag.ContinueOnError)
	fs.SetOutput(stderr)
	root := fs.String("root", "/", "root of the node (/proc, /sys, /dev, /run)")
	units := fs.String("unit", "", "units to recycle: N or gpuN, comma-separated")
	profile := fs.String("profile", "", "role profile (default: passage.profile= of /proc/cmdline, else b300)")
	key := fs.String("key", "/etc/passage/key", "ed25519 key that signs the new generations (and verifies the previous one)")
	dir := fs.String("dir", initramfs.RunDir, "directory of the manifest to replace")
	genFile := fs.String("generation-file", "", "file generation counter, when the node has no TPM (without a TPM counter or this, recycle refuses)")
	tpm := fs.String("tpm", "auto", "on, off or auto: sign with and count generations in the TPM")
	policy := fs.String("erase", "require", "auto or require: what a unit not erased, verified and reset ends as")
	overwrite := fs.Bool("overwrite", false, "allow Sanitize overwrite after every other method (hours on a large drive)")
	timeout := fs.Duration("timeout", 30*time.Minute, "bound on the whole recycle")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage recycle --unit N[,M...] [flags]\n\nRefuses while a unit's /dev/vfio/<group> or /dev/vfio/devices/vfioN is open, and\nwithout a generation counter (the TPM's, or --generation-file). Otherwise: a signed generation marking the\nunits not ready, release from vfio-pci, NVMe erase, function resets, vfio-pci again, and a\nsigned generation with the verdicts.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	var ids []topology.UnitID
	for _, s := range strings.Split(*units, ",") {
		if s == "" {
			continue
		}
		id, err := topology.ParseUnitName(s)
		if err != nil {
			fmt.Fprintf(stderr, "passage recycle: --unit %q: want N or gpuN\n", s)
			return 2
		}
		ids = append(ids, id)
	}
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
	o := recycle.Options{Root: *root, Profile: *profile, Units: ids, Policy: p, Dir: filepath.Join(*root, *dir), Log: stdout}
	o.Erase.Erase.Overwrite = *overwrite
	s, err := manifest.LoadSigner(filepath.Join(*root, *key))
	if err != nil {
		fmt.Fprintf(stderr, "passage recycle: %v\n", err)
		return 2
	}
	o.Signers = append(o.Signers, s)
	if v, err := manifest.NewVerifier(s.Public()); err == nil {
		o.Verifier = v
	}
	if *tpm != "off" {
		ts, meas, err := tpmkey.ForBoot(*root)
		switch {
		case err == nil:
			if c, ok := ts.(io.Closer); ok {
				defer c.Close()
			}
			o.Signers = append([]manifest.Signer{ts}, o.Signers...)
			o.Measurer = meas
			if c, ok := ts.(manifest.Counter); ok {
				o.Counters = append(o.Counters, c)
			}
		case *tpm == "on":
			fmt.Fprintf(stderr, "passage recycle: --tpm on: %v\n", err)
			return 1
		}
	}
	if *genFile != "" {
		o.Counters = append(o.Counters, manifest.FileCounter{Path: *genFile})
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
