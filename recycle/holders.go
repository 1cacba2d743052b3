package recycle

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/vfiobind"
)

// Holder is a process holding a VFIO group's character device open.
type Holder struct {
	PID   int
	Comm  string
	Group int
}

func (h Holder) String() string {
	return fmt.Sprintf("/%s is held open by pid %d (%s)", vfiobind.VFIODevNode(h.Group), h.PID, h.Comm)
}

// maxProcs bounds the scan of /proc: a node runs thousands of processes, not millions.
const maxProcs = 1 << 20

// Holders lists the processes under root/proc with an open file descriptor on
// /dev/vfio/<group> for any of groups: a VM (or anything) using the unit. A process that
// vanishes while it is read is skipped; one whose descriptors cannot be read is an error,
// since it may hold the group.
func Holders(root string, groups []int) ([]Holder, error) {
	want := map[string]int{}
	for _, g := range groups {
		if g >= 0 {
			want["/"+vfiobind.VFIODevNode(g)] = g
		}
	}
	if len(want) == 0 {
		return nil, nil
	}
	procs, err := os.ReadDir(filepath.Join(root, "proc"))
	if err != nil {
		return nil, err
	}
	var out []Holder
	var errs []error
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
				out = append(out, Holder{PID: pid, Comm: strings.TrimSpace(string(comm)), Group: g})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out, errors.Join(errs...)
}
