package recycle

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/vfiobind"
)

// Holder is a process holding a unit's VFIO character device open: the group's
// /dev/vfio/<group>, or a function's device cdev /dev/vfio/devices/vfioN (the iommufd
// path: a VMM that opens /dev/iommu reaches a device only through its cdev, so the cdev
// is what names the unit).
type Holder struct {
	PID   int
	Comm  string
	Group int
	Path  string // the device node held, as the fd link reads ("/dev/vfio/17")
}

func (h Holder) String() string {
	return fmt.Sprintf("%s is held open by pid %d (%s)", h.Path, h.PID, h.Comm)
}

// maxProcs bounds the scan of /proc: a node runs thousands of processes, not millions.
const maxProcs = 1 << 20

// maxCdevs bounds the entries read from one function's vfio-dev directory (one, on a
// real kernel).
const maxCdevs = 16

// Holders lists the processes under root/proc with an open file descriptor on
// /dev/vfio/<group> for any of groups, or on the VFIO device cdev of any of fns (the
// /dev/vfio/devices/vfioN that root/sys/bus/pci/devices/<bdf>/vfio-dev names): a VM (or
// anything) using the unit, through the group or through iommufd. A process that
// vanishes while it is read is skipped; one whose descriptors cannot be read is an
// error, since it may hold the unit, and so is a function whose vfio-dev directory
// cannot be read.
func Holders(root string, groups []int, fns []*pci.Device) ([]Holder, error) {
	want := map[string]int{}
	for _, g := range groups {
		if g >= 0 {
			want["/"+vfiobind.VFIODevNode(g)] = g
		}
	}
	var errs []error
	for _, f := range fns {
		dir := filepath.Join(root, pci.DevicesDir, f.Addr.String(), "vfio-dev")
		ents, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			continue // not on vfio-pci (a kernel without VFIO_DEVICE_CDEV still lists vfioN here, with no dev: its node never exists, so no fd names it)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: vfio device cdev: %w", f.Addr, err))
			continue
		}
		for i, e := range ents {
			if i >= maxCdevs {
				errs = append(errs, fmt.Errorf("%s: more than %d entries in vfio-dev", f.Addr, maxCdevs))
				break
			}
			if n, ok := strings.CutPrefix(e.Name(), "vfio"); ok && n != "" && strings.Trim(n, "0123456789") == "" {
				want["/dev/vfio/devices/"+e.Name()] = f.IOMMUGroup
			}
		}
	}
	if len(want) == 0 {
		return nil, errors.Join(errs...)
	}
	procs, err := os.ReadDir(filepath.Join(root, "proc"))
	if errors.Is(err, os.ErrNotExist) {
		// A tree without /proc runs no process (a node always has one).
		return nil, errors.Join(errs...)
	}
	if err != nil {
		return nil, err
	}
	var out []Holder
	for i, p := range procs {
		if i >= maxProcs {
			return out, fmt.Errorf("more than %d entries in /proc", maxProcs)
		}
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fdDir := filepath.Join(root, "proc", p.Name(), "fd")
		fds, err := os.ReadDir(fdDir)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("pid %d: %w", pid, err))
			continue
		}
		for _, fd := range fds {
			t, err := os.Readlink(filepath.Join(fdDir, fd.Name()))
			if err != nil {
				continue
			}
			if g, ok := want[t]; ok {
				comm, _ := os.ReadFile(filepath.Join(root, "proc", p.Name(), "comm"))
				out = append(out, Holder{PID: pid, Comm: strings.TrimSpace(string(comm)), Group: g, Path: t})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out, errors.Join(errs...)
}
