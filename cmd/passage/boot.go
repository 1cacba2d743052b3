package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"syscall"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/stages/boot"
)

// cmdBoot is the uinit. It returns only with --no-handoff (tests, a synthetic --root) or on
// a usage error that names --no-handoff: as the uinit, returning would panic the kernel.
func cmdBoot(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("boot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	root := fs.String("root", "/", "root of the tree to read (/proc, /sys, /lib/modules, /run) and write (/run/passage)")
	dryRun := fs.Bool("dry-run", false, "scan, label and report; write nothing to sysfs, load no module, touch no NIC")
	noHandoff := fs.Bool("no-handoff", false, "return after the report instead of handing off (never as the uinit)")
	if err := fs.Parse(args); err != nil {
		if slices.Contains(args, "--no-handoff") || slices.Contains(args, "-no-handoff") || err == flag.ErrHelp {
			return 2
		}
		// As the uinit a bad flag must not end the boot: go on as a plain boot of "/".
		fmt.Fprintf(stderr, "passage boot: %v; booting with defaults\n", err)
		*root, *dryRun = "/", false
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

	cfg, summary, notRoot := runBoot(*root, *dryRun, console)
	if *noHandoff {
		if summary == stages.Failed {
			return 1
		}
		return 0
	}
	emit.Mark(console, *root, "handoff")
	fmt.Fprintf(console, "passage: handoff %s\n", cfg.Handoff)
	for _, f := range ttys {
		if err := emit.Drain(f); err != nil {
			fmt.Fprintf(console, "passage: %s: %v\n", f.Name(), err)
			emit.Drain(f)
		}
	}
	sys := initramfs.LinuxSystem()
	sys.NotRoot = notRoot
	initramfs.Do(cfg, sys, console)
	return 0 // not reached: Do never returns
}

// runBoot does everything before the handoff. A panic outside the runner (which recovers
// its stages' own) still ends in a handoff, with the run counted as failed.
func runBoot(root string, dryRun bool, console io.Writer) (cfg initramfs.Config, summary stages.Status, notRoot []string) {
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

	emit.Mark(console, root, "uinit-start")
	cfg, err := initramfs.ReadConfig(root)
	if err != nil {
		cfg.Errors = append(cfg.Errors, err)
	}
	for _, e := range cfg.Errors {
		fmt.Fprintf(console, "passage: %v\n", e)
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

	// The TPM's slow start (key creation, counter increment) overlaps the PCIe stages.
	b.StartTPM()
	st := &stages.State{}
	rn := &stages.Runner{Stages: b.Stages(), Timeout: cfg.StageTimeout, Console: console, Log: logw}
	results, err := rn.Run(context.Background(), st)
	if err != nil {
		fmt.Fprintf(console, "passage: %v\n", err)
	}
	units := st.Units()
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
	fmt.Fprintf(console, "passage: boot %s\n", summary)

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
	return cfg, summary, b.PassthroughAddrs()
}
