package vfiobind_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind"
)

// A --root tree comes from anywhere: whatever its links say, Root writes and reads
// beneath it, and a store to anything but a regular file fails at once.

func relink(t *testing.T, link, target string) {
	t.Helper()
	if err := os.RemoveAll(link); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

// outsideDir is a directory outside the tree holding a function's attributes (as a
// function directory would) and a driver link.
func outsideDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "0000:f2:00.0")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"driver_override", "config", "unbind"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("(null)\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("../../bus/pci/drivers/evil", filepath.Join(dir, "driver")); err != nil {
		t.Fatal(err)
	}
	return dir
}

func unchanged(t *testing.T, p string) {
	t.Helper()
	if b, err := os.ReadFile(p); err != nil || string(b) != "(null)\n" {
		t.Errorf("%s outside the root: %q %v, want it untouched", p, b, err)
	}
}

func TestRootStaysBeneath(t *testing.T) {
	for _, tc := range []struct {
		name  string
		plant func(t *testing.T, n *pcitest.Node, bdf, outside string)
		write string // relative to the root
		file  string // in outside
	}{
		{"bus link to a directory outside", func(t *testing.T, n *pcitest.Node, bdf, outside string) {
			relink(t, filepath.Join(n.Root, pci.DevicesDir, bdf), outside)
		}, "sys/bus/pci/devices/%s/driver_override", "driver_override"},
		{"bus link climbing out", func(t *testing.T, n *pcitest.Node, bdf, outside string) {
			link := filepath.Join(n.Root, pci.DevicesDir, bdf)
			rel, err := filepath.Rel(filepath.Dir(link), outside)
			if err != nil {
				t.Fatal(err)
			}
			relink(t, link, rel)
		}, "sys/bus/pci/devices/%s/driver_override", "driver_override"},
		{"driver_override a link to a file outside", func(t *testing.T, n *pcitest.Node, bdf, outside string) {
			dir, err := filepath.EvalSymlinks(filepath.Join(n.Root, pci.DevicesDir, bdf))
			if err != nil {
				t.Fatal(err)
			}
			relink(t, filepath.Join(dir, "driver_override"), filepath.Join(outside, "driver_override"))
		}, "sys/bus/pci/devices/%s/driver_override", "driver_override"},
		{"driver directory a link outside", func(t *testing.T, n *pcitest.Node, bdf, outside string) {
			relink(t, filepath.Join(n.Root, "sys/bus/pci/drivers/nvidia"), outside)
		}, "sys/bus/pci/drivers/nvidia/unbind", "unbind"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, pcitest.B300())
			bdf := n.Addr("gpu7").String()
			outside := outsideDir(t)
			r := vfiobind.Root(n.Root)
			name := strings.ReplaceAll(tc.write, "%s", bdf)
			// Before: the honest tree takes the store.
			if err := r.WriteFile(name, []byte("vfio-pci")); err != nil {
				t.Fatal(err)
			}
			tc.plant(t, n, bdf, outside)
			if err := r.WriteFile(name, []byte(bdf)); err == nil {
				t.Errorf("store to %s through a link out of the root succeeded", name)
			} else if !strings.Contains(err.Error(), "outside the root") && !strings.Contains(err.Error(), "not a regular file (symlink)") {
				t.Errorf("store to %s: %v, want it refused as outside the root or a symlink", name, err)
			}
			unchanged(t, filepath.Join(outside, tc.file))
			if tc.file == "driver_override" && tc.name != "driver_override a link to a file outside" {
				// Reads do not leave the root either.
				if l, err := r.ReadLink("sys/bus/pci/devices/" + bdf + "/driver"); err == nil {
					t.Errorf("driver link read outside the root: %q", l)
				}
				if err := r.Stat("sys/bus/pci/devices/" + bdf + "/config"); err == nil {
					t.Error("config outside the root found by Stat")
				}
			}
		})
	}
}

// TestRootNonRegular: a FIFO (with or without a reader) or a socket as driver_override
// fails the store at once, naming what it is.
func TestRootNonRegular(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	bdf := n.Addr("gpu7").String()
	dir, err := filepath.EvalSymlinks(filepath.Join(n.Root, pci.DevicesDir, bdf))
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "driver_override")
	os.Remove(p)
	if err := syscall.Mkfifo(p, 0o644); err != nil {
		t.Fatal(err)
	}
	r := vfiobind.Root(n.Root)
	store := func() error {
		done := make(chan error, 1)
		go func() { done <- r.WriteFile("sys/bus/pci/devices/"+bdf+"/driver_override", []byte("vfio-pci")) }()
		select {
		case err := <-done:
			return err
		case <-time.After(5 * time.Second):
			// Let the blocked open (and the write after it) through.
			for {
				if fd, err := syscall.Open(p, syscall.O_RDONLY|syscall.O_NONBLOCK, 0); err == nil {
					buf := make([]byte, 64)
					time.Sleep(10 * time.Millisecond)
					syscall.Read(fd, buf)
					syscall.Close(fd)
				}
				select {
				case <-done:
					t.Fatal("store blocked for 5s on a FIFO driver_override")
				case <-time.After(50 * time.Millisecond):
				}
			}
		}
	}
	if err := store(); err == nil || !strings.Contains(err.Error(), "not a regular file (fifo)") {
		t.Errorf("store to a FIFO without a reader: %v", err)
	}
	rd, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	if err := store(); err == nil || !strings.Contains(err.Error(), "not a regular file (fifo)") {
		t.Errorf("store to a FIFO with a reader: %v", err)
	}
	buf := make([]byte, 64)
	if k, _ := rd.Read(buf); k != 0 {
		t.Errorf("%q stored into the FIFO", buf[:k])
	}
	if err := r.WriteFile("sys/bus/pci/devices/"+bdf+"/enable", []byte("1")); err != nil {
		t.Errorf("regular attribute beside it: %v", err)
	}
	if err := r.WriteFile("sys/bus/pci/devices/"+bdf+"/nothing", []byte("1")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing attribute: %v, want not-exist", err)
	}
}
