package recycle

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/initramfs/kmod"
	"github.com/passage-boot/passage/pci"
)

// nvmeDriver makes sure the nvme driver is registered: a host that boots from a disk
// on another controller has it, one that booted passage's initramfs with
// passage.erase=off may not.
func nvmeDriver(root string) error {
	if _, err := os.Stat(filepath.Join(root, "sys/bus/pci/drivers", erase.NVMeDriver)); err == nil {
		return nil
	}
	f, err := pci.OpenAttr(root, "proc/sys/kernel/osrelease", os.O_RDONLY)
	if err != nil {
		return fmt.Errorf("nvme driver not registered, and the kernel release is unknown: %w", err)
	}
	b := make([]byte, 256)
	n, _ := f.Read(b)
	f.Close()
	rel := strings.TrimSpace(string(b[:n]))
	if !kmod.PlainRelease(rel) {
		return fmt.Errorf("nvme driver not registered; kernel release %q is not a plain release name", rel)
	}
	ix, err := kmod.Open(filepath.Join(root, "lib/modules", rel))
	if err != nil {
		return fmt.Errorf("nvme driver: %w", err)
	}
	if _, err := ix.Load(erase.NVMeDriver); err != nil {
		return fmt.Errorf("nvme driver: %w", err)
	}
	return nil
}
