package initramfs

import (
	"bytes"
	"errors"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeSystem records calls; its Sleep ends the goroutine running Do, so a test can observe
// that Do reached Hold (or a respawn) instead of returning.
type fakeSystem struct {
	mu        *sync.Mutex
	calls     []string
	pid       int
	powerErr  error
	mountErr  error
	roots     map[string]string // passage.root= identity -> device; a /dev path is itself
	findErr   error
	switchTo  error
	cgroups   []string // what ReleaseCgroups unmounted
	cgroupErr error
	exists    map[string]bool
	sleeps    int
	maxSleep  int
}

func (f *fakeSystem) log(s string) {
	f.mu.Lock()
	f.calls = append(f.calls, s)
	f.mu.Unlock()
}

func (f *fakeSystem) sys() System {
	return System{
		Getpid:   func() int { return f.pid },
		Sync:     func() { f.log("sync") },
		PowerOff: func() error { f.log("poweroff"); return f.powerErr },
		Reboot:   func() error { f.log("reboot"); return f.powerErr },
		FindRoot: func(spec string, wait time.Duration, _ []string) (string, error) {
			f.log("find " + spec + " " + wait.String())
			if f.findErr != nil {
				return "", f.findErr
			}
			if d, ok := f.roots[spec]; ok {
				return d, nil
			}
			return spec, nil
		},
		MountRoot: func(dev, dir, fstype string) error {
			f.log("mount " + dev + " " + dir + " " + fstype)
			return f.mountErr
		},
		SwitchRoot: func(nr, init string) error { f.log("switch_root " + nr + " " + init); return f.switchTo },
		ReleaseCgroups: func() ([]string, error) {
			f.log("release-cgroups")
			return f.cgroups, f.cgroupErr
		},
		RunShell: func(p string) error { f.log("shell " + p); return errors.New("exit status 0") },
		Stat: func(p string) error {
			if f.exists[p] {
				return nil
			}
			return errors.New("no such file")
		},
		Sleep: func(time.Duration) {
			f.mu.Lock()
			f.sleeps++
			n := f.sleeps
			f.mu.Unlock()
			f.log("sleep")
			if n >= f.maxSleep {
				runtime.Goexit()
			}
		},
	}
}

func runDo(t *testing.T, c Config, f *fakeSystem) string {
	t.Helper()
	return runNeverReturns(t, func(con *bytes.Buffer) { Do(c, f.sys(), con) })
}

// runNeverReturns runs do, which must end in the fake system's last sleep, and returns
// what it printed.
func runNeverReturns(t *testing.T, do func(con *bytes.Buffer)) string {
	t.Helper()
	var con bytes.Buffer
	returned := make(chan bool, 1)
	go func() {
		defer func() { returned <- false }()
		do(&con)
		returned <- true
	}()
	select {
	case r := <-returned:
		if r {
			t.Fatal("returned")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("did not reach its fake sleep")
	}
	return con.String()
}

func TestHandoff(t *testing.T) {
	tests := []struct {
		name      string
		cfg       func(*Config)
		f         fakeSystem
		wantCalls string
		wantCon   string
	}{
		{"poweroff", func(c *Config) { c.Handoff = HandoffPoweroff }, fakeSystem{pid: 42},
			"sync poweroff sleep", "handoff poweroff failed: reboot(POWER_OFF) returned; holding"},
		{"poweroff refused", func(c *Config) { c.Handoff = HandoffPoweroff }, fakeSystem{powerErr: errors.New("EPERM")},
			"sync poweroff sleep", "reboot(POWER_OFF): EPERM; holding"},
		{"hold", func(c *Config) { c.Handoff = HandoffHold }, fakeSystem{maxSleep: 3},
			"sleep sleep sleep", "holding (passage.handoff=hold)"},
		{"switch_root not pid 1", func(c *Config) { c.Handoff, c.Root = HandoffSwitchRoot, "/dev/sda2" }, fakeSystem{pid: 300},
			"sleep", "passage runs as pid 300, not 1"},
		{"switch_root mount fails", func(c *Config) { c.Handoff, c.Root, c.RootFSType = HandoffSwitchRoot, "/dev/sda2", "ext4" },
			fakeSystem{pid: 1, mountErr: errors.New("ENXIO")},
			"find /dev/sda2 30s sync mount /dev/sda2 /newroot ext4 sleep", "mount /dev/sda2 (/dev/sda2) on /newroot: ENXIO"},
		{"switch_root no init", func(c *Config) { c.Handoff, c.Root = HandoffSwitchRoot, "/dev/sda2" }, fakeSystem{pid: 1},
			"find /dev/sda2 30s sync mount /dev/sda2 /newroot  sleep", "init /sbin/init on /dev/sda2"},
		{"switch_root exec fails", func(c *Config) { c.Handoff, c.Root = HandoffSwitchRoot, "/dev/sda2" },
			fakeSystem{pid: 1, exists: map[string]bool{"/newroot/sbin/init": true}, switchTo: errors.New("exec format error")},
			"find /dev/sda2 30s sync mount /dev/sda2 /newroot  release-cgroups switch_root /newroot /sbin/init sleep", "exec format error"},
		{"switch_root by label", func(c *Config) { c.Handoff, c.Root, c.RootFSType = HandoffSwitchRoot, "LABEL=root", "ext4" },
			fakeSystem{pid: 1, roots: map[string]string{"LABEL=root": "/dev/nvme2n1p2"}, exists: map[string]bool{"/newroot/sbin/init": true}},
			"find LABEL=root 30s sync mount /dev/nvme2n1p2 /newroot ext4 release-cgroups switch_root /newroot /sbin/init sleep", "root LABEL=root is /dev/nvme2n1p2"},
		{"switch_root frees the cgroup controllers", func(c *Config) { c.Handoff, c.Root, c.RootFSType = HandoffSwitchRoot, "LABEL=root", "ext4" },
			fakeSystem{pid: 1, roots: map[string]string{"LABEL=root": "/dev/vda1"}, exists: map[string]bool{"/newroot/sbin/init": true},
				cgroups: []string{"/sys/fs/cgroup/cpu", "/sys/fs/cgroup"}},
			"find LABEL=root 30s sync mount /dev/vda1 /newroot ext4 release-cgroups switch_root /newroot /sbin/init sleep",
			"unmounted the initramfs's cgroup v1 hierarchies /sys/fs/cgroup/cpu /sys/fs/cgroup"},
		{"switch_root goes on when a hierarchy stays", func(c *Config) { c.Handoff, c.Root, c.RootFSType = HandoffSwitchRoot, "LABEL=root", "ext4" },
			fakeSystem{pid: 1, roots: map[string]string{"LABEL=root": "/dev/vda1"}, exists: map[string]bool{"/newroot/sbin/init": true},
				cgroupErr: errors.New("umount /sys/fs/cgroup/cpu: device or resource busy")},
			"find LABEL=root 30s sync mount /dev/vda1 /newroot ext4 release-cgroups switch_root /newroot /sbin/init sleep",
			"cgroup v1 hierarchies left mounted (the real root's cgroup2 lacks their controllers): umount /sys/fs/cgroup/cpu: device or resource busy"},
		{"switch_root root never appears", func(c *Config) { c.Handoff, c.Root = HandoffSwitchRoot, "UUID=c0ffee00-1234-4cde-8f00-abcdef012345" },
			fakeSystem{pid: 1, findErr: errors.New("waiting for the root block device UUID=c0ffee00-1234-4cde-8f00-abcdef012345, 30s: context deadline exceeded")},
			"find UUID=c0ffee00-1234-4cde-8f00-abcdef012345 30s sleep", "switch_root: waiting for the root block device UUID="},
		{"shell respawns", func(c *Config) { c.Handoff = HandoffShell }, fakeSystem{maxSleep: 2, exists: map[string]bool{"/bin/sh": true}},
			"shell /bin/sh sleep shell /bin/sh sleep", "shell /bin/sh exited"},
		{"no shell", func(c *Config) { c.Handoff = HandoffShell }, fakeSystem{},
			"sleep", "no shell among"},
		{"failed handoff, emergency poweroff", func(c *Config) { c.Handoff, c.Root, c.Emergency = HandoffSwitchRoot, "/dev/sda2", EmergencyPoweroff },
			fakeSystem{pid: 1, mountErr: errors.New("ENXIO")},
			"find /dev/sda2 30s sync mount /dev/sda2 /newroot  sync poweroff sleep", "emergency (handoff switch_root failed): poweroff"},
		{"failed handoff, emergency shell", func(c *Config) { c.Handoff, c.Emergency = HandoffPoweroff, EmergencyShell },
			fakeSystem{maxSleep: 2, powerErr: errors.New("EPERM"), exists: map[string]bool{"/bbin/gosh": true}},
			"sync poweroff shell /bbin/gosh sleep shell /bbin/gosh sleep", "handoff poweroff failed: reboot(POWER_OFF): EPERM\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Defaults()
			tt.cfg(&c)
			f := tt.f
			f.mu = new(sync.Mutex)
			if f.maxSleep == 0 {
				f.maxSleep = 1
			}
			con := runDo(t, c, &f)
			if got := strings.Join(f.calls, " "); got != tt.wantCalls {
				t.Errorf("calls = %q, want %q", got, tt.wantCalls)
			}
			if !strings.Contains(con, tt.wantCon) {
				t.Errorf("console = %q, want it to contain %q", con, tt.wantCon)
			}
		})
	}
}

// TestEmergency: each passage.emergency= action, taken for a verdict, after the console
// says why; one that fails holds.
func TestEmergency(t *testing.T) {
	for _, tt := range []struct {
		action    Emergency
		f         fakeSystem
		wantCalls string
		wantCon   string
	}{
		{EmergencyHold, fakeSystem{maxSleep: 2}, "sleep sleep", "emergency (unit gpu1 failed): hold"},
		{EmergencyPoweroff, fakeSystem{}, "sync poweroff sleep", "reboot(POWER_OFF) returned; holding"},
		{EmergencyReboot, fakeSystem{}, "sync reboot sleep", "emergency reboot failed: reboot(RESTART) returned; holding"},
		{EmergencyReboot, fakeSystem{powerErr: errors.New("EPERM")}, "sync reboot sleep", "emergency reboot failed: EPERM; holding"},
		{EmergencyShell, fakeSystem{maxSleep: 1, exists: map[string]bool{"/bin/sh": true}}, "shell /bin/sh sleep", "shell /bin/sh exited"},
		{EmergencyShell, fakeSystem{}, "sleep", "emergency shell failed: no shell among"},
	} {
		t.Run(string(tt.action), func(t *testing.T) {
			c := Defaults()
			c.Emergency = tt.action
			f := tt.f
			f.mu = new(sync.Mutex)
			if f.maxSleep == 0 {
				f.maxSleep = 1
			}
			con := runNeverReturns(t, func(con *bytes.Buffer) { RunEmergency(c, f.sys(), con, "unit gpu1 failed") })
			if got := strings.Join(f.calls, " "); got != tt.wantCalls {
				t.Errorf("calls = %q, want %q", got, tt.wantCalls)
			}
			if !strings.HasPrefix(con, "passage: emergency (unit gpu1 failed): "+string(tt.action)) || !strings.Contains(con, tt.wantCon) {
				t.Errorf("console = %q, want it to contain %q", con, tt.wantCon)
			}
		})
	}
}

func TestEmergencyFor(t *testing.T) {
	for on, want := range map[EmergencyOn][3]bool{ // failed, degraded, neither
		EmergencyOnFailed:   {true, false, false},
		EmergencyOnDegraded: {true, true, false},
		EmergencyOnNever:    {false, false, false},
	} {
		c := Config{EmergencyOn: on}
		got := [3]bool{c.EmergencyFor(true, false), c.EmergencyFor(false, true), c.EmergencyFor(false, false)}
		if got != want {
			t.Errorf("emergency_on=%s: failed, degraded, neither -> %v, want %v", on, got, want)
		}
	}
}

// TestShellKeepsConsoleSignals: a Ctrl-C or Ctrl-\ typed at the console while the shell
// runs reaches passage too (the console's foreground process group); it must not end
// passage. Unhandled, the signal would kill this test's process.
func TestShellKeepsConsoleSignals(t *testing.T) {
	f := &fakeSystem{mu: &sync.Mutex{}, maxSleep: 1, exists: map[string]bool{"/bin/sh": true}}
	sys := f.sys()
	sys.RunShell = func(p string) error {
		f.log("shell " + p)
		for _, s := range []unix.Signal{unix.SIGINT, unix.SIGQUIT} {
			if err := unix.Kill(os.Getpid(), s); err != nil {
				return err
			}
		}
		time.Sleep(100 * time.Millisecond) // for the signals to arrive before the shell "exits"
		return nil
	}
	con := runNeverReturns(t, func(con *bytes.Buffer) { shell(sys, con) })
	if got := strings.Join(f.calls, " "); got != "shell /bin/sh sleep" {
		t.Errorf("calls = %q, want %q", got, "shell /bin/sh sleep")
	}
	if !strings.Contains(con, "shell /bin/sh exited (<nil>)") {
		t.Errorf("console = %q", con)
	}
}
