package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/topology"
)

// planFlags are the inputs plan and render share.
type planFlags struct {
	src          treeSource
	profile      string
	units        unitList
	ats, cmdline string
	erase        string
	numa         bool
	// command is the command the decision predicts (plan --for); "" is the boot.
	command string
}

func (f *planFlags) register(fs *flag.FlagSet) {
	f.src.register(fs)
	fs.StringVar(&f.profile, "profile", "b300", "built-in profile ("+strings.Join(topology.Builtins(), ", ")+") or a YAML/JSON file")
	f.units.register(fs, "units the guest plan lays out: all, or `UNITS` like gpu0,gpu1 (or 0,1), repeatable; the verdicts, the bind set and a saved decision cover every unit", true)
	fs.BoolVar(&f.numa, "numa", false, "one pxb-pcie expander per unit on its NUMA node (guest NODE/SYS distances)")
	fs.StringVar(&f.ats, "ats", "", "ATS policy for NIC functions without ATS: prefer or require (default: passage.ats= from the command line, else prefer)")
	fs.StringVar(&f.erase, "erase", "", "erase policy: off, auto or require (default: passage.erase= from the command line, else the profile's)")
	fs.StringVar(&f.cmdline, "cmdline", "", "kernel command line (default: <root>/proc/cmdline with --root)")
}

// errUsage marks bad input (exit 2); other errors are failed checks (exit 1).
type errUsage struct{ error }

// decide loads the tree and the profile and computes the decision. With --root it reads
// the kernel's state under the root too (command line, lockdown), as apply does, so the
// two agree; a snapshot or a dump has none.
func (f *planFlags) decide(fs *flag.FlagSet) (*decision.Decision, error) {
	units := f.units.units()
	prof, err := topology.LoadProfile(f.profile)
	if err != nil {
		return nil, errUsage{err}
	}
	tree, err := f.src.load(fs)
	if err != nil {
		return nil, errUsage{err}
	}
	var live decision.Live
	if f.src.snapshot == "" && f.src.dump == "" {
		if live, err = decision.ReadLive(f.src.root); err != nil {
			return nil, errUsage{err}
		}
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if set["cmdline"] {
		live.Cmdline = f.cmdline
	}
	if !set["ats"] {
		f.ats = string(initramfs.ParseCmdline(live.Cmdline).ATS)
	}
	policy, err := firmware.ParsePolicy(f.ats)
	if err != nil {
		return nil, errUsage{fmt.Errorf("--ats: %w", err)}
	}
	ep, err := erasePolicy(set["erase"], f.erase, live.Cmdline)
	if err != nil {
		return nil, errUsage{err}
	}
	cmd, err := decision.ParseCommand(f.command)
	if err != nil {
		return nil, errUsage{fmt.Errorf("--for: %w", err)}
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: prof, ATS: policy, Erase: ep, Live: live, For: cmd,
		Guest: topology.GuestOptions{Units: units, NUMA: f.numa}})
	if err != nil {
		return nil, errUsage{err}
	}
	if d.GuestErr != nil && units != nil {
		// A unit the operator named does not exist or is failed: bad input.
		return d, errUsage{d.GuestErr}
	}
	return d, nil
}

// erasePolicy is --erase when given, else passage.erase= on the command line; ""
// leaves the profile's default to the decision.
func erasePolicy(given bool, flagValue, cmdline string) (erase.Policy, error) {
	v := flagValue
	if !given {
		v = initramfs.ParseCmdline(cmdline).Erase
	}
	if v == "" {
		return "", nil
	}
	p, err := erase.ParsePolicy(v)
	if err != nil {
		return "", fmt.Errorf("--erase: %w", err)
	}
	return p, nil
}

// verdictErr is the exit status of a decision's verdicts: labelling that contradicts
// itself, a profile that found none of its units, or a failed unit is 1; degraded units
// are usable and exit 0.
func verdictErr(d *decision.Decision, vs []decision.Verdict) error {
	if err := d.Err(); err != nil {
		return err
	}
	for _, v := range vs {
		if v.Status == topology.StatusFailed {
			return fmt.Errorf("%s failed: %s", v.Unit, strings.Join(v.Reasons, "; "))
		}
	}
	return nil
}

func exitFor(stderr io.Writer, err error) int {
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "passage: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
	var u errUsage
	if errors.As(err, &u) {
		return 2
	}
	return 1
}

func cmdPlan(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("plan", stderr)
	var f planFlags
	f.register(fs)
	fs.StringVar(&f.command, "for", string(decision.CommandBoot), "the command whose outcome the plan predicts: boot, apply or recycle (apply erases nothing, so under an active erase policy its units end failed or degraded); apply --plan takes only a plan --for apply")
	asJSON := fs.Bool("json", false, "print the plan as JSON")
	var names namesFlag
	names.register(fs)
	outFile := fs.String("o", "", "also save the decision to `FILE`, for apply --plan (applies only while the node still matches it)")
	deprecatedAlias(fs, "out", "o")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	d, err := f.decide(fs)
	if d == nil {
		return exitFor(stderr, err)
	}
	db, nerr := names.open(d.Tree)
	if nerr != nil {
		fmt.Fprintf(stderr, "passage plan: %v\n", nerr)
		return 2
	}
	if *outFile != "" {
		if serr := saveDecision(d, *outFile); serr != nil {
			fmt.Fprintf(stderr, "passage plan: %v\n", serr)
			return 2
		}
	}
	var werr error
	if *asJSON {
		werr = d.WriteJSONNamed(stdout, namer(db))
	} else {
		werr = d.WriteTextNamed(stdout, namer(db))
	}
	if werr != nil {
		fmt.Fprintf(stderr, "passage plan: %v\n", werr)
		return 1
	}
	if err == nil {
		err = verdictErr(d, d.Decided())
	}
	return exitFor(stderr, err)
}

// saveDecision writes the decision for apply --plan, atomically.
func saveDecision(d *decision.Decision, path string) error {
	s, err := d.Save()
	if err != nil {
		return err
	}
	var b bytes.Buffer
	if err := s.Write(&b); err != nil {
		return err
	}
	return manifest.WriteAtomic(filepath.Dir(path), filepath.Base(path), b.Bytes())
}
