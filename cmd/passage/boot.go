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
	"runtime/debug"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/passage-boot/passage/buildinfo"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/stages/boot"
)

// cmdBoot is the uinit. It returns only with --no-handoff (tests, a synthetic --root),
// with --dry-run (a decision, run by a person, never the uinit), for -h, or on a usage
// error that names --no-handoff: as the uinit, returning would panic the kernel.
func cmdBoot(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("boot", stderr)
	root := fs.String("root", "/", "root of the tree to read (/proc, /sys, /lib/modules, /run) and write (/run/passage)")
	dryRun := fs.Bool("dry-run", false, "scan, decide and report, then return: write nothing to sysfs, load no module, touch no NIC, sign no manifest, hand nothing off")
	noHandoff := fs.Bool("no-handoff", false, "return after the report instead of handing off (never as the uinit)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			writeHelp(stdout, fs)
			return 0
		}
		if slices.Contains(args, "--no-handoff") || slices.Contains(args, "-no-handoff") {
			return 2
		}
		// As the uinit a bad flag must not end the boot: go on as a plain boot of "/".
		fmt.Fprintf(stderr, "passage boot: %v; booting with defaults\n", err)
		*root, *dryRun = "/", false
	}
	if *dryRun {
		// A dry run ends by itself: there is nothing to hand off to.
		*noHandoff = true
	}
	console := stdout
	var ttys []*os.File
	if !*noHandoff {
		ttys = emit.OpenConsoles(*root)
		if len(ttys) > 0 {
			ws := make([]io.Writer, len(ttys))
			for i, f := range ttys {
				ws[i] = f
			}
			console = io.MultiWriter(ws...)
		}
	}
	// Every console line into the kernel log too, so the booted system's journal keeps
	// them; no kernel log (a synthetic root without dev/kmsg) is no error.
	restoreKmsg := func() error { return nil }
	if k, err := initramfs.OpenKmsg(*root); err == nil {
		defer k.Close()
		settle := func() {
			for _, f := range ttys {
				emit.Drain(f)
			}
		}
		console = io.MultiWriter(console, initramfs.NewKmsg(k, settle))
		if restoreKmsg, err = initramfs.KmsgUnlimited(*root); err != nil {
			fmt.Fprintf(console, "passage: %v (the kernel log may drop lines)\n", err)
		}
	}

	cfg, summary, units, notRoot, signed := runBoot(*root, *dryRun, console)
	// A dry run signs nothing by design: only its verdicts can ask for the emergency.
	why := emergencyWhy(cfg, summary, units, signed || *dryRun)
	// The booted system keeps the kernel's own limit on its /dev/kmsg writers.
	if err := restoreKmsg(); err != nil {
		fmt.Fprintf(console, "passage: %v\n", err)
	}
	if *noHandoff {
		if why != "" {
			fmt.Fprintf(console, "passage: emergency %s would be taken (%s); --no-handoff\n", cfg.Emergency, why)
		}
		if summary == stages.Failed {
			return 1
		}
		return 0
	}
	emit.Mark(console, *root, "handoff")
	if why == "" {
		fmt.Fprintf(console, "passage: handoff %s\n", cfg.Handoff)
	} else {
		fmt.Fprintf(console, "passage: handoff %s not taken: %s\n", cfg.Handoff, why)
	}
	for _, f := range ttys {
		if err := emit.Drain(f); err != nil {
			fmt.Fprintf(console, "passage: %s: %v\n", f.Name(), err)
			emit.Drain(f)
		}
	}
	sys := initramfs.LinuxSystem()
	sys.NotRoot = notRoot
	if why != "" {
		initramfs.RunEmergency(cfg, sys, console, why)
	}
	initramfs.Do(cfg, sys, console)
	return 0 // not reached: neither returns
}

// emergencyWhy says why the boot takes its emergency action instead of the handoff, or ""
// for the handoff. A boot that wrote no signed manifest cannot go on, whatever
// passage.emergency_on says: the node would serve with nothing the hypervisor can verify.
// Otherwise passage.emergency_on chooses the unit verdicts that also take it (by default
// none: initramfs.EmergencyOn says why). A run that failed without units (an internal
// error before the decision) counts as failed.
func emergencyWhy(cfg initramfs.Config, summary stages.Status, units []stages.Unit, signed bool) string {
	if !signed {
		return "no signed manifest was written"
	}
	var failed, degraded []string
	for _, u := range units {
		switch u.Status {
		case stages.Failed:
			failed = append(failed, u.ID)
		case stages.Degraded:
			degraded = append(degraded, u.ID)
		}
	}
	if len(units) == 0 && summary == stages.Failed {
		if cfg.EmergencyFor(true, false) {
			return "the boot failed before any unit was decided"
		}
		return ""
	}
	if !cfg.EmergencyFor(len(failed) > 0, len(degraded) > 0) {
		return ""
	}
	var parts []string
	if len(failed) > 0 {
		parts = append(parts, "failed: "+strings.Join(failed, ", "))
	}
	if len(degraded) > 0 && cfg.EmergencyOn == initramfs.EmergencyOnDegraded {
		parts = append(parts, "degraded: "+strings.Join(degraded, ", "))
	}
	return "units " + strings.Join(parts, "; ") + " (passage.emergency_on=" + string(cfg.EmergencyOn) + ")"
}

// runBoot does everything before the handoff. A panic outside the runner (which recovers
// its stages' own) still ends in a handoff, with the run counted as failed.
func runBoot(root string, dryRun bool, console io.Writer) (cfg initramfs.Config, summary stages.Status, units []stages.Unit, notRoot []string, signed bool) {
	cfg = initramfs.Defaults()
	summary = stages.Failed
	defer func() {
		if p := recover(); p != nil {
			fmt.Fprintf(console, "passage: internal error: %v\n%s\n", p, debug.Stack())
			if cfg.Emit == initramfs.EmitConsole {
				emit.Done(console, string(stages.Failed))
			}
			summary = stages.Failed
		}
	}()

	// The build first: whoever reads a console capture or a log learns which release
	// decided before anything it decided.
	build := buildinfo.Read()
	fmt.Fprintln(console, build)
	emit.Mark(console, root, "uinit-start")
	cfg, err := initramfs.ReadConfig(root)
	if err != nil {
		cfg.Errors = append(cfg.Errors, err)
	}
	for _, e := range cfg.Errors {
		fmt.Fprintf(console, "passage: %v\n", e)
	}

	// /run a tmpfs before anything writes /run/passage, so that switch_root moves it,
	// files and all, into the real root (initramfs.SetUpRun says why). Only on the live
	// root: a --root tree is someone's directory, and a booted host's /run is mounted.
	if root == "/" {
		if what, err := initramfs.SetUpRun(root, initramfs.LinuxRunOps()); err != nil {
			fmt.Fprintf(console, "passage: %v: a switch_root will not hand /run/passage to the real root\n", err)
		} else {
			fmt.Fprintf(console, "passage: %s\n", what)
		}
	}
	b := &boot.Boot{Root: root, Config: cfg, DryRun: dryRun, Console: console}
	var logw io.Writer
	if _, err := boot.Beneath(root, initramfs.RunDir); err != nil {
		fmt.Fprintf(console, "passage: %v\n", err)
	}
	// passage.log= is the tree's word: its directory beneath the root, the file itself
	// not a link.
	logDir, err := boot.Beneath(root, filepath.Dir(filepath.Clean("/"+cfg.Log)))
	if err == nil {
		var f *os.File
		f, err = os.OpenFile(filepath.Join(logDir, filepath.Base(cfg.Log)), os.O_CREATE|os.O_WRONLY|os.O_APPEND|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o644)
		if err == nil {
			defer f.Close()
			logw = f
		}
	}
	if err != nil {
		fmt.Fprintf(console, "passage: log %s: %v\n", cfg.Log, err)
	}
	if logw != nil {
		if err := writeBuildRecord(logw, build); err != nil {
			fmt.Fprintf(console, "passage: log %s: %v\n", cfg.Log, err)
		}
	}

	// The TPM starts with the scan stage (Boot.scan), after the vfio stack is loaded.
	st := &stages.State{}
	rn := &stages.Runner{Stages: b.Stages(), Timeout: cfg.StageTimeout, Console: console, Log: logw, Verbose: cfg.Debug}
	if cfg.Debug {
		rn.Tick = time.Second
	}
	results, err := rn.Run(context.Background(), st)
	if err != nil {
		fmt.Fprintf(console, "passage: %v\n", err)
	}
	units = st.Units()
	stages.WriteUnitTable(console, units)
	if logw != nil {
		if err := stages.WriteUnitsJSON(logw, units); err != nil {
			fmt.Fprintf(console, "passage: log %s: %v\n", cfg.Log, err)
		}
	}
	summary = stages.Summary(results, units)
	if err != nil {
		summary = stages.Failed
	}
	if dryRun {
		fmt.Fprintf(console, "passage: boot --dry-run %s: the decision only; nothing written, bound, erased or signed\n", summary)
	} else {
		fmt.Fprintf(console, "passage: boot %s\n", summary)
	}

	if cfg.Emit == initramfs.EmitConsole {
		// A fresh scan beside the manifest, so whoever reads the console can check the
		// manifest's claims against the node rather than against itself.
		if err := b.WriteReadback(); err != nil {
			fmt.Fprintf(console, "passage: %v\n", err)
		}
		// A kernel message inside a base64 line spoils the block: keep printk off the
		// console while the blocks go out.
		restore, err := emit.QuietKernel(root)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			fmt.Fprintf(console, "passage: %v\n", err)
		}
		if err := emit.Dir(console, b.RunDir()); err != nil {
			fmt.Fprintf(console, "passage: %v\n", err)
		}
		emit.Done(console, string(summary))
		if err := restore(); err != nil {
			fmt.Fprintf(console, "passage: %v\n", err)
		}
	}
	return cfg, summary, units, b.PassthroughAddrs(), b.ManifestSigned()
}

// buildRecord is log.jsonl's first line: {"type":"build", and the build's fields}.
type buildRecord struct {
	Type string `json:"type"`
	buildinfo.Info
}

func writeBuildRecord(w io.Writer, b buildinfo.Info) error {
	j, err := json.Marshal(buildRecord{Type: "build", Info: b})
	if err != nil {
		return err
	}
	_, err = w.Write(append(j, '\n'))
	return err
}
