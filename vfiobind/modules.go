package vfiobind

import (
	"errors"
	"fmt"

	"github.com/passage-boot/passage/initramfs/kmod"
)

// Modules is the vfio stack, in the order it must be up before any binding: the
// container and type1 IOMMU backend first, then the PCI driver. Their dependencies
// (vfio_virqfd, irqbypass, vfio-pci-core, ...) come from each module's .modinfo.
var Modules = []string{"vfio", "vfio_iommu_type1", "vfio-pci"}

// ModuleLoader loads kernel modules and what they depend on.
type ModuleLoader interface {
	Load(names ...string) error
}

// Kmod loads modules from an image's /lib/modules/<release> through package kmod
// (finit_module; .ko, .ko.xz and .ko.zst).
type Kmod struct {
	Index *kmod.Index
	// Results is what the last Load did, per module, for the boot report.
	Results []kmod.Result
}

func (k *Kmod) Load(names ...string) error {
	if k == nil || k.Index == nil {
		return errors.New("kmod: no module index")
	}
	res, err := k.Index.Load(names...)
	k.Results = res
	if err != nil {
		return fmt.Errorf("load %v from %s: %w", names, k.Index.Dir(), err)
	}
	return nil
}
