package recycle_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/recycle"
)

// A VMM on the iommufd path opens /dev/iommu and the function's device cdev, never the
// group: recycle sees the cdev held and refuses, writing nothing.
func TestRecycleRefusesHeldDeviceCdev(t *testing.T) {
	n := newNode(t)
	nvme := n.ctrlAddr(t, 2)
	// The kernel's cdev for the function (VFIO_DEVICE_CDEV): sysfs names it.
	if err := os.MkdirAll(filepath.Join(n.root, "sys/bus/pci/devices", nvme.String(), "vfio-dev/vfio7"), 0o755); err != nil {
		t.Fatal(err)
	}
	fd := filepath.Join(n.root, "proc/5151/fd")
	os.MkdirAll(fd, 0o755)
	os.WriteFile(filepath.Join(n.root, "proc/5151/comm"), []byte("cloud-hypervisor\n"), 0o644)
	for name, target := range map[string]string{"3": "/dev/iommu", "4": "/dev/vfio/devices/vfio7", "5": "/dev/null"} {
		if err := os.Symlink(target, filepath.Join(fd, name)); err != nil {
			t.Fatal(err)
		}
	}
	n.k.ResetWrites()
	res, err := recycle.Run(context.Background(), n.opts(2))
	if !errors.Is(err, recycle.ErrHeld) || len(res.Refusal) != 1 || res.Refusal[0].PID != 5151 ||
		!strings.Contains(err.Error(), "/dev/vfio/devices/vfio7 is held open by pid 5151 (cloud-hypervisor)") {
		t.Fatalf("held cdev: err %v refusal %+v", err, res.Refusal)
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("refused, yet %d sysfs writes: %v", len(w), w)
	}
	if g := n.latest(t).Generation; g != 1 {
		t.Errorf("refused, yet the manifest is generation %d", g)
	}
	if n.ctrls[nvme].Dirty(1) == 0 {
		t.Error("refused, yet the NVMe was erased")
	}
	// Another unit's cdev held is not this unit's business.
	res, err = recycle.Run(context.Background(), n.opts(4))
	if err != nil || !res.Completed {
		t.Errorf("unit 4 with unit 2's cdev held: %v", err)
	}
}

// Without a counter, or with one that does not answer, recycle writes nothing: a
// generation 0 would be below every --min-generation, and the hypervisor would never
// see the units not ready.
func TestRecycleRefusesWithoutCounter(t *testing.T) {
	for name, counters := range map[string][]manifest.Counter{
		"none":          nil,
		"not answering": {manifest.FileCounter{Path: filepath.Join(t.TempDir(), "no-such-dir", "generation")}},
	} {
		t.Run(name, func(t *testing.T) {
			n := newNode(t)
			o := n.opts(1)
			o.Counters = counters
			n.k.ResetWrites()
			res, err := recycle.Run(context.Background(), o)
			if !errors.Is(err, recycle.ErrNoCounter) || res.Completed || res.InFlight != 0 {
				t.Fatalf("err %v, result %+v", err, res)
			}
			if w := n.k.Writes(); len(w) != 0 {
				t.Errorf("refused, yet %d sysfs writes: %v", len(w), w)
			}
			if m := n.latest(t); m.Generation != 1 {
				t.Errorf("refused, yet the manifest is generation %d (%s)", m.Generation, m.GenerationSource)
			}
			if n.ctrls[n.ctrlAddr(t, 1)].Dirty(1) == 0 {
				t.Error("refused, yet the NVMe was erased")
			}
		})
	}
}
