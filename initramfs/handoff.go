package initramfs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"time"

	"github.com/u-root/u-root/pkg/mount"
	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/initramfs/rootdev"
)

// System is the handful of process- and machine-level operations a handoff needs. Tests
// replace them; LinuxSystem is the real thing.
type System struct {
	Getpid   func() int
	Sync     func()
	PowerOff func() error
	Reboot   func() error
	// FindRoot resolves passage.root= (UUID=, LABEL=, PARTUUID= or a /dev path) to a
	// device node, waiting up to wait for it to appear (initramfs/rootdev).
	// notRoot are PCI functions whose block devices are never the root (passthrough
	// functions: a tenant's disk).
	FindRoot func(spec string, wait time.Duration, notRoot []string) (dev string, err error)
	// NotRoot are the passthrough functions of this boot, for FindRoot.
	NotRoot    []string
	MountRoot  func(dev, dir, fstype string) error
	SwitchRoot func(newRoot, init string) error // returns only on failure
	// ReleaseCgroups unmounts the cgroup v1 hierarchies of the initramfs
	// (CgroupV1Mounts) and says which.
	ReleaseCgroups func() ([]string, error)
	RunShell       func(path string) error // runs the shell to completion
	Stat           func(path string) error
	Sleep          func(time.Duration)
}

// LinuxSystem returns the operations of a live boot.
func LinuxSystem() System {
	return System{
		Getpid: os.Getpid,
		Sync:   unix.Sync,
		PowerOff: func() error {
			return unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
		},
		Reboot: func() error {
			return unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
		},
		MountRoot: func(dev, dir, fstype string) error {
			mkdir := func() error { return os.MkdirAll(dir, 0o755) }
			var err error
			if fstype != "" {
				_, err = mount.Mount(dev, dir, fstype, "", 0, mkdir)
			} else {
				_, err = mount.TryMount(dev, dir, "", 0, mkdir)
			}
			return err
		},
		FindRoot: func(spec string, wait time.Duration, notRoot []string) (string, error) {
			s, err := rootdev.Parse(spec)
			if err != nil {
				return "", fmt.Errorf("passage.root=%s: %w", spec, err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), wait)
			defer cancel()
			return rootdev.Wait(ctx, "/", s, notRoot)
		},
		SwitchRoot: mount.SwitchRoot,
		ReleaseCgroups: func() ([]string, error) {
			f, err := os.Open("/proc/self/mountinfo")
			if err != nil {
				return nil, err
			}
			dirs, err := CgroupV1Mounts(f)
			f.Close()
			if err != nil {
				return nil, err
			}
			var done []string
			var errs []error
			for _, d := range dirs {
				if err := unix.Unmount(d, 0); err != nil {
					errs = append(errs, fmt.Errorf("umount %s: %w", d, err))
					continue
				}
				done = append(done, d)
			}
			return done, errors.Join(errs...)
		},
		RunShell: func(path string) error {
			c := exec.Command(path)
			c.Stdin, c.Stdout, c.Stderr = os.Stdin, os.Stdout, os.Stderr
			return c.Run()
		},
		Stat: func(p string) error {
			_, err := os.Stat(p)
			return err
		},
		Sleep: time.Sleep,
	}
}

// NewRoot is where passage.root is mounted before switch_root.
const NewRoot = "/newroot"

// Shells are tried in order by the shell handoff: u-root's gosh first (the image's
// -defaultsh, built to read plain lines: image/initramfs.sh says why), then whatever
// /bin/sh is.
var Shells = []string{"/bbin/gosh", "/bin/gosh", "/bin/defaultsh", "/bin/sh", "/bbin/elvish"}

// Do performs the handoff c asks for and never returns: u-root's init panics the kernel
// when the uinit exits under console=ttyS0, which would lose the console an operator needs
// to see why. When the handoff fails it says so on the console and takes the emergency
// action (passage.emergency=, hold by default).
func Do(c Config, sys System, console io.Writer) {
	err := attempt(c, sys, console)
	if err == nil {
		// Only hold and a shell that keeps being respawned get here, and they do not return.
		err = errors.New("returned")
	}
	if c.Emergency == EmergencyHold || c.Emergency == "" {
		fmt.Fprintf(console, "passage: handoff %s failed: %v; holding (passage boot never returns)\n", c.Handoff, err)
		Hold(sys)
	}
	fmt.Fprintf(console, "passage: handoff %s failed: %v\n", c.Handoff, err)
	RunEmergency(c, sys, console, fmt.Sprintf("handoff %s failed", c.Handoff))
}

// EmergencyFor says whether a verdict with a failed or a degraded unit takes the
// emergency action instead of the handoff (passage.emergency_on=).
func (c Config) EmergencyFor(failed, degraded bool) bool {
	switch c.EmergencyOn {
	case EmergencyOnNever:
		return false
	case EmergencyOnDegraded:
		return failed || degraded
	}
	return failed
}

// RunEmergency takes passage.emergency's action, after saying on the console why, and never
// returns: an action that fails (no shell, a reboot refused) holds.
func RunEmergency(c Config, sys System, console io.Writer, why string) {
	fmt.Fprintf(console, "passage: emergency (%s): %s (passage.emergency=%s)\n", why, c.Emergency, c.Emergency)
	var err error
	switch c.Emergency {
	case EmergencyShell:
		err = shell(sys, console)
	case EmergencyReboot:
		sys.Sync()
		if err = sys.Reboot(); err == nil {
			err = errors.New("reboot(RESTART) returned")
		}
	case EmergencyPoweroff:
		sys.Sync()
		if err = sys.PowerOff(); err == nil {
			err = errors.New("reboot(POWER_OFF) returned")
		}
	case EmergencyHold, "":
		Hold(sys)
	default:
		err = fmt.Errorf("unknown emergency action %q", c.Emergency)
	}
	fmt.Fprintf(console, "passage: emergency %s failed: %v; holding\n", c.Emergency, err)
	Hold(sys)
}

// Hold sleeps forever. A sleeping goroutine keeps the Go runtime from declaring a deadlock,
// which `select {}` alone would do in a process with nothing else running.
func Hold(sys System) {
	for {
		sys.Sleep(time.Hour)
	}
}

// shell runs the first shell of Shells on the console, again each time it exits (an
// operator typing exit must not panic the kernel); it returns only when there is none.
func shell(sys System, console io.Writer) error {
	// The console's line discipline sends SIGINT (Ctrl-C) and SIGQUIT (Ctrl-\) to its
	// foreground process group, and passage is in it: u-root's init made the console the
	// controlling terminal of the session passage leads. Left to their default they end
	// passage: under QEMU a Ctrl-C at the prompt left a console that echoed keys and
	// answered nothing. Caught, they end only what the shell runs: a caught signal is
	// reset to its default in a child at exec, an ignored one stays ignored.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, unix.SIGINT, unix.SIGQUIT)
	defer signal.Stop(sigs)
	for {
		sh := ""
		for _, s := range Shells {
			if sys.Stat(s) == nil {
				sh = s
				break
			}
		}
		if sh == "" {
			return fmt.Errorf("no shell among %v", Shells)
		}
		err := sys.RunShell(sh)
		fmt.Fprintf(console, "passage: shell %s exited (%v); starting it again\n", sh, err)
		sys.Sleep(time.Second)
	}
}

func attempt(c Config, sys System, console io.Writer) error {
	switch c.Handoff {
	case HandoffPoweroff:
		sys.Sync()
		if err := sys.PowerOff(); err != nil {
			return fmt.Errorf("reboot(POWER_OFF): %w", err)
		}
		return errors.New("reboot(POWER_OFF) returned")
	case HandoffSwitchRoot:
		return switchRoot(c, sys, console)
	case HandoffShell:
		return shell(sys, console)
	case HandoffHold, "":
		fmt.Fprintln(console, "passage: holding (passage.handoff=hold)")
		Hold(sys)
	}
	return fmt.Errorf("unknown handoff %q", c.Handoff)
}

func switchRoot(c Config, sys System, console io.Writer) error {
	if c.Root == "" {
		return errors.New("passage.root not set")
	}
	// The new init must be PID 1: systemd and sysvinit refuse to run otherwise. Under
	// u-root's init, passage is a child (the uinit), so a switch_root from here would leave
	// the real init without PID 1.
	if pid := sys.Getpid(); pid != 1 {
		return fmt.Errorf("switch_root %s: passage runs as pid %d, not 1 (u-root's init owns pid 1: boot with rdinit=/bbin/passage to switch_root)", c.Root, pid)
	}
	// By identity, never by the name the kernel gave the disk this boot: NVMe names
	// follow probe order, and passthrough NVMe are rebound during the boot.
	dev, err := sys.FindRoot(c.Root, c.RootWait, sys.NotRoot)
	if err != nil {
		return fmt.Errorf("switch_root: %w", err)
	}
	if dev != c.Root {
		fmt.Fprintf(console, "passage: root %s is %s\n", c.Root, dev)
	}
	sys.Sync()
	if err := sys.MountRoot(dev, NewRoot, c.RootFSType); err != nil {
		return fmt.Errorf("switch_root: mount %s (%s) on %s: %w", dev, c.Root, NewRoot, err)
	}
	if err := sys.Stat(filepath.Join(NewRoot, c.Init)); err != nil {
		return fmt.Errorf("switch_root: init %s on %s: %w", c.Init, c.Root, err)
	}
	// The real root's init mounts cgroup2 and needs every controller in it: the v1
	// hierarchies u-root's init mounted would keep cpu and the others from it. A failure
	// is said and the handoff goes on (the real root may use cgroup v1 itself).
	if sys.ReleaseCgroups != nil {
		if dirs, err := sys.ReleaseCgroups(); err != nil {
			fmt.Fprintf(console, "passage: switch_root: cgroup v1 hierarchies left mounted (the real root's cgroup2 lacks their controllers): %v\n", err)
		} else if len(dirs) > 0 {
			fmt.Fprintf(console, "passage: switch_root: unmounted the initramfs's cgroup v1 hierarchies %s\n", strings.Join(dirs, " "))
		}
	}
	if err := sys.SwitchRoot(NewRoot, c.Init); err != nil {
		return fmt.Errorf("switch_root %s: %w", c.Root, err)
	}
	return errors.New("switch_root returned")
}
