package pci

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// maxCPUList bounds a node's cpulist: a few KiB even on the largest machines.
const maxCPUList = 16 << 10

// NodeCPUs are the CPUs of each NUMA node, as /sys/devices/system/node/node<N>/cpulist
// lists them ("0-63,128-191"), read beneath root. A root without that directory (a
// synthetic tree, a snapshot) has none and is no error; a list that cannot be read or
// is not a CPU list is.
func NodeCPUs(root string) (map[int]string, error) {
	dir := filepath.Join(root, "sys/devices/system/node")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return map[int]string{}, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[int]string{}
	for _, e := range ents {
		n, ok := strings.CutPrefix(e.Name(), "node")
		id, err := strconv.Atoi(n)
		if !ok || err != nil || id < 0 || strconv.Itoa(id) != n {
			continue
		}
		name := filepath.Join("sys/devices/system/node", e.Name(), "cpulist")
		f, err := OpenAttr(root, name, os.O_RDONLY)
		if err != nil {
			return nil, err
		}
		b, err := io.ReadAll(io.LimitReader(f, maxCPUList+1))
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", filepath.Join(root, name), err)
		}
		if len(b) > maxCPUList {
			return nil, fmt.Errorf("%s: larger than %d bytes", filepath.Join(root, name), maxCPUList)
		}
		list := strings.TrimSpace(string(b))
		if list == "" {
			continue // a memory-only node has no CPUs
		}
		if err := CheckCPUList(list); err != nil {
			return nil, fmt.Errorf("%s: %w", filepath.Join(root, name), err)
		}
		out[id] = list
	}
	return out, nil
}

// CheckCPUList checks the kernel's cpulist format (bitmap_print_to_pagebuf's list form:
// "0-63,128-191"): ascending, non-overlapping ranges of CPU numbers.
func CheckCPUList(s string) error {
	last := -1
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err1 := strconv.Atoi(lo)
		b := a
		var err2 error
		if isRange {
			b, err2 = strconv.Atoi(hi)
		}
		// Both ends as the kernel writes them: digits only, no sign, no leading zero.
		if err1 != nil || err2 != nil || a < 0 || b < a || a <= last || b > 1<<20 || strconv.Itoa(a) != lo || (isRange && strconv.Itoa(b) != hi) {
			return fmt.Errorf("cpulist %q: not ascending CPU ranges like 0-63,128-191", s)
		}
		last = b
	}
	return nil
}

// SortedNodes lists a node map's keys in order.
func SortedNodes(m map[int]string) []int {
	out := make([]int, 0, len(m))
	for n := range m {
		out = append(out, n)
	}
	sort.Ints(out)
	return out
}
