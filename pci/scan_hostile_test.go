package pci_test

import (
	"bytes"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// Trees given with --root come from anywhere: these are the ones built to hurt.

// scanGuarded scans root in a goroutine and fails the test if the scan does not return
// within a few seconds (a FIFO opened for reading without O_NONBLOCK waits for a writer
// forever). On a timeout it opens every FIFO in fifos for writing, which lets a blocked
// open return, so the goroutine does not outlive the test.
func scanGuarded(t *testing.T, root string, fifos ...string) *pci.Tree {
	t.Helper()
	type result struct {
		tree *pci.Tree
		err  error
	}
	done := make(chan result, 1)
	go func() {
		tree, err := pci.Scan(root)
		done <- result{tree, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatal(r.err)
		}
		return r.tree
	case <-time.After(5 * time.Second):
		unblock(done, fifos, syscall.O_WRONLY)
		t.Fatal("scan blocked for 5s on a non-regular attribute")
		return nil
	}
}

// unblock opens the FIFOs with mode (and O_NONBLOCK) and closes them again, over and over
// until done is ready: every open a blocked reader (or writer) waits in returns, and the
// read (write) after it finds the other end closed.
func unblock[T any](done <-chan T, fifos []string, mode int) {
	for {
		for _, f := range fifos {
			if fd, err := syscall.Open(f, mode|syscall.O_NONBLOCK, 0); err == nil {
				syscall.Close(fd)
			}
		}
		select {
		case <-done:
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func mkfifo(t *testing.T, p string) string {
	t.Helper()
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(p, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func treeProblem(tree *pci.Tree, all ...string) bool {
	for _, p := range tree.Problems {
		ok := true
		for _, s := range all {
			ok = ok && strings.Contains(p, s)
		}
		if ok {
			return true
		}
	}
	return false
}

// copyFiles copies the regular files of dir (not its subdirectories or links) into a new
// directory under a temporary directory outside any tree, and returns it.
func copyFiles(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(dir))
	if err := os.Mkdir(out, 0o755); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(out, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func relink(t *testing.T, link, target string) {
	t.Helper()
	if err := os.RemoveAll(link); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

// TestScanOutsideRoot: a function whose entry resolves outside the root, however it gets
// there, is not read: it is a tree problem naming it, not a device.
func TestScanOutsideRoot(t *testing.T) {
	for _, tc := range []struct {
		name   string
		break_ func(t *testing.T, n *pcitest.Node, outside string)
	}{
		{"absolute bus link", func(t *testing.T, n *pcitest.Node, outside string) {
			relink(t, filepath.Join(n.Root, pci.DevicesDir, n.Addr("nic").String()), outside)
		}},
		{"relative bus link climbing out", func(t *testing.T, n *pcitest.Node, outside string) {
			link := filepath.Join(n.Root, pci.DevicesDir, n.Addr("nic").String())
			rel, err := filepath.Rel(filepath.Dir(link), outside)
			if err != nil {
				t.Fatal(err)
			}
			relink(t, link, rel)
		}},
		{"directory on the way is a link out", func(t *testing.T, n *pcitest.Node, outside string) {
			// The bus link stays inside on paper: sys/devices/evil/<bdf>, but evil leads out.
			relink(t, filepath.Join(n.Root, "sys/devices/evil"), filepath.Dir(outside))
			relink(t, filepath.Join(n.Root, pci.DevicesDir, n.Addr("nic").String()), "../../../devices/evil/"+filepath.Base(outside))
		}},
		{"function directory is a link out", func(t *testing.T, n *pcitest.Node, outside string) {
			relink(t, devDir(t, n, "nic"), outside)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, small())
			outside := copyFiles(t, devDir(t, n, "nic"))
			tc.break_(t, n, outside)
			tree := scanGuarded(t, n.Root)
			nic := n.Addr("nic").String()
			if d := tree.Lookup(n.Addr("nic")); d != nil {
				t.Errorf("function outside the root read: %s %s problems %q", d.Addr, d.IDs(), d.Problems)
			}
			if len(tree.Devices) != 1 {
				t.Errorf("%d functions, want the root port alone", len(tree.Devices))
			}
			if !treeProblem(tree, nic, "outside the root") {
				t.Errorf("tree problems %q, want one naming %s outside the root", tree.Problems, nic)
			}
		})
	}
}

// TestScanNonRegularAttributes: a FIFO, socket or device node where sysfs has an
// attribute never blocks the scan and is a problem naming the file and what it is.
func TestScanNonRegularAttributes(t *testing.T) {
	t.Run("fifo config and numa_node", func(t *testing.T) {
		n := pcitest.New(t, small())
		nic, rp := devDir(t, n, "nic"), devDir(t, n, "rp")
		fifos := []string{mkfifo(t, filepath.Join(nic, "config")), mkfifo(t, filepath.Join(rp, "numa_node"))}
		tree := scanGuarded(t, n.Root, fifos...)
		d := lookup(t, tree, n, "nic")
		if !hasProblem(d, "config: not a regular file (fifo)") {
			t.Errorf("nic problems %q", d.Problems)
		}
		if d.IDs() != "15b3:1023" || d.Class != pcitest.ClassEthernet {
			t.Errorf("nic %s class %06x, want the ID files read instead", d.IDs(), d.Class)
		}
		r := lookup(t, tree, n, "rp")
		if !hasProblem(r, "numa_node: not a regular file (fifo)") || r.NUMANode != -1 {
			t.Errorf("rp numa %d problems %q", r.NUMANode, r.Problems)
		}
	})
	t.Run("fifo vendor, driver_override and vpd", func(t *testing.T) {
		n := pcitest.New(t, small())
		nic := devDir(t, n, "nic")
		var fifos []string
		for _, f := range []string{"driver_override", "vpd"} {
			fifos = append(fifos, mkfifo(t, filepath.Join(nic, f)))
		}
		rp := devDir(t, n, "rp")
		if err := os.Remove(filepath.Join(rp, "config")); err != nil {
			t.Fatal(err)
		}
		fifos = append(fifos, mkfifo(t, filepath.Join(rp, "vendor")))
		tree := scanGuarded(t, n.Root, fifos...)
		d := lookup(t, tree, n, "nic")
		for _, want := range []string{"driver_override: not a regular file (fifo)", "vpd: not a regular file (fifo)"} {
			if !hasProblem(d, want) {
				t.Errorf("nic problems %q, want %q", d.Problems, want)
			}
		}
		r := lookup(t, tree, n, "rp")
		if !hasProblem(r, "vendor: not a regular file (fifo)") || r.DeviceID != pcitest.DevRootPort {
			t.Errorf("rp %s problems %q", r.IDs(), r.Problems)
		}
	})
	t.Run("fifo with a writer", func(t *testing.T) {
		// A FIFO someone holds open for writing, with a value waiting in it: still not
		// an attribute.
		n := pcitest.New(t, small())
		p := mkfifo(t, filepath.Join(devDir(t, n, "nic"), "numa_node"))
		r, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		w, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		if _, err := w.Write([]byte("0\n")); err != nil {
			t.Fatal(err)
		}
		d := lookup(t, scanGuarded(t, n.Root, p), n, "nic")
		if d.NUMANode != -1 || !hasProblem(d, "numa_node: not a regular file (fifo)") {
			t.Errorf("numa %d problems %q", d.NUMANode, d.Problems)
		}
	})
	t.Run("socket and symlink", func(t *testing.T) {
		n := pcitest.New(t, small())
		nic := devDir(t, n, "nic")
		os.Remove(filepath.Join(nic, "driver_override"))
		t.Chdir(nic) // a socket's path must be short: bind it relative to its directory
		l, err := net.Listen("unix", "driver_override")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		// numa_node a link to a regular file, even one inside the tree, is not sysfs.
		relink(t, filepath.Join(nic, "numa_node"), "irq")
		d := lookup(t, scanGuarded(t, n.Root), n, "nic")
		if !hasProblem(d, "driver_override: not a regular file (socket)") || !hasProblem(d, "numa_node: not a regular file (symlink)") {
			t.Errorf("problems %q", d.Problems)
		}
	})
	t.Run("char device", func(t *testing.T) {
		n := pcitest.New(t, small())
		p := filepath.Join(devDir(t, n, "nic"), "numa_node")
		os.Remove(p)
		if err := syscall.Mknod(p, syscall.S_IFCHR|0o644, 1<<8|3); err != nil { // /dev/null
			t.Skipf("mknod: %v", err)
		}
		d := lookup(t, scanGuarded(t, n.Root), n, "nic")
		if !hasProblem(d, "numa_node: not a regular file (char device)") {
			t.Errorf("problems %q", d.Problems)
		}
	})
}

// TestScanAliases: one function is one device, whatever the devices directory says.
func TestScanAliases(t *testing.T) {
	gpus := func(tree *pci.Tree) int {
		c := 0
		for _, d := range tree.Devices {
			if d.IDs() == "10de:3182" {
				c++
			}
		}
		return c
	}
	for _, tc := range []struct {
		name  string
		alias func(t *testing.T, n *pcitest.Node) []string // the names a problem must carry
	}{
		{"no domain", func(t *testing.T, n *pcitest.Node) []string {
			relink(t, filepath.Join(n.Root, pci.DevicesDir, "f2:00.0"), "0000:f2:00.0")
			return []string{"f2:00.0", "0000:f2:00.0"}
		}},
		{"upper case", func(t *testing.T, n *pcitest.Node) []string {
			relink(t, filepath.Join(n.Root, pci.DevicesDir, "0000:F2:00.0"), "0000:f2:00.0")
			return []string{"0000:F2:00.0", "0000:f2:00.0"}
		}},
		{"short domain", func(t *testing.T, n *pcitest.Node) []string {
			target, err := os.Readlink(filepath.Join(n.Root, pci.DevicesDir, "0000:f2:00.0"))
			if err != nil {
				t.Fatal(err)
			}
			relink(t, filepath.Join(n.Root, pci.DevicesDir, "0:f2:00.0"), target)
			return []string{"0:f2:00.0", "0000:f2:00.0"}
		}},
		{"canonical name into another function's directory", func(t *testing.T, n *pcitest.Node) []string {
			target, err := os.Readlink(filepath.Join(n.Root, pci.DevicesDir, "0000:f2:00.0"))
			if err != nil {
				t.Fatal(err)
			}
			relink(t, filepath.Join(n.Root, pci.DevicesDir, "0000:f2:00.1"), target)
			return []string{"0000:f2:00.1", "0000:f2:00.0"}
		}},
		{"function directory is a link to a sibling", func(t *testing.T, n *pcitest.Node) []string {
			gpu := devDir(t, n, "gpu7")
			relink(t, filepath.Join(filepath.Dir(gpu), "0000:f2:00.1"), "0000:f2:00.0")
			target, err := os.Readlink(filepath.Join(n.Root, pci.DevicesDir, "0000:f2:00.0"))
			if err != nil {
				t.Fatal(err)
			}
			relink(t, filepath.Join(n.Root, pci.DevicesDir, "0000:f2:00.1"), strings.TrimSuffix(target, "0000:f2:00.0")+"0000:f2:00.1")
			return []string{"0000:f2:00.1", "0000:f2:00.0"}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, pcitest.B300())
			before := len(scan(t, n.Root).Devices)
			names := tc.alias(t, n)
			tree := scanGuarded(t, n.Root)
			if len(tree.Devices) != before || gpus(tree) != 8 {
				t.Errorf("%d functions and %d GPUs, want %d and 8", len(tree.Devices), gpus(tree), before)
			}
			if d := tree.Lookup(n.Addr("gpu7")); d == nil || d.Err() != nil {
				t.Errorf("gpu7 %v problems %v", d, d.Err())
			}
			if !treeProblem(tree, names...) {
				t.Errorf("tree problems %q, want one naming %q", tree.Problems, names)
			}
		})
	}
}

// TestScanImplausibleValues: numa_node and iommu_group values that no kernel writes are
// problems naming the file and the value, and unknown (-1), not taken as real.
func TestScanImplausibleValues(t *testing.T) {
	for _, tc := range []struct{ numa, group string }{
		{"-5", "-7"},
		{"99999", "abc"},
		{"-2", "+3"},
		{"1024", "99999999999999999999"},
	} {
		t.Run(tc.numa+" "+tc.group, func(t *testing.T) {
			n := pcitest.New(t, small())
			dir := devDir(t, n, "nic")
			if err := os.WriteFile(filepath.Join(dir, "numa_node"), []byte(tc.numa+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			relink(t, filepath.Join(dir, "iommu_group"), "../../../../kernel/iommu_groups/"+tc.group)
			tree := scanGuarded(t, n.Root)
			d := lookup(t, tree, n, "nic")
			if d.NUMANode != -1 || !hasProblem(d, "numa_node") || !hasProblem(d, `"`+tc.numa+`"`) {
				t.Errorf("numa %d problems %q", d.NUMANode, d.Problems)
			}
			if d.IOMMUGroup != -1 || !hasProblem(d, "iommu_group") || !hasProblem(d, `"`+tc.group+`"`) {
				t.Errorf("group %d problems %q", d.IOMMUGroup, d.Problems)
			}
			if _, ok := tree.Groups()[-7]; ok {
				t.Error("group -7 in Groups")
			}
		})
	}
	// The values a kernel does write stay quiet.
	n := pcitest.New(t, small())
	dir := devDir(t, n, "nic")
	if err := os.WriteFile(filepath.Join(dir, "numa_node"), []byte("-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	relink(t, filepath.Join(dir, "iommu_group"), "../../../../kernel/iommu_groups/0")
	d := lookup(t, scanGuarded(t, n.Root), n, "nic")
	if d.NUMANode != -1 || d.IOMMUGroup != 0 || len(d.Problems) != 0 {
		t.Errorf("numa %d group %d problems %q", d.NUMANode, d.IOMMUGroup, d.Problems)
	}
}

// TestSysfsConfigBeneathRoot: config writes and reads stay beneath the root, whatever
// the tree's links say, including a link planted after the scan.
func TestSysfsConfigBeneathRoot(t *testing.T) {
	for _, tc := range []struct {
		name  string
		plant func(t *testing.T, n *pcitest.Node, outside string)
	}{
		{"bus link to an absolute path outside", func(t *testing.T, n *pcitest.Node, outside string) {
			relink(t, filepath.Join(n.Root, pci.DevicesDir, n.Addr("nic").String()), outside)
		}},
		{"bus link climbing out", func(t *testing.T, n *pcitest.Node, outside string) {
			link := filepath.Join(n.Root, pci.DevicesDir, n.Addr("nic").String())
			rel, err := filepath.Rel(filepath.Dir(link), outside)
			if err != nil {
				t.Fatal(err)
			}
			relink(t, link, rel)
		}},
		{"config a link to a file outside", func(t *testing.T, n *pcitest.Node, outside string) {
			relink(t, filepath.Join(devDir(t, n, "nic"), "config"), filepath.Join(outside, "config"))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, small())
			a := n.Addr("nic")
			io := pci.SysfsConfig{Root: n.Root}
			// Before: the write path works on the honest tree.
			if _, err := pci.WriteRegister(io, a, 0x3c, 1, 0x0b); err != nil {
				t.Fatal(err)
			}
			if err := scan(t, n.Root).Err(); err != nil {
				t.Fatal(err)
			}
			outside := copyFiles(t, devDir(t, n, "nic"))
			orig, err := os.ReadFile(filepath.Join(outside, "config"))
			if err != nil {
				t.Fatal(err)
			}
			tc.plant(t, n, outside)
			w, err := pci.WriteRegister(io, a, 0x3c, 1, 0x0e)
			if err == nil {
				t.Errorf("write through a link out of the root succeeded: %+v", w)
			}
			if w.Before != 0 {
				t.Errorf("config read outside the root: before %#x", w.Before)
			}
			if got, _ := os.ReadFile(filepath.Join(outside, "config")); !bytes.Equal(got, orig) {
				t.Error("config outside the root changed")
			}
			if _, err := pci.ReadRegister(io, a, 0, 4); err == nil {
				t.Error("config read through a link out of the root succeeded")
			}
		})
	}
}

// TestSysfsConfigNonRegular: a FIFO as config neither blocks a read or write nor is
// taken for config space.
func TestSysfsConfigNonRegular(t *testing.T) {
	n := pcitest.New(t, small())
	p := mkfifo(t, filepath.Join(devDir(t, n, "nic"), "config"))
	io := pci.SysfsConfig{Root: n.Root}
	done := make(chan [2]error, 1)
	go func() {
		_, rerr := pci.ReadRegister(io, n.Addr("nic"), 0, 4)
		werr := io.WriteConfig(n.Addr("nic"), 0x3c, []byte{1})
		done <- [2]error{rerr, werr}
	}()
	select {
	case errs := <-done:
		for i, err := range errs {
			if err == nil || !strings.Contains(err.Error(), "not a regular file (fifo)") {
				t.Errorf("op %d on a FIFO config: %v", i, err)
			}
		}
	case <-time.After(5 * time.Second):
		go unblock(done, []string{p}, syscall.O_RDONLY) // a writer blocked in open wants a reader
		unblock(done, []string{p}, syscall.O_WRONLY)
		t.Fatal("config access blocked for 5s on a FIFO")
	}
}
