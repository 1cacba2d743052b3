package vfiobind_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// fakeClock advances only when binding sleeps, so bounded waits cost no test time.
type fakeClock struct {
	mu     sync.Mutex
	t      time.Time
	sleeps int
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.sleeps++
	c.mu.Unlock()
	return nil
}

// node is a built synthetic tree with a simulated kernel over it.
type node struct {
	*pcitest.Node
	tree *pci.Tree
	k    *vfiotest.Kernel
}

func newNode(t testing.TB, spec pcitest.Spec) *node {
	t.Helper()
	n := pcitest.New(t, spec)
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	k, err := vfiotest.New(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	return &node{Node: n, tree: tree, k: k}
}

// dev returns the scanned function of a pcitest name.
func (n *node) dev(name string) *pci.Device {
	d := n.tree.Lookup(n.Addr(name))
	if d == nil {
		panic("no scanned function " + name)
	}
	return d
}

// units builds B300 units by hand from pcitest names, the way topology would: GPU, the
// two CX-8 PFs, the NVMe, and the ports above them.
func (n *node) units(ids ...int) []*topology.Unit {
	var out []*topology.Unit
	for _, i := range ids {
		u := &topology.Unit{ID: topology.UnitID(i), GPU: n.dev(fmt.Sprintf("gpu%d", i)),
			NICs: []*pci.Device{n.dev(fmt.Sprintf("nic%d.0", i)), n.dev(fmt.Sprintf("nic%d.1", i))},
			NVMe: []*pci.Device{n.dev(fmt.Sprintf("nvme%d", i))}}
		seen := map[pci.Address]bool{}
		for _, d := range u.Functions() {
			for _, p := range d.Ancestors() {
				if !seen[p.Addr] {
					seen[p.Addr] = true
					u.Bridges = append(u.Bridges, p)
				}
			}
		}
		out = append(out, u)
	}
	return out
}

func allUnits(n *node) []*topology.Unit { return n.units(0, 1, 2, 3, 4, 5, 6, 7) }

func (n *node) rescan(t testing.TB) *pci.Tree {
	t.Helper()
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	return tree
}

func (n *node) devNode(g int) bool {
	_, err := os.Stat(filepath.Join(n.Root, filepath.FromSlash(vfiobind.VFIODevNode(g))))
	return err == nil
}

func (n *node) opts(c *fakeClock) vfiobind.Options {
	return vfiobind.Options{Modules: n.k, Clock: c, VerifyTimeout: 2 * time.Second, PollInterval: 10 * time.Millisecond}
}

// refused returns the IDs of the units a finding refuses.
func refused(findings []vfiobind.Finding) map[int]bool {
	out := map[int]bool{}
	for _, f := range findings {
		if f.Refuses() {
			out[int(f.Unit)] = true
		}
	}
	return out
}

// without returns the units whose IDs are not in drop, as package decision hands Bind
// only the units the audit did not refuse.
func without(units []*topology.Unit, drop map[int]bool) []*topology.Unit {
	var out []*topology.Unit
	for _, u := range units {
		if u != nil && !drop[int(u.ID)] {
			out = append(out, u)
		}
	}
	return out
}

// ofKind returns the findings of one kind.
func ofKind(findings []vfiobind.Finding, kind string) []vfiobind.Finding {
	var out []vfiobind.Finding
	for _, f := range findings {
		if f.Kind == kind {
			out = append(out, f)
		}
	}
	return out
}

// checkUnjudged fails when units carry a status or reasons: neither Audit nor Bind
// judges a unit (package decision does).
func checkUnjudged(t testing.TB, who string, units []*topology.Unit) {
	t.Helper()
	for _, u := range units {
		if u.Status != "" || len(u.Reasons) != 0 {
			t.Errorf("%s changed unit %d: status %q reasons %v", who, u.ID, u.Status, u.Reasons)
		}
	}
}
