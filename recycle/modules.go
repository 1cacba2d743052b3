package recycle

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/initramfs/kmod"
)

// nvmeDriver makes sure the nvme driver is registered: a host that boots from a disk
// on another controller has it, one that booted passage's initramfs with
// passage.erase=off may not.
func nvmeDriver(root, release string) error {
	if _, err := os.Stat(filepath.Join(root, "sys/bus/pci/drivers", erase.NVMeDriver)); err == nil {
		return nil
	}
	ix, err := kmod.OpenRelease(root, release)
	if err != nil {
		return fmt.Errorf("nvme driver not registered: %w", err)
	}
	if _, err := ix.Load(erase.NVMeDriver); err != nil {
		return fmt.Errorf("nvme driver: %w", err)
	}
	return nil
}
