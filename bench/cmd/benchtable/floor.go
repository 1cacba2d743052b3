package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/passage-boot/passage/bench"
	"github.com/passage-boot/passage/pci"
)

// straceCount is what one traced process did to the tree.
type straceCount struct {
	calls    map[string]int // path syscalls under the root, by syscall
	paths    map[string]int // path -> times touched (any path syscall)
	opened   map[string]int // path -> times opened
	distinct int            // distinct paths touched
	execs    int            // processes started (execve)
}

// reopened counts opens of a file already opened: real re-reads. A path touched twice by
// readlinkat alone is os.Readlink growing its 128-byte buffer for a long target.
func (c *straceCount) reopened() int {
	n := 0
	for _, v := range c.opened {
		n += v - 1
	}
	return n
}

// straceLine matches a path syscall; with strace -y a directory descriptor argument shows
// its path ("openat(5</sys/devices/...>, "config", ...)"), which the scan's openat
// relative to each function's directory needs.
var straceLine = regexp.MustCompile(`^\d+\s+(\w+)\((?:AT_FDCWD, |\d+<([^>]*)>, )?"([^"]*)"`)

// traceFS runs the command under strace -f and counts its path syscalls below root and
// its execve calls. pci has a read hook, but only its tests can use it (ScanCounting is in
// export_test.go), so the process is counted from outside, which also counts what the
// CLI around the scan adds.
func traceFS(dir, root string, name string, args ...string) (*straceCount, error) {
	out := filepath.Join(dir, "strace.out")
	sargs := append([]string{"-f", "-qq", "-y", "-s", "4096", "-o", out,
		"-e", "trace=openat,openat2,open,readlinkat,readlink,newfstatat,stat,lstat,statx,access,faccessat2,execve", name}, args...)
	cmd := exec.Command("strace", sargs...)
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("strace %s: %w", name, err)
	}
	f, err := os.Open(out)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	defer os.Remove(out)
	c := &straceCount{calls: map[string]int{}, paths: map[string]int{}, opened: map[string]int{}}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		m := straceLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		call, p := m[1], m[3]
		if call == "execve" {
			c.execs++
			continue
		}
		if m[2] != "" && !strings.HasPrefix(p, "/") {
			p = filepath.Join(m[2], p)
		}
		// A directory handle (O_PATH) reads nothing: the files opened relative to it are
		// what count.
		if strings.Contains(sc.Text(), "O_PATH") {
			continue
		}
		if !strings.HasPrefix(p, root+"/") {
			continue
		}
		c.calls[call]++
		c.paths[p]++
		if call == "openat" || call == "openat2" || call == "open" {
			c.opened[p]++
		}
	}
	c.distinct = len(c.paths)
	return c, sc.Err()
}

func (c *straceCount) total() int {
	n := 0
	for _, v := range c.calls {
		n += v
	}
	return n
}

func (c *straceCount) String() string {
	var parts []string
	for _, k := range []string{"openat", "openat2", "readlinkat", "newfstatat", "statx", "access", "faccessat2"} {
		if c.calls[k] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", k, c.calls[k]))
		}
	}
	return strings.Join(parts, ", ")
}

// floorOf counts the sysfs files a scan must read for what it reports: the devices
// listing, and per function its devices/<bdf> link (the parent bridge), config, numa_node,
// driver, driver_override and iommu_group; vpd where config space advertises VPD; vendor
// and device where config space reads 0xffff (an SR-IOV VF) and no PF's SR-IOV capability
// accounts for the function (the kernel names a VF from its PF: pci_iov_add_virtfn).
func floorOf(tree *pci.Tree) int {
	named := map[pci.Address]bool{}
	for _, d := range tree.Devices {
		for _, a := range d.VFs() {
			named[a] = true
		}
	}
	n := 1
	for _, d := range tree.Devices {
		n += 6
		if pci.Find(d.Caps, pci.CapVPD) != 0 {
			n++
		}
		if vid, ok := d.Config.U16(pci.ConfigVendorID); ok && vid == 0xffff && !named[d.Addr] {
			n += 2
		}
	}
	return n
}

func rowFloor(e *env, t *table, w io.Writer) error {
	if _, err := exec.LookPath("strace"); err != nil {
		return fmt.Errorf("strace not installed (bench/run.sh installs it): %w", err)
	}
	b300, err := e.b300()
	if err != nil {
		return err
	}
	vfs, err := bench.BuildTree(e.scratch, "floor-vfs", bench.B300Scaled(8, 54))
	if err != nil {
		return err
	}
	defer os.RemoveAll(vfs.Root)
	fmt.Fprintf(w, "## The floor: sysfs reads per function\n\n"+
		"Counted with `strace -f` (path syscalls below the tree's root; the scan's own hook is test-only). "+
		"The floor is the files a scan must read for what it reports: the devices listing, and per function its "+
		"`devices/<bdf>` link, config, numa_node, driver, driver_override, iommu_group (6), vpd where VPD is advertised, "+
		"vendor+device where config reads 0xffff (a VF) and no PF's SR-IOV capability accounts for it "+
		"(the kernel names a VF from its PF, and so does the scan).\n\n")
	fmt.Fprintf(w, "| tree | tool | path syscalls | distinct paths | files opened twice | per fn | distinct per fn | floor per fn | processes | detail |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, tc := range []struct {
		name string
		root string
	}{{"B300", b300.Root}, {"B300 + 54 VFs/PF", vfs.Root}} {
		tree, err := pci.Scan(tc.root)
		if err != nil {
			return err
		}
		fns := len(tree.Devices)
		floor := floorOf(tree)
		tools := []struct {
			name string
			cmd  []string
		}{
			{"passage inspect", []string{e.passage, "inspect", "--root", tc.root}},
			{"lspci -vvv", append([]string{"lspci"}, lspciArgs(tc.root, "-vvv")...)},
		}
		if tc.name == "B300" {
			tools = append(tools, struct {
				name string
				cmd  []string
			}{"acs-plan.sh", []string{"bash", e.script, tc.root}})
		}
		for _, tool := range tools {
			c, err := traceFS(e.scratch, tc.root, tool.cmd[0], tool.cmd[1:]...)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %s (%d fns) | %s | %d | %d | %d | %.2f | %.2f | %.2f | %d | %s |\n", tc.name, fns, tool.name, c.total(), c.distinct,
				c.reopened(), float64(c.total())/float64(fns), float64(c.distinct)/float64(fns), float64(floor)/float64(fns), c.execs, c)
			if tool.name == "passage inspect" && tc.name == "B300" {
				t.add(row{id: "F", what: "floor: sysfs path syscalls per function (`passage inspect`)", input: fmt.Sprintf("B300, %d fns", fns),
					passage: fmt.Sprintf("%.2f files/fn (%d distinct, %d opened twice)", float64(c.distinct)/float64(fns), c.distinct, c.reopened()),
					note: fmt.Sprintf("floor %.2f/fn (%d); %d path syscalls, the extra %d are os.Readlink retrying long links with a bigger buffer; 1 process",
						float64(floor)/float64(fns), floor, c.total(), c.total()-c.distinct)})
				t.target(c.reopened() == 0 && c.distinct <= floor,
					"reads at the floor: %d distinct sysfs paths for a floor of %d, %d files opened twice, 1 process", c.distinct, floor, c.reopened())
			}
			if tool.name == "acs-plan.sh" {
				t.add(row{id: "F", what: "floor: processes spawned for a plan", input: fmt.Sprintf("B300, %d fns", fns), passage: "1",
					base: fmt.Sprintf("%d acs-plan.sh", c.execs), note: "lspci x2, setpci x2 per port, readlink per passthrough function"})
			}
		}
	}
	fmt.Fprintln(w)
	return nil
}
