package boot

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// fault is what a faulty part does when the stage under test reaches it.
type fault int

const (
	faultError fault = iota
	faultPanic
	faultHang // blocks past the stage's deadline, until the test releases it
)

func (f fault) String() string { return [...]string{"error", "panic", "hang"}[f] }

// trap fires a fault on the first call and records every call after the fault. An
// error fault keeps failing every later call for the same function (key), as a device
// that stopped answering does; the other faults fire once.
type trap struct {
	f       fault
	release chan struct{}
	mu      sync.Mutex
	fired   bool
	key     string
	after   []string // calls that reached the part after the fault fired
}

func newTrap(f fault) *trap { return &trap{f: f, release: make(chan struct{})} }

// hit is called by the part on every write of function key; it returns the error to give.
func (t *trap) hit(key, what string) error {
	t.mu.Lock()
	if t.fired {
		t.after = append(t.after, what)
		same := key == t.key
		t.mu.Unlock()
		if t.f == faultError && same {
			return fmt.Errorf("test: %s: %w", what, syscall.EINVAL)
		}
		return nil
	}
	t.fired, t.key = true, key
	t.mu.Unlock()
	switch t.f {
	case faultPanic:
		panic("test: " + what)
	case faultHang:
		<-t.release
		return nil
	}
	return fmt.Errorf("test: %s: %w", what, syscall.EINVAL)
}

func (t *trap) writesAfter() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]string(nil), t.after...)
}

// faultyConfig is config space whose writes hit the trap.
type faultyConfig struct {
	pci.SysfsConfig
	t *trap
}

func (c faultyConfig) WriteConfig(a pci.Address, off int64, p []byte) error {
	if err := c.t.hit(a.String(), fmt.Sprintf("config %s@%#x", a, off)); err != nil {
		return err
	}
	return c.SysfsConfig.WriteConfig(a, off, p)
}

// faultySysfs is the simulated kernel with its stores going through the trap.
type faultySysfs struct {
	*vfiotest.Kernel
	t *trap
}

func (s faultySysfs) WriteFile(name string, data []byte) error {
	key := fnOf(name)
	if _, err := pci.ParseAddress(key); err != nil {
		key = strings.TrimSpace(string(data)) // drivers_probe, unbind: the BDF is the value
	}
	if err := s.t.hit(key, name+" <- "+strings.TrimSpace(string(data))); err != nil {
		return err
	}
	return s.Kernel.WriteFile(name, data)
}

// fnOf is the function a sysfs store concerns: the BDF in its path or its value.
func fnOf(name string) string {
	for _, part := range strings.Split(name, "/") {
		if _, err := pci.ParseAddress(part); err == nil {
			return part
		}
	}
	return name
}

// TestStageFaultsFailClosed: a stage that covers units (acs, vfio) and errors, panics or
// hangs past its deadline leaves every unit it had not finished failed in the manifest,
// writes nothing after the fault, and leaves no goroutine running once released.
func TestStageFaultsFailClosed(t *testing.T) {
	for _, stage := range []string{"acs", "vfio"} {
		for _, f := range []fault{faultError, faultPanic, faultHang} {
			t.Run(stage+"/"+f.String(), func(t *testing.T) {
				root := pcitest.New(t, pcitest.B300()).Root
				k, err := vfiotest.New(root)
				if err != nil {
					t.Fatal(err)
				}
				if err := k.Load(vfiobind.Modules...); err != nil {
					t.Fatal(err)
				}
				tr := newTrap(f)
				cfg := initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.net=off passage.tpm=off")
				b := &Boot{Root: root, Config: cfg, Sysfs: k, Now: func() time.Time { return time.Unix(1e9, 0) }}
				if stage == "acs" {
					b.ConfigIO = faultyConfig{pci.SysfsConfig{Root: root}, tr}
				} else {
					b.Sysfs = faultySysfs{k, tr}
				}
				var list []stages.Stage
				for _, s := range b.Stages() {
					switch s.Name {
					case "scan", "decide", "acs", "vfio", "manifest":
						// Only a hang needs a deadline to end it, and only the hung stage's
						// is short: an error or a panic ends its stage at once, and a stage
						// that merely runs slowly on a loaded machine must not be taken for
						// a hung one (a deadline is not what this test holds the stage to).
						if s.Name == stage && f == faultHang {
							s.Timeout = 300 * time.Millisecond
						}
						list = append(list, s)
					}
				}
				before := runtime.NumGoroutine()
				st := &stages.State{}
				rn := &stages.Runner{Stages: list, Timeout: 2 * time.Minute, Grace: 100 * time.Millisecond}
				rs, err := rn.Run(context.Background(), st)
				if err != nil {
					t.Fatal(err)
				}
				close(tr.release)

				status := map[string]stages.Status{}
				for _, r := range rs {
					status[r.Name] = r.Status
				}
				if f != faultError && status[stage] != stages.Failed {
					t.Errorf("stage %s %s after a %s", stage, status[stage], f)
				}
				if b.Manifest == nil {
					t.Fatal("no manifest")
				}
				// The faulted unit is the first one the stage touched: gpu0. A stage that
				// failed as a whole (panic, hang) fails every unit; an error fails gpu0.
				for _, u := range b.Manifest.Units {
					whole := f != faultError
					if (whole || u.ID == "gpu0") && u.Status != "failed" {
						t.Errorf("%s: %s after a %s in %s (%v)", u.ID, u.Status, f, stage, u.Reasons)
					}
					if !whole && u.ID != "gpu0" && u.Status != "ready" {
						t.Errorf("%s: %s, want ready: the fault was gpu0's (%v)", u.ID, u.Status, u.Reasons)
					}
					if u.Status == "failed" && len(u.Reasons) == 0 {
						t.Errorf("%s failed without a reason", u.ID)
					}
				}
				if f == faultHang {
					// Released after the runner gave up on it: the stage's goroutine must
					// write nothing more and end.
					deadline := time.Now().Add(5 * time.Second)
					for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
						time.Sleep(10 * time.Millisecond)
					}
					if n := runtime.NumGoroutine(); n > before {
						buf := make([]byte, 1<<16)
						t.Errorf("%d goroutines outlive the stage (%d before):\n%s", n, before, buf[:runtime.Stack(buf, true)])
					}
				}
				if after := tr.writesAfter(); f != faultError && len(after) > 0 {
					t.Errorf("written after the %s: %v", f, after)
				}
				if f == faultError {
					// After an error the unit's own writes stop: no other port of unit 0 (acs),
					// no other function of unit 0 (vfio: the GPU's override failed first).
					for _, w := range tr.writesAfter() {
						if isUnit0(w) && !strings.Contains(w, tr.key) {
							t.Errorf("unit 0 written after its failure: %s", w)
						}
					}
				}
			})
		}
	}
}

// isUnit0 says whether a write names one of unit 0's functions (buses 15-1c).
func isUnit0(w string) bool {
	for _, bus := range []string{"15", "16", "17", "18", "19", "1a", "1b", "1c"} {
		if strings.Contains(w, "0000:"+bus+":") {
			return true
		}
	}
	return false
}
