package vfiobind_test

import (
	"context"
	"errors"
	"io/fs"
	"strings"
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
			if u.Status != topology.StatusFailed {
				t.Fatalf("unit 2: %s, want failed", u.Status)
			}
			reasons := strings.Join(u.Reasons, "\n")
			if !strings.Contains(reasons, tc.reason) || !strings.Contains(reasons, victim.Addr.String()) {
				t.Errorf("unit 2 reasons %q: want %q naming %s", reasons, tc.reason, victim.Addr)
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
			ur := rep.Unit(2)
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
				if o.Status != topology.StatusReady {
					t.Errorf("unit %d: %s %v", o.ID, o.Status, o.Reasons)
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
		if u.Status != topology.StatusFailed || !strings.Contains(strings.Join(u.Reasons, " "), "vfio-pci not registered") {
			t.Errorf("unit %d: %s %v", u.ID, u.Status, u.Reasons)
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
	if rep.ModulesErr == "" || units[0].Status != topology.StatusReady {
		t.Errorf("modules error %q, unit %s %v", rep.ModulesErr, units[0].Status, units[0].Reasons)
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
	if units[0].Status != topology.StatusReady || fr.Duration != 50*time.Millisecond || clk.sleeps != 5 {
		t.Errorf("status %s, duration %v, sleeps %d: want ready after 5 polls of 10ms", units[0].Status, fr.Duration, clk.sleeps)
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
