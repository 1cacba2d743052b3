package vfiotest

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// The simulation keeps the kernel's rules the binding code relies on.
func TestKernelRules(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	k, err := New(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	a := n.Addr("nic0.0")
	bdf := []byte(a.String())
	scan := func() *pci.Device {
		tree, err := pci.Scan(n.Root)
		if err != nil {
			t.Fatal(err)
		}
		return tree.Lookup(a)
	}
	ovr := "sys/bus/pci/devices/" + a.String() + "/driver_override"
	// unbind from a driver that does not hold the device: ENODEV.
	if err := k.WriteFile("sys/bus/pci/drivers/nvme/unbind", bdf); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("unbind from the wrong driver: %v", err)
	}
	// Override to a driver that is not registered, then probe: nothing binds, no error.
	if err := k.WriteFile(ovr, []byte("vfio-pci")); err != nil {
		t.Fatal(err)
	}
	if err := k.WriteFile("sys/bus/pci/drivers/mlx5_core/unbind", bdf); err != nil {
		t.Fatal(err)
	}
	if err := k.WriteFile("sys/bus/pci/drivers_probe", bdf); err != nil {
		t.Fatal(err)
	}
	if d := scan(); d.Driver != "" || d.DriverOverride != "vfio-pci" {
		t.Errorf("vfio-pci unregistered: driver %q override %q", d.Driver, d.DriverOverride)
	}
	// Register vfio-pci, probe: bound, node made; the sibling PF keeps the node alive.
	if err := k.Load("vfio-pci"); err != nil {
		t.Fatal(err)
	}
	if err := k.WriteFile("sys/bus/pci/drivers_probe", bdf); err != nil {
		t.Fatal(err)
	}
	d := scan()
	node := filepath.Join(n.Root, "dev", "vfio", strconv.Itoa(d.IOMMUGroup))
	if _, err := os.Stat(node); d.Driver != "vfio-pci" || err != nil {
		t.Fatalf("after probe: driver %q, node %v", d.Driver, err)
	}
	// Clearing the override and unbinding vfio-pci removes the group's node; a probe
	// then picks the host driver by ID.
	if err := k.WriteFile(ovr, []byte("\n")); err != nil {
		t.Fatal(err)
	}
	if err := k.WriteFile("sys/bus/pci/drivers/vfio-pci/unbind", bdf); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(node); !os.IsNotExist(err) {
		t.Errorf("node after the group's last vfio device left: %v", err)
	}
	if err := k.WriteFile("sys/bus/pci/drivers_probe", bdf); err != nil {
		t.Fatal(err)
	}
	if d := scan(); d.Driver != "mlx5_core" || d.DriverOverride != "" {
		t.Errorf("re-probe: driver %q override %q", d.Driver, d.DriverOverride)
	}
	// Stores never create files; a missing module fails its load.
	if err := k.WriteFile("sys/bus/pci/devices/"+a.String()+"/no_such_attr", []byte("1")); err == nil {
		t.Error("write to a missing attribute succeeded")
	}
	k.Faults.MissingModules = map[string]bool{"vfio_iommu_type1": true}
	if err := k.Load("vfio_iommu_type1"); err == nil || k.Loaded("vfio_iommu_type1") {
		t.Errorf("missing module: %v", err)
	}
	if got := len(k.Touched(a)); got != 9 {
		t.Errorf("%d writes touch %s, want 9 (failed stores count): %v", got, a, k.Touched(a))
	}
}
