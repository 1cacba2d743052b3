package vfiobind

import (
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"

	"github.com/passage-boot/passage/pci"
)

// Sysfs is every access binding makes to the kernel. Paths are slash-separated and
// relative to the root ("sys/bus/pci/drivers_probe", "dev/vfio/12").
type Sysfs interface {
	// WriteFile writes data to an existing attribute in one write(2): sysfs stores
	// take the whole value per call, and a missing attribute must fail, not be created.
	WriteFile(name string, data []byte) error
	ReadLink(name string) (string, error)
	Stat(name string) error
}

// Root is the real Sysfs: the kernel's files below a directory ("/" on a node).
type Root string

func (r Root) path(name string) string {
	root := string(r)
	if root == "" {
		root = "/"
	}
	return filepath.Join(root, filepath.FromSlash(name))
}

func (r Root) WriteFile(name string, data []byte) error {
	f, err := os.OpenFile(r.path(name), os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, werr := f.Write(data)
	cerr := f.Close()
	if werr != nil {
		return werr
	}
	return cerr
}

func (r Root) ReadLink(name string) (string, error) { return os.Readlink(r.path(name)) }

func (r Root) Stat(name string) error {
	_, err := os.Stat(r.path(name))
	return err
}

// Kernel paths, relative to the root.
const (
	driversDir   = "sys/bus/pci/drivers"
	driversProbe = "sys/bus/pci/drivers_probe"
	vfioDevDir   = "dev/vfio"

	// VFIODriver is the driver every passthrough function must end on.
	VFIODriver = "vfio-pci"
)

func devPath(a pci.Address, attr string) string {
	return path.Join(pci.DevicesDir, a.String(), attr)
}

func driverPath(drv, attr string) string { return path.Join(driversDir, drv, attr) }

// VFIODevNode is the character device vfio creates for an IOMMU group, relative to the root.
func VFIODevNode(group int) string { return path.Join(vfioDevDir, fmt.Sprint(group)) }

// currentDriver reads the function's driver link: "" when unbound.
func currentDriver(sys Sysfs, a pci.Address) (string, error) {
	t, err := sys.ReadLink(devPath(a, "driver"))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", nil
		}
		return "", fmt.Errorf("%s: read driver link: %w", a, err)
	}
	return path.Base(filepath.ToSlash(t)), nil
}
