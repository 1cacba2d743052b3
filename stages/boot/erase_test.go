package boot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/vfiobind"
)

// TestBootEraseRecord runs a whole boot under b300's default passage.erase=require with
// a simulated controller behind each NVMe; unit 2's keeps the tenant's data through its
// sanitize. The signed manifest has unit 2 failed with the reason, its erase record
// saying why, none of its functions on vfio-pci; every other unit ready, erased by
// sanitize crypto erase, read back, every function reset.
func TestBootEraseRecord(t *testing.T) {
	bn := newBootNode(t)
	root := bn.node.Root
	ctrls := simulateNVMe(t, root, "flr bus", func(a pci.Address) *erasetest.Controller {
		c := erasetest.New("S"+a.String(), erase.SANICAPCES|erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 22})
		c.Write(1, 0, bytes.Repeat([]byte{0xa5}, 512))
		return c
	})
	victim := bn.node.Addr("nvme2")
	ctrls[victim].Faults.KeepData = true

	b := &Boot{Root: root, Config: initramfs.ParseCmdline(bootCmdline + " passage.net=off"), Sysfs: bn.kern,
		OpenNVMe: func(_ context.Context, a pci.Address) (erase.Controller, string, error) { return ctrls[a], "nvme", nil }}
	if _, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{}); err != nil {
		t.Fatal(err)
	}
	m, err := bn.envelopeOnDisk()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Units) != 8 {
		t.Fatalf("%d units", len(m.Units))
	}
	for _, u := range m.Units {
		e := u.Erase
		if e == nil || e.Policy != "require" || len(e.NVMe) != 1 || len(e.Resets) != len(u.Functions) {
			t.Errorf("%s: erase record %+v", u.ID, e)
			continue
		}
		if u.ID == "gpu2" {
			if u.Status != manifest.StatusFailed || !strings.Contains(strings.Join(u.Reasons, ";"), "data remains") ||
				!strings.Contains(e.NVMe[0].Error, "data remains") {
				t.Errorf("gpu2: %s %v, record error %q: want failed, data remains", u.Status, u.Reasons, e.NVMe[0].Error)
			}
			for _, f := range u.Functions {
				if f.DriverAfter == "vfio-pci" {
					t.Errorf("gpu2 %s on vfio-pci with its NVMe not erased", f.BDF)
				}
			}
			continue
		}
		n := e.NVMe[0]
		if u.Status != manifest.StatusReady || n.Method != string(erase.SanitizeCrypto) || n.SanitizeStatus != "completed" || n.VerifiedLBAs != 64 {
			t.Errorf("%s: %s %v, nvme %+v", u.ID, u.Status, u.Reasons, n)
		}
		for _, r := range e.Resets {
			if r.Result != "done" || r.Methods != "flr bus" {
				t.Errorf("%s: reset %+v", u.ID, r)
			}
		}
		for _, f := range u.Functions {
			if f.DriverAfter != "vfio-pci" {
				t.Errorf("%s %s on %q", u.ID, f.BDF, f.DriverAfter)
			}
		}
	}
}

// No unit's NVMe is on nvme once the erase stage is over, erased or not, in the erase
// plan or not: unit 5 is failed by the decision (its CX-8 without ATS under
// passage.ats=require), so nothing erases it, and its NVMe, which the nvme driver held
// from the start, is taken off it all the same; unit 2's erase fails and its NVMe is
// off nvme too. The handoff is told every unit's functions, so no tenant disk is a
// root candidate.
func TestNoUnitNVMeLeftOnNVMe(t *testing.T) {
	spec := pcitest.B300()
	var walk func(fns []pcitest.Fn)
	walk = func(fns []pcitest.Fn) {
		for i := range fns {
			if fns[i].Name == "nic5.0" || fns[i].Name == "nic5.1" {
				fns[i].ATS = nil
			}
			walk(fns[i].Below)
		}
	}
	for h := range spec.Hosts {
		walk(spec.Hosts[h].Fns)
	}
	bn := newBootNodeOf(t, spec)
	root := bn.node.Root
	ctrls := simulateNVMe(t, root, "flr", func(a pci.Address) *erasetest.Controller {
		return erasetest.New("S"+a.String(), erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16})
	})
	ctrls[bn.node.Addr("nvme2")].Faults.SanitizeFails = true
	nvme5 := bn.node.Addr("nvme5")
	if drv, _ := vfiobind.Driver(bn.kern, nvme5); drv != erase.NVMeDriver {
		t.Fatalf("unit 5's NVMe starts on %q, want nvme (the test's premise)", drv)
	}
	b := &Boot{Root: root, Config: initramfs.ParseCmdline(bootCmdline + " passage.net=off passage.ats=require"), Sysfs: bn.kern,
		OpenNVMe: func(_ context.Context, a pci.Address) (erase.Controller, string, error) { return ctrls[a], "nvme", nil }}
	if _, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"nvme0", "nvme2", "nvme5", "nvme7"} {
		a := bn.node.Addr(name)
		if drv, err := vfiobind.Driver(bn.kern, a); err != nil || drv == erase.NVMeDriver {
			t.Errorf("%s (%s) on %q after the boot (%v)", name, a, drv, err)
		}
	}
	passthrough := strings.Join(b.PassthroughAddrs(), " ")
	for _, name := range []string{"nvme2", "nvme5", "gpu5", "nic5.1"} {
		if !strings.Contains(passthrough, bn.node.Addr(name).String()) {
			t.Errorf("%s not among the functions the handoff keeps from root: %s", name, passthrough)
		}
	}
}

// TestEraseShowsProgress: while a sanitize runs, each console tick of the erase stage
// names the NVMe, its method and the controller's own progress (Sanitize Status SPROG),
// which grows as the sanitize goes.
func TestEraseShowsProgress(t *testing.T) {
	bn := newBootNode(t)
	root := bn.node.Root
	ctrls := simulateNVMe(t, root, "flr", func(a pci.Address) *erasetest.Controller {
		return erasetest.New("S"+a.String(), erase.SANICAPCES, 0, false, erasetest.Namespace{NSID: 1, Blocks: 1 << 12})
	})
	slow := bn.node.Addr("nvme3")
	ctrls[slow].Faults.SanitizeTime = 2500 * time.Millisecond // polled each second: 0%, ~40%, ~80%

	con := &syncBuffer{}
	b := &Boot{Root: root, Config: initramfs.ParseCmdline(bootCmdline + " passage.net=off"), Sysfs: bn.kern,
		OpenNVMe: func(_ context.Context, a pci.Address) (erase.Controller, string, error) { return ctrls[a], "nvme", nil }}
	if _, err := (&stages.Runner{Stages: b.Stages(), Console: con, Tick: 50 * time.Millisecond}).Run(context.Background(), &stages.State{}); err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`passage: erase: still waiting for the erase: ` + regexp.QuoteMeta(slow.String()) +
		` sanitize-crypto-erase ([0-9]+)% \(SPROG ([0-9]+)/65536\)`)
	var pct []int
	for _, m := range line.FindAllStringSubmatch(con.String(), -1) {
		p, _ := strconv.Atoi(m[1])
		if len(pct) == 0 || pct[len(pct)-1] != p {
			pct = append(pct, p)
		}
	}
	if len(pct) < 2 || pct[len(pct)-1] <= pct[0] {
		t.Errorf("progress shown %v%%, want it growing over the sanitize; the console:\n%s", pct, con.String())
	}
	m, err := bn.envelopeOnDisk()
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range m.Units {
		if u.ID == "gpu3" && u.Status != manifest.StatusReady {
			t.Errorf("gpu3 (NVMe %s): %s %v, want ready once its sanitize completed", slow, u.Status, u.Reasons)
		}
	}
}

// syncBuffer is a console written by the runner's ticks and the stages at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// simulateNVMe gives every function of the tree under root a reset the kernel can do
// (reset_method says methods) and every NVMe a simulated controller made by ctrl.
func simulateNVMe(t *testing.T, root, methods string, ctrl func(pci.Address) *erasetest.Controller) map[pci.Address]*erasetest.Controller {
	t.Helper()
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	ctrls := map[pci.Address]*erasetest.Controller{}
	for _, d := range tree.Devices {
		dir := filepath.Join(root, pci.DevicesDir, d.Addr.String())
		if err := os.WriteFile(filepath.Join(dir, "reset_method"), []byte(methods+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "reset"), nil, 0o200); err != nil {
			t.Fatal(err)
		}
		if d.Class == pcitest.ClassNVMe {
			ctrls[d.Addr] = ctrl(d.Addr)
		}
	}
	return ctrls
}
