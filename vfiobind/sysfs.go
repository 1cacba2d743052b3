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

// Root is the real Sysfs: the kernel's files below a directory ("/" on a node). Every
// path resolves beneath that directory in the kernel, whatever the links in it say: a
// --root tree comes from anywhere, and a link in it that is absolute or climbs out
// (planted before or after it was scanned) fails the access instead of carrying a store
// to a file elsewhere. A store goes only to a regular file, opened without following a
// link at its last step and without blocking (pci.OpenAttr): a FIFO, socket or device
// node fails it at once.
type Root string

func (r Root) dir() string {
	if r == "" {
		return "/"
	}
	return string(r)
}

func (r Root) WriteFile(name string, data []byte) error {
	f, err := pci.OpenAttr(r.dir(), name, os.O_WRONLY)
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

// ReadLink and Stat resolve through os.Root, which walks the path one element at a time
// and refuses a link that leaves the root, as OpenAttr's openat2 does in one call.
func (r Root) ReadLink(name string) (string, error) {
	root, err := os.OpenRoot(r.dir())
	if err != nil {
		return "", err
	}
	defer root.Close()
	return root.Readlink(filepath.FromSlash(name))
}

func (r Root) Stat(name string) error {
	root, err := os.OpenRoot(r.dir())
	if err != nil {
		return err
	}
	defer root.Close()
	_, err = root.Stat(filepath.FromSlash(name))
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
