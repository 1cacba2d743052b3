package apply

import (
	"bytes"
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
)

// fault is what faultIO does to one function's config accesses.
type fault struct {
	readErr    error
	readErrN   int // fail this many reads (-1: all)
	writeErr   error
	writeErrN  int // fail this many writes (-1: all)
	clobber    []byte
	readOnly   uint16 // bits a write cannot change (hard-wired by the port)
	allOnesNow bool   // every read returns 0xff bytes (surprise removal)
}

// write is one config write that reached faultIO.
type write struct {
	addr pci.Address
	off  int64
	n    int
}

// faultIO injects errors around the real sysfs file access, the way a locked-down kernel,
// a busy device or a port with hard-wired bits would answer.
type faultIO struct {
	inner  pci.ConfigIO
	mu     sync.Mutex
	faults map[pci.Address]*fault
	writes []write // writes that reached the device (and failed writes, with n < 0)
	reads  int
}

func newFaultIO(root string) *faultIO {
	return &faultIO{inner: pci.SysfsConfig{Root: root}, faults: map[pci.Address]*fault{}}
}

func (f *faultIO) ReadConfig(a pci.Address, off int64, p []byte) error {
	f.mu.Lock()
	f.reads++
	ft := f.faults[a]
	if ft != nil && ft.readErr != nil && ft.readErrN != 0 {
		if ft.readErrN > 0 {
			ft.readErrN--
		}
		f.mu.Unlock()
		return ft.readErr
	}
	f.mu.Unlock()
	if ft != nil && ft.allOnesNow {
		for i := range p {
			p[i] = 0xff
		}
		return nil
	}
	return f.inner.ReadConfig(a, off, p)
}

func (f *faultIO) WriteConfig(a pci.Address, off int64, p []byte) error {
	f.mu.Lock()
	ft := f.faults[a]
	if ft != nil && ft.writeErr != nil && ft.writeErrN != 0 {
		if ft.writeErrN > 0 {
			ft.writeErrN--
		}
		f.writes = append(f.writes, write{a, off, -1})
		f.mu.Unlock()
		if ft.clobber != nil {
			// The write partly landed before the error.
			if err := f.inner.WriteConfig(a, off, ft.clobber); err != nil {
				return err
			}
		}
		return ft.writeErr
	}
	f.writes = append(f.writes, write{a, off, len(p)})
	f.mu.Unlock()
	if ft != nil && ft.readOnly != 0 && len(p) == 2 {
		old := make([]byte, 2)
		if err := f.inner.ReadConfig(a, off, old); err != nil {
			return err
		}
		o := uint16(old[0]) | uint16(old[1])<<8
		v := uint16(p[0]) | uint16(p[1])<<8
		v = v&^ft.readOnly | o&ft.readOnly
		p = []byte{byte(v), byte(v >> 8)}
	}
	return f.inner.WriteConfig(a, off, p)
}

// landed counts the writes that reached config space.
func (f *faultIO) landed() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, w := range f.writes {
		if w.n > 0 {
			n++
		}
	}
	return n
}

// b300 is a scanned reference tree.
type b300 struct {
	node *pcitest.Node
	tree *pci.Tree
}

// shared is one reference tree for the tests that do not alter its shape: building a
// tree is thousands of file creations, so the tests restore its config files instead.
var shared struct {
	once    sync.Once
	dir     string
	node    *pcitest.Node
	tree    *pci.Tree
	configs map[string][]byte
	err     error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.dir != "" {
		os.RemoveAll(shared.dir)
	}
	os.Exit(code)
}

func sharedB300(t testing.TB) (*pcitest.Node, *pci.Tree) {
	t.Helper()
	shared.once.Do(func() {
		shared.dir, shared.err = os.MkdirTemp("", "apply-b300-")
		if shared.err != nil {
			return
		}
		shared.node, shared.err = pcitest.Build(shared.dir, pcitest.B300())
		if shared.err != nil {
			return
		}
		shared.tree, shared.err = pci.Scan(shared.dir)
		if shared.err == nil {
			shared.configs = configs(t, shared.dir)
		}
	})
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	dir := filepath.Join(shared.dir, pci.DevicesDir)
	for name, b := range shared.configs {
		if err := os.WriteFile(filepath.Join(dir, name, "config"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return shared.node, shared.tree
}

// newB300 returns the reference tree: the shared one (config restored) when edit is nil,
// else a tree of its own built from the edited spec.
func newB300(t testing.TB, edit func(s *pcitest.Spec)) *b300 {
	t.Helper()
	var n *pcitest.Node
	var tr *pci.Tree
	if edit == nil {
		n, tr = sharedB300(t)
	} else {
		s := pcitest.B300()
		edit(&s)
		n = pcitest.New(t, s)
		var err error
		if tr, err = pci.Scan(n.Root); err != nil {
			t.Fatal(err)
		}
	}
	return &b300{node: n, tree: tr}
}

func (b *b300) dev(t testing.TB, name string) *pci.Device {
	t.Helper()
	d := b.tree.Lookup(b.node.Addr(name))
	if d == nil {
		t.Fatalf("%s not scanned", name)
	}
	return d
}

// Positions of the policy, built by hand here: the planner is the topology package's.
const (
	posNIC  = "nic-port"
	posGPU  = "gpu-port"
	posRoot = "root-port"
)

// port plans one port the way DESIGN.md's policy says: only advertised bits, egress
// control never in the mask.
func (b *b300) port(t testing.TB, name string, unit int, pos string, want pci.ACSBits) topology.ACSPort {
	d := b.dev(t, name)
	if d.ACS == nil {
		t.Fatalf("%s has no ACS", name)
	}
	m := want & d.ACS.Cap
	return topology.ACSPort{Addr: d.Addr, Unit: topology.UnitID(unit), Position: pos, Offset: d.ACS.Offset, Cap: d.ACS.Cap,
		Current: d.ACS.Ctl, Mask: m, Flags: m, Reason: "test policy"}
}

// plan is the B300 policy for every unit: the CX-8 switch's NIC-side downstream port gets
// SV RR CR UF DT; the GPU-side downstream ports and the root port SV RR CR UF. As in
// topology.ACSPlan, a unit's ports that only isolate come first and its DT port last.
func (b *b300) plan(t testing.TB) []topology.ACSPort {
	var ps []topology.ACSPort
	for i := 0; i < 8; i++ {
		ps = append(ps,
			b.port(t, fmt.Sprintf("rp%d", i), i, posRoot, pci.ACSIsolation),
			b.port(t, fmt.Sprintf("gpu-dsp%d", i), i, posGPU, pci.ACSIsolation),
			b.port(t, fmt.Sprintf("cx-dsp-gpu%d", i), i, posGPU, pci.ACSIsolation),
			b.port(t, fmt.Sprintf("cx-dsp-nic%d", i), i, posNIC, pci.ACSIsolation|pci.ACSDT),
		)
	}
	return ps
}

// planPort returns the plan's entry for the named port.
func (b *b300) planPort(t testing.TB, plan []topology.ACSPort, name string) topology.ACSPort {
	t.Helper()
	a := b.node.Addr(name)
	for _, p := range plan {
		if p.Addr == a {
			return p
		}
	}
	t.Fatalf("%s not in the plan", name)
	return topology.ACSPort{}
}

// configs reads the whole config space of every function.
func configs(t testing.TB, root string) map[string][]byte {
	t.Helper()
	dir := filepath.Join(root, pci.DevicesDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name(), "config"))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = b
	}
	return out
}

// diffConfigs returns the changed bytes, as "bdf+0xOFF" keys, between two snapshots.
func diffConfigs(before, after map[string][]byte) map[string]bool {
	out := map[string]bool{}
	for k, b := range before {
		a, ok := after[k]
		if !ok {
			out[k+" gone"] = true
			continue
		}
		if bytes.Equal(a, b) {
			continue
		}
		if len(a) != len(b) {
			out[k+" size"] = true
			continue
		}
		for i := range b {
			if a[i] != b[i] {
				out[fmt.Sprintf("%s+0x%03x", k, i)] = true
			}
		}
	}
	for k := range after {
		if _, ok := before[k]; !ok {
			out[k+" new"] = true
		}
	}
	return out
}

// sleeps records backoff waits instead of sleeping.
type sleeps struct {
	mu sync.Mutex
	d  []time.Duration
}

func (s *sleeps) sleep(_ context.Context, d time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.d = append(s.d, d)
	return nil
}

func byAddr(rep Report) map[pci.Address]Change {
	out := map[pci.Address]Change{}
	for _, c := range rep.Changes {
		out[c.Addr] = c
	}
	return out
}
