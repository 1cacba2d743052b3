package vfiobind_test

import (
	"context"
	"errors"
	"io/fs"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// TestFaultsFailOneUnit injects each kernel failure into unit 2 (on its second NIC PF,
// so the GPU and first PF are already on vfio-pci when it strikes, or on the GPU) and
// checks: unit 2 failed with the reason; every one of its functions back on the driver
// it had, override cleared, no /dev/vfio node left; units 1 and 3 bound.
func TestFaultsFailOneUnit(t *testing.T) {
	for _, tc := range []struct {
		name   string
		victim string
		inject func(f *vfiotest.Faults, a pci.Address, group int)
		reason string
		waited bool // the failure is only seen when the bounded wait runs out
	}{
		{"EBUSY on unbind", "nic2.1", func(f *vfiotest.Faults, a pci.Address, _ int) {
			f.UnbindBusy = map[pci.Address]bool{a: true}
		}, "unbind mlx5_core: write sys/bus/pci/drivers/mlx5_core/unbind: device or resource busy", false},
		{"drivers_probe error", "nic2.1", func(f *vfiotest.Faults, a pci.Address, _ int) {
			f.ProbeErr = map[pci.Address]error{a: syscall.EINVAL}
		}, "drivers_probe: write sys/bus/pci/drivers_probe: invalid argument", false},
		{"probe succeeds but binds nothing", "nic2.1", func(f *vfiotest.Faults, a pci.Address, _ int) {
			f.ProbeNoBind = map[pci.Address]bool{a: true}
		}, "no driver bound after drivers_probe", true},
		{"host driver wins the probe", "nvme2", func(f *vfiotest.Faults, a pci.Address, _ int) {
			f.ProbeHost = map[pci.Address]bool{a: true}
		}, "driver is nvme after drivers_probe (want vfio-pci", true},
		{"no /dev/vfio node", "gpu2", func(f *vfiotest.Faults, _ pci.Address, g int) {
			f.NoDevNode = map[int]bool{g: true}
		}, "/dev/vfio/", true},
		{"driver_override write refused", "gpu2", func(f *vfiotest.Faults, a pci.Address, _ int) {
			f.WriteErr = map[string]error{"sys/bus/pci/devices/" + a.String() + "/driver_override": syscall.EPERM}
		}, "write driver_override", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, pcitest.B300())
			victim := n.dev(tc.victim)
			tc.inject(&n.k.Faults, victim.Addr, victim.IOMMUGroup)
			units := n.units(1, 2, 3)
			clk := &fakeClock{}
			rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(clk))
			if err != nil {
				t.Fatal(err)
			}
			u := units[1]
			ur := rep.Unit(2)
			if ur == nil || ur.Bound() {
				t.Fatalf("unit 2: report %+v, want not bound", ur)
			}
			if !strings.Contains(ur.Error, tc.reason) || !strings.Contains(ur.Error, victim.Addr.String()) {
				t.Errorf("unit 2 error %q: want %q naming %s", ur.Error, tc.reason, victim.Addr)
			}
			after := n.rescan(t)
			for _, d := range u.Functions() {
				a := after.Lookup(d.Addr)
				if a.Driver != d.Driver || a.DriverOverride != "" {
					t.Errorf("%s: driver %q override %q after rollback, want %q and none", d.Addr, a.Driver, a.DriverOverride, d.Driver)
				}
				if n.devNode(d.IOMMUGroup) {
					t.Errorf("%s: /dev/vfio/%d left behind", d.Addr, d.IOMMUGroup)
				}
			}
			var sawVictim bool
			for _, fr := range ur.Functions {
				if !fr.RolledBack || fr.RollbackErr != "" {
					t.Errorf("%s: rolled back %v, error %q", fr.Addr, fr.RolledBack, fr.RollbackErr)
				}
				if fr.Addr == victim.Addr {
					sawVictim = true
					if fr.Err == "" {
						t.Errorf("%s: report has no error", fr.Addr)
					}
					if tc.waited && fr.Duration < 2*time.Second {
						t.Errorf("%s: gave up after %v, before the 2s bound", fr.Addr, fr.Duration)
					}
					if !tc.waited && fr.Duration != 0 {
						t.Errorf("%s: waited %v for a failure the write reported", fr.Addr, fr.Duration)
					}
				}
			}
			if !sawVictim {
				t.Errorf("no report for %s: %+v", victim.Addr, ur.Functions)
			}
			for _, o := range []*topology.Unit{units[0], units[2]} {
				if r := rep.Unit(o.ID); r == nil || !r.Bound() {
					t.Errorf("unit %d: report %+v, want bound", o.ID, r)
				}
				for _, d := range o.Functions() {
					if after.Lookup(d.Addr).Driver != vfiobind.VFIODriver {
						t.Errorf("unit %d: %s not on vfio-pci", o.ID, d.Addr)
					}
				}
			}
		})
	}
}

func TestVFIOModuleMissing(t *testing.T) {
	n := newNode(t, pcitest.B300())
	n.k.Faults.MissingModules = map[string]bool{"vfio_pci": true}
	units := n.units(0, 1)
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(rep.ModulesErr, "vfio_pci") {
		t.Errorf("modules error %q does not name vfio_pci", rep.ModulesErr)
	}
	for _, u := range units {
		if r := rep.Unit(u.ID); r == nil || r.Bound() || !strings.Contains(r.Error, "vfio-pci not registered") || len(r.Functions) != 0 {
			t.Errorf("unit %d: report %+v, want not bound: vfio-pci not registered", u.ID, r)
		}
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("no vfio-pci, yet devices were written: %v", w)
	}
}

// A module file missing from the image is no reason to stop when the driver is there
// anyway (built in, or loaded before passage ran).
func TestModuleErrorWithDriverPresent(t *testing.T) {
	n := newNode(t, pcitest.B300())
	if err := n.k.Load("vfio-pci"); err != nil {
		t.Fatal(err)
	}
	n.k.Faults.MissingModules = map[string]bool{"vfio_iommu_type1": true}
	units := n.units(0)
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(rep.ModulesErr, "vfio_iommu_type1") || !rep.Units[0].Bound() {
		t.Errorf("modules error %q, unit error %q: want the module named and the unit bound", rep.ModulesErr, rep.Units[0].Error)
	}
}

// lateNode hides /dev/vfio nodes for the first polls, as a devtmpfs that lags the probe.
type lateNode struct {
	vfiobind.Sysfs
	misses int
}

func (l *lateNode) Stat(name string) error {
	if strings.HasPrefix(name, "dev/vfio/") && l.misses > 0 {
		l.misses--
		return &fs.PathError{Op: "stat", Path: name, Err: fs.ErrNotExist}
	}
	return l.Sysfs.Stat(name)
}

func TestVerifyWaitsForDevNode(t *testing.T) {
	n := newNode(t, pcitest.B300())
	sys := &lateNode{Sysfs: n.k, misses: 5}
	units := n.units(0)
	units[0].NICs, units[0].NVMe = nil, nil
	clk := &fakeClock{}
	rep, err := vfiobind.Bind(context.Background(), sys, n.tree, units, n.opts(clk))
	if err != nil {
		t.Fatal(err)
	}
	fr := rep.Units[0].Functions[0]
	if !rep.Units[0].Bound() || fr.Duration != 50*time.Millisecond || clk.sleeps != 5 {
		t.Errorf("error %q, duration %v, sleeps %d: want bound after 5 polls of 10ms", rep.Units[0].Error, fr.Duration, clk.sleeps)
	}
}

func TestRelease(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := n.units(0, 1)
	if _, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{})); err != nil {
		t.Fatal(err)
	}
	bound := n.rescan(t)
	var fns []*pci.Device
	for _, d := range units[0].Functions() {
		fns = append(fns, bound.Lookup(d.Addr))
	}
	// Half a group (one CX-8 PF of two) must not be handed back.
	err := vfiobind.CheckWholeGroups(bound, fns[1:2])
	if err == nil || !strings.Contains(err.Error(), n.Addr("nic0.1").String()) {
		t.Errorf("half group: %v, want an error naming nic0.1", err)
	}
	if err := vfiobind.CheckWholeGroups(bound, fns); err != nil {
		t.Fatal(err)
	}
	n.k.ResetWrites()
	reps, err := vfiobind.Release(context.Background(), n.k, fns, vfiobind.Options{Clock: &fakeClock{}})
	if err != nil {
		t.Fatal(err)
	}
	after := n.rescan(t)
	for i, d := range units[0].Functions() {
		a := after.Lookup(d.Addr)
		if a.Driver != d.Driver || a.DriverOverride != "" || n.devNode(d.IOMMUGroup) {
			t.Errorf("%s: driver %q override %q node %v; want %q, none, gone", d.Addr, a.Driver, a.DriverOverride, n.devNode(d.IOMMUGroup), d.Driver)
		}
		_ = i
	}
	for _, r := range reps {
		if r.DriverBefore != vfiobind.VFIODriver || r.DriverAfter == vfiobind.VFIODriver || r.Err != "" {
			t.Errorf("release report %+v", r)
		}
	}
	for _, d := range units[1].Functions() {
		if w := n.k.Touched(d.Addr); len(w) != 0 || after.Lookup(d.Addr).Driver != vfiobind.VFIODriver {
			t.Errorf("unit 1 %s disturbed by releasing unit 0: %v", d.Addr, w)
		}
	}
	// A failing store is reported per function and does not stop the others.
	n.k.Faults.WriteErr = map[string]error{"sys/bus/pci/devices/" + fns[0].Addr.String() + "/driver_override": syscall.EPERM}
	reps, err = vfiobind.Release(context.Background(), n.k, fns, vfiobind.Options{})
	if !errors.Is(err, syscall.EPERM) || len(reps) != len(fns) {
		t.Errorf("release with EPERM: %v, %d reports", err, len(reps))
	}
}

func TestRootNeverCreates(t *testing.T) {
	dir := t.TempDir()
	r := vfiobind.Root(dir)
	if err := r.WriteFile("sys/bus/pci/drivers_probe", []byte("0000:00:00.0")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("write to a missing attribute: %v, want not-exist", err)
	}
	if err := r.Stat("sys"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing attribute was created: %v", err)
	}
	n := pcitest.New(t, pcitest.B300())
	r = vfiobind.Root(n.Root)
	a := n.Addr("gpu0").String()
	if err := r.WriteFile("sys/bus/pci/devices/"+a+"/driver_override", []byte("vfio-pci")); err != nil {
		t.Fatal(err)
	}
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	if got := tree.Lookup(n.Addr("gpu0")).DriverOverride; got != "vfio-pci" {
		t.Errorf("override %q after write", got)
	}
	if l, err := r.ReadLink("sys/bus/pci/devices/" + a + "/driver"); err != nil || !strings.HasSuffix(l, "/nvidia") {
		t.Errorf("driver link %q %v", l, err)
	}
}

// expiringCtx is a context that ends with context.DeadlineExceeded when the test says
// so, so that a write can be made to outlast the deadline without racing a timer.
type expiringCtx struct {
	context.Context
	done chan struct{}
	once sync.Once
}

func newExpiringCtx() *expiringCtx {
	return &expiringCtx{Context: context.Background(), done: make(chan struct{})}
}

func (c *expiringCtx) Done() <-chan struct{} { return c.done }
func (c *expiringCtx) expire()               { c.once.Do(func() { close(c.done) }) }

func (c *expiringCtx) Err() error {
	select {
	case <-c.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}

// stuckWrite blocks one write (by path and value) until the context is done, then lets
// it through: a host driver whose remove hangs past the stage's deadline and finishes
// late. It reports how many writes the kernel had received when that write returned.
type stuckWrite struct {
	*vfiotest.Kernel
	ctx         context.Context
	path, value string
	entered     chan struct{}
	returned    chan int
}

func (s *stuckWrite) WriteFile(name string, data []byte) error {
	if name != s.path || strings.TrimSpace(string(data)) != s.value {
		return s.Kernel.WriteFile(name, data)
	}
	close(s.entered)
	<-s.ctx.Done()
	err := s.Kernel.WriteFile(name, data)
	s.returned <- len(s.Kernel.Writes())
	return err
}

// TestWriteOutlastsDeadline: unit 2's second function's unbind blocks past the deadline
// (its GPU already on vfio-pci). Once the write returns, nothing more is written: no
// drivers_probe for that function, no rollback of the unit, nothing of unit 3. Bind
// returns the deadline error and the reports say where each unit was left.
func TestWriteOutlastsDeadline(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := n.units(2, 3)
	gpu, nic := n.dev("gpu2"), n.dev("nic2.0")
	ctx := newExpiringCtx()
	sys := &stuckWrite{Kernel: n.k, ctx: ctx, path: "sys/bus/pci/drivers/mlx5_core/unbind", value: nic.Addr.String(),
		entered: make(chan struct{}), returned: make(chan int, 1)}
	type result struct {
		rep *vfiobind.Report
		err error
	}
	res := make(chan result, 1)
	go func() {
		rep, err := vfiobind.Bind(ctx, sys, n.tree, units, n.opts(&fakeClock{}))
		res <- result{rep, err}
	}()
	select {
	case <-sys.entered:
	case r := <-res:
		t.Fatalf("Bind returned (%v) without reaching the blocking write", r.err)
	}
	ctx.expire()
	writes := <-sys.returned
	r := <-res
	if !errors.Is(r.err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want context.DeadlineExceeded", r.err)
	}
	if all := n.k.Writes(); len(all) != writes {
		t.Errorf("%d writes after the late one returned: %v", len(all)-writes, all[writes:])
	}

	ur := r.rep.Unit(2)
	if ur == nil || ur.Bound() || !strings.Contains(ur.Error, context.DeadlineExceeded.Error()) {
		t.Fatalf("unit 2 report %+v, want not bound: deadline exceeded", ur)
	}
	if len(ur.Functions) != 2 {
		t.Fatalf("unit 2: %d function reports, want the GPU's and the cut-short NIC's", len(ur.Functions))
	}
	g, f := ur.Functions[0], ur.Functions[1]
	if g.Addr != gpu.Addr || g.DriverAfter != vfiobind.VFIODriver || g.RolledBack || g.Err != "" {
		t.Errorf("GPU report %+v: want bound, not rolled back", g)
	}
	wantWrites := []string{
		"sys/bus/pci/devices/" + nic.Addr.String() + "/driver_override <- vfio-pci",
		"sys/bus/pci/drivers/mlx5_core/unbind <- " + nic.Addr.String(),
	}
	if f.Addr != nic.Addr || f.RolledBack || f.Err == "" || !reflect.DeepEqual(f.Writes, wantWrites) {
		t.Errorf("NIC report %+v: want an error, no rollback, and writes %v only", f, wantWrites)
	}
	if u3 := r.rep.Unit(3); u3 == nil || u3.Bound() || len(u3.Functions) != 0 || !strings.Contains(u3.Error, context.DeadlineExceeded.Error()) {
		t.Errorf("unit 3 report %+v, want not bound for the deadline, no functions", u3)
	}
	for _, d := range units[1].Functions() {
		if w := n.k.Touched(d.Addr); len(w) != 0 {
			t.Errorf("unit 3 %s touched: %v", d.Addr, w)
		}
	}
	// Where it was left: the GPU on vfio-pci with its override, the NIC unbound with its
	// override; the rest of unit 2 never written.
	after := n.rescan(t)
	if a := after.Lookup(gpu.Addr); a.Driver != vfiobind.VFIODriver || a.DriverOverride != vfiobind.VFIODriver {
		t.Errorf("GPU: driver %q override %q, want vfio-pci left as it was", a.Driver, a.DriverOverride)
	}
	if a := after.Lookup(nic.Addr); a.Driver != "" || a.DriverOverride != vfiobind.VFIODriver {
		t.Errorf("NIC: driver %q override %q, want unbound with the override", a.Driver, a.DriverOverride)
	}
	for _, name := range []string{"nic2.1", "nvme2"} {
		if w := n.k.Touched(n.Addr(name)); len(w) != 0 {
			t.Errorf("%s touched: %v", name, w)
		}
	}
}
