package vfiobind_test

import (
	"context"
	"fmt"
	"io/fs"
	"strings"
	"syscall"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind"
)

// vfioIDs is a kernel where vfio-pci also matches the functions by ID (vfio-pci.ids=,
// or an ID written to its new_id): drivers_probe hands them straight back to vfio-pci
// even with driver_override cleared. The store itself succeeds, as the kernel's does.
type vfioIDs struct {
	vfiobind.Sysfs
	ids map[string]bool // BDFs vfio-pci matches
}

func (v *vfioIDs) WriteFile(name string, data []byte) error {
	bdf := strings.TrimSpace(string(data))
	if name == "sys/bus/pci/drivers_probe" && v.ids[bdf] {
		if err := v.Sysfs.WriteFile("sys/bus/pci/devices/"+bdf+"/driver_override", []byte(vfiobind.VFIODriver)); err != nil {
			return err
		}
	}
	return v.Sysfs.WriteFile(name, data)
}

// unreadable fails reading the driver links of some functions once the release has
// written for them (so its first look still works): EACCES from a restricted sysfs, or
// ENOENT from a function that went away (its whole directory, not only the link).
type unreadable struct {
	vfiobind.Sysfs
	err   map[string]error // BDF -> what reading its link (and stat of its directory) fails with
	armed map[string]bool  // BDFs written for
}

func (u *unreadable) WriteFile(name string, data []byte) error {
	for bdf := range u.err {
		if strings.Contains(name, "/"+bdf+"/") || strings.TrimSpace(string(data)) == bdf {
			u.armed[bdf] = true
		}
	}
	return u.Sysfs.WriteFile(name, data)
}

func (u *unreadable) failure(name string) error {
	for bdf, err := range u.err {
		if u.armed[bdf] && strings.HasPrefix(name, "sys/bus/pci/devices/"+bdf) {
			return &fs.PathError{Op: "readlink", Path: name, Err: err}
		}
	}
	return nil
}

func (u *unreadable) ReadLink(name string) (string, error) {
	if err := u.failure(name); err != nil {
		return "", err
	}
	return u.Sysfs.ReadLink(name)
}

func (u *unreadable) Stat(name string) error {
	if err := u.failure(name); err != nil {
		return err
	}
	return u.Sysfs.Stat(name)
}

// boundUnit0 binds unit 0 and returns its functions as a rescan sees them (on vfio-pci).
func boundUnit0(t *testing.T, n *node) []*pci.Device {
	t.Helper()
	units := n.units(0)
	if _, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{})); err != nil {
		t.Fatal(err)
	}
	bound := n.rescan(t)
	var fns []*pci.Device
	for _, d := range units[0].Functions() {
		fns = append(fns, bound.Lookup(d.Addr))
	}
	return fns
}

// Release reads each function's driver link after its sequence and fails a function that
// is still (or again) on vfio-pci, or whose link it cannot read: every store succeeding
// says nothing about where the function ended.
func TestReleaseChecksTheDriverLink(t *testing.T) {
	t.Run("vfio-pci takes the function back", func(t *testing.T) {
		n := newNode(t, pcitest.B300())
		fns := boundUnit0(t, n)
		gpu := n.Addr("gpu0")
		sys := &vfioIDs{Sysfs: n.k, ids: map[string]bool{gpu.String(): true}}
		reps, err := vfiobind.Release(context.Background(), sys, fns, vfiobind.Options{Clock: &fakeClock{}})
		want := fmt.Sprintf("%s: still on vfio-pci after release", gpu)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("err = %v, want one containing %q", err, want)
		}
		if len(reps) != len(fns) {
			t.Fatalf("%d reports for %d functions", len(reps), len(fns))
		}
		for _, r := range reps {
			switch {
			case r.Addr == gpu && (r.DriverAfter != vfiobind.VFIODriver || !strings.Contains(r.Err, "still on vfio-pci")):
				t.Errorf("gpu0 report %+v: want driver_after vfio-pci and the error", r)
			case r.Addr != gpu && (r.Err != "" || r.DriverAfter == vfiobind.VFIODriver || strings.Contains(err.Error(), r.Addr.String())):
				t.Errorf("%s released fine but reported %+v (err %v)", r.Addr, r, err)
			}
		}
	})
	for name, errno := range map[string]syscall.Errno{"link unreadable": syscall.EACCES, "function gone": syscall.ENOENT} {
		t.Run(name, func(t *testing.T) {
			n := newNode(t, pcitest.B300())
			fns := boundUnit0(t, n)
			nvme := n.Addr("nvme0")
			sys := &unreadable{Sysfs: n.k, err: map[string]error{nvme.String(): errno}, armed: map[string]bool{}}
			reps, err := vfiobind.Release(context.Background(), sys, fns, vfiobind.Options{Clock: &fakeClock{}})
			if err == nil || !strings.Contains(err.Error(), nvme.String()+": ") || !strings.Contains(err.Error(), "driver link") {
				t.Fatalf("err = %v, want one naming %s and its driver link", err, nvme)
			}
			for _, r := range reps {
				if (r.Addr == nvme) != (r.Err != "") {
					t.Errorf("report %+v", r)
				}
			}
		})
	}
}
