package vfiobind_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/initramfs/kmod"
	"github.com/passage-boot/passage/vfiobind"
)

// The kmod adapter, on module trees that need no finit_module call: everything built
// in, or vfio-pci absent from the image.
func TestKmodAdapter(t *testing.T) {
	dir := t.TempDir()
	builtin := "kernel/drivers/vfio/vfio.ko\nkernel/drivers/vfio/vfio_iommu_type1.ko\nkernel/drivers/vfio/pci/vfio-pci.ko\n"
	if err := os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte(builtin), 0o644); err != nil {
		t.Fatal(err)
	}
	ix, err := kmod.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	k := &vfiobind.Kmod{Index: ix}
	if err := k.Load(vfiobind.Modules...); err != nil {
		t.Fatal(err)
	}
	if len(k.Results) != 3 {
		t.Fatalf("results %+v", k.Results)
	}
	for _, r := range k.Results {
		if !r.AlreadyLoaded || r.Err != nil {
			t.Errorf("built-in %s: %+v", r.Name, r)
		}
	}

	empty, err := kmod.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	k = &vfiobind.Kmod{Index: empty}
	if err := k.Load(vfiobind.Modules...); err == nil || !strings.Contains(err.Error(), "vfio") {
		t.Errorf("empty image: %v, want an error naming vfio", err)
	}
	if err := (&vfiobind.Kmod{}).Load("vfio"); err == nil {
		t.Error("no index: no error")
	}
}
