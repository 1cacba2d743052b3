package bench

import (
	"fmt"
	"os"
	"path"
	"path/filepath"

	"github.com/passage-boot/passage/pci"
	"golang.org/x/sys/unix"
)

// SyscallFloor does, for every function under root, only the system calls a scan of it
// cannot do without: read the devices listing, resolve each function's link, and relative
// to its parent directory (held open while siblings follow) openat+read+close its config,
// numa_node and driver_override and readlinkat its driver and iommu_group. No
// parsing, no model, no error reporting. What it costs is the floor under any scanner that
// reads sysfs file by file on this machine: the scaling row puts pci.Scan beside it.
// It returns the number of functions.
func SyscallFloor(root string) (int, error) {
	devs := filepath.Join(root, pci.DevicesDir)
	ents, err := os.ReadDir(devs)
	if err != nil {
		return 0, err
	}
	dfd, err := unix.Open(devs, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(dfd)
	buf := make([]byte, 2*pci.ExtendedSize)
	var lbuf [512]byte
	pdir, pfd := "", -1
	defer func() {
		if pfd >= 0 {
			unix.Close(pfd)
		}
	}()
	for _, e := range ents {
		n, err := unix.Readlinkat(dfd, e.Name(), lbuf[:])
		if err != nil {
			return 0, fmt.Errorf("%s: %w", e.Name(), err)
		}
		rel := path.Join(pci.DevicesDir, string(lbuf[:n]))
		dir, base := path.Split(rel)
		if dir != pdir {
			if pfd >= 0 {
				unix.Close(pfd)
			}
			if pfd, err = unix.Open(filepath.Join(root, dir), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
				return 0, err
			}
			pdir = dir
		}
		for _, f := range [...]string{"/config", "/numa_node", "/driver_override"} {
			fd, err := unix.Openat(pfd, base+f, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				continue
			}
			unix.Read(fd, buf)
			unix.Close(fd)
		}
		unix.Readlinkat(pfd, base+"/driver", lbuf[:])
		unix.Readlinkat(pfd, base+"/iommu_group", lbuf[:])
	}
	return len(ents), nil
}
