package topology

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// unitGPUs is each unit's GPU address by unit ID.
func unitGPUs(l *Labels) map[UnitID]pci.Address {
	out := map[UnitID]pci.Address{}
	for _, u := range l.Units {
		out[u.ID] = u.GPU.Addr
	}
	return out
}

// setConfig replaces the config space of the named functions after the tree is built:
// nil empties it (a read that returns nothing), otherwise b is written.
func setConfig(t *testing.T, n *pcitest.Node, b []byte, names ...string) {
	t.Helper()
	for _, name := range names {
		p := filepath.Join(n.Root, pci.DevicesDir, n.Addr(name).String(), "config")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// labelFaulty scans a tree that may hold unreadable functions (scan problems are the
// point here) and labels it; a labelling error (an unlabeled function under a profile
// that forbids them) does not stop the numbering, which is what is checked.
func labelFaulty(t *testing.T, n *pcitest.Node, profile string, slots map[string]int) *Labels {
	t.Helper()
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Builtin(profile)
	if err != nil {
		t.Fatal(err)
	}
	if slots != nil {
		p.Slots = slots
		if err := p.check(); err != nil {
			t.Fatal(err)
		}
	}
	l, _ := Label(tree, p)
	if l == nil {
		t.Fatal("no labels")
	}
	return l
}

// sameUnits holds got against want: every unit of want but the lost GPUs' keeps its ID
// and GPU, the lost GPUs have no unit, and no unit is new.
func sameUnits(t *testing.T, what string, want, got map[UnitID]pci.Address, lost ...pci.Address) {
	t.Helper()
	gone := map[pci.Address]bool{}
	for _, a := range lost {
		gone[a] = true
	}
	for id, a := range want {
		if gone[a] {
			if g, ok := got[id]; ok {
				t.Errorf("%s: unit %s is GPU %s, want no unit there (its GPU %s cannot be read)", what, id, g, a)
			}
			continue
		}
		if g, ok := got[id]; !ok {
			t.Errorf("%s: no unit %s, want GPU %s as in the intact tree", what, id, a)
		} else if g != a {
			t.Errorf("%s: unit %s is GPU %s, want %s as in the intact tree", what, id, g, a)
		}
	}
	for id, a := range got {
		if _, ok := want[id]; !ok {
			t.Errorf("%s: new unit %s (GPU %s)", what, id, a)
		}
		if gone[a] {
			t.Errorf("%s: unreadable GPU %s has unit %s", what, a, id)
		}
	}
}

// unitB300 names every function of the reference B300's GPU complex i below its root
// port.
func unitB300(i int) []string {
	var out []string
	for _, s := range []string{"bcm-usp", "bcm-dsp-cx", "cx-usp", "cx-dsp-nic", "cx-dsp-gpu", "gpu-usp", "gpu-dsp", "gpu",
		"bcm-dsp-holder", "holder", "bcm-dsp-nvme", "nvme"} {
		out = append(out, s+string(rune('0'+i)))
	}
	return append(out, "nic"+string(rune('0'+i))+".0", "nic"+string(rune('0'+i))+".1")
}

// alone takes the NICs and the NVMe out of the reference B300's GPU complex i (bus
// numbers do not move: only endpoints go).
func alone(s *pcitest.Spec, i int) {
	s.Fn("cx-dsp-nic" + string(rune('0'+i))).Below = nil
	s.Fn("bcm-dsp-nvme" + string(rune('0'+i))).Below = nil
}

// TestUnitIDsSurviveAnUnreadableGPU: a unit's ID comes from where it is. When one GPU's
// config space cannot be read (Vendor ID 0xffff, nothing returned, all ones), or a
// whole GPU complex cannot, every other unit keeps the ID and GPU it has on the intact
// tree; the unreadable GPU has no unit. Faults outside the units (the management NIC,
// an NVSwitch function, an unprivileged scan that sees 64 bytes of every function) move
// nothing either.
func TestUnitIDsSurviveAnUnreadableGPU(t *testing.T) {
	n0, tree := reference(t, "b300")
	intact := unitGPUs(mustLabel(t, tree, "b300"))
	if len(intact) != 8 {
		t.Fatalf("intact tree: %d units", len(intact))
	}
	for i := 0; i < 8; i++ {
		if intact[UnitID(i)] != n0.Addr("gpu"+string(rune('0'+i))) {
			t.Fatalf("intact tree: unit %d is %s", i, intact[UnitID(i)])
		}
	}
	allOnes := bytes.Repeat([]byte{0xff}, pci.ExtendedSize)
	for _, c := range []struct {
		name  string
		spec  func(*pcitest.Spec)
		after func(*testing.T, *pcitest.Node)
		lost  []string
		slots func(*pcitest.Node) map[string]int
	}{
		{name: "gpu3 reads vendor ffff", spec: func(s *pcitest.Spec) { s.Fn("gpu3").Vendor = 0xffff }, lost: []string{"gpu3"}},
		{name: "gpu0 reads vendor ffff", spec: func(s *pcitest.Spec) { s.Fn("gpu0").Vendor = 0xffff }, lost: []string{"gpu0"}},
		{name: "gpu3 config empty", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, "gpu3") }, lost: []string{"gpu3"}},
		{name: "gpu0 config empty", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, "gpu0") }, lost: []string{"gpu0"}},
		{name: "gpu3 config all ones", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, allOnes, "gpu3") }, lost: []string{"gpu3"}},
		{name: "gpu0 and gpu5 config empty", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, "gpu0", "gpu5") },
			lost: []string{"gpu0", "gpu5"}},
		// Nothing below the root port can be read: no function is labelled, the root port
		// still holds unreadable functions behind a switch.
		{name: "complex 3 unreadable", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, unitB300(3)...) }, lost: []string{"gpu3"}},
		{name: "complex 0 unreadable", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, unitB300(0)...) }, lost: []string{"gpu0"}},
		{name: "complex 0 all ones", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, allOnes, unitB300(0)...) }, lost: []string{"gpu0"}},
		// The GPU alone in its complex (no NIC, no NVMe): only its unreadable config
		// space holds the position, whichever way it cannot be read.
		{name: "lone gpu3 reads vendor ffff", spec: func(s *pcitest.Spec) { alone(s, 3); s.Fn("gpu3").Vendor = 0xffff }, lost: []string{"gpu3"}},
		{name: "lone gpu3 config empty", spec: func(s *pcitest.Spec) { alone(s, 3) },
			after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, "gpu3") }, lost: []string{"gpu3"}},
		{name: "lone gpu3 config all ones", spec: func(s *pcitest.Spec) { alone(s, 3) },
			after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, allOnes, "gpu3") }, lost: []string{"gpu3"}},
		{name: "lone gpu3 config read fails, no class file", spec: func(s *pcitest.Spec) { alone(s, 3) },
			after: func(t *testing.T, n *pcitest.Node) {
				dir := filepath.Join(n.Root, pci.DevicesDir, n.Addr("gpu3").String())
				// A config that cannot be read (here: a directory); the kernel's vendor and
				// device files still name it, but without its class no rule labels it.
				for _, err := range []error{os.Remove(filepath.Join(dir, "config")), os.Mkdir(filepath.Join(dir, "config"), 0o755),
					os.Remove(filepath.Join(dir, "class"))} {
					if err != nil {
						t.Fatal(err)
					}
				}
			}, lost: []string{"gpu3"}},
		// The slot map's IDs are reserved whether or not their slot holds a GPU today.
		{name: "gpu3 unreadable, slot map names its root port", spec: func(s *pcitest.Spec) { s.Fn("gpu3").Vendor = 0xffff },
			lost: []string{"gpu3"}, slots: func(n *pcitest.Node) map[string]int { return map[string]int{n.Addr("rp3").String(): 3} }},
		// Faults outside every unit.
		{name: "management NIC config empty", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, "mgmt0") }},
		{name: "NVSwitch function config empty", after: func(t *testing.T, n *pcitest.Node) { setConfig(t, n, nil, "nvswitch1") }},
		{name: "unprivileged scan", after: func(t *testing.T, n *pcitest.Node) {
			for name := range n.Names {
				p := filepath.Join(n.Root, pci.DevicesDir, n.Addr(name).String(), "config")
				if err := os.Truncate(p, pci.HeaderSize); err != nil {
					t.Fatal(err)
				}
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			spec := pcitest.B300()
			if c.spec != nil {
				c.spec(&spec)
			}
			n := pcitest.New(t, spec)
			if c.after != nil {
				c.after(t, n)
			}
			var slots map[string]int
			if c.slots != nil {
				slots = c.slots(n)
			}
			var lost []pci.Address
			for _, name := range c.lost {
				lost = append(lost, n.Addr(name))
			}
			sameUnits(t, c.name, intact, unitGPUs(labelFaulty(t, n, "b300", slots)), lost...)
		})
	}
}

// TestUnitIDsTwoGPUsOneRootPort: two GPUs below one root port (a second GPU beside gpu0
// in its complex) get distinct IDs, in address order within the root port; the root
// ports after it keep theirs when a GPU behind them cannot be read.
func TestUnitIDsTwoGPUsOneRootPort(t *testing.T) {
	twin := func(s *pcitest.Spec) {
		gpu := *s.Fn("gpu0")
		gpu.Name = "gpu0b"
		usp := s.Fn("gpu-usp0")
		usp.Below = append(usp.Below, pcitest.Fn{Name: "gpu-dsp0b", Dev: 1, Vendor: pcitest.VendorMellanox, Device: pcitest.DevCX8Bridge,
			Class: pcitest.ClassBridge, Port: pci.PortDownstream, Link: pcitest.Link{Speed: pcitest.Gen6, Width: 16},
			ACS: &pcitest.ACS{Cap: pci.ACSSV | pci.ACSRR | pci.ACSCR | pci.ACSUF | pci.ACSDT, Ctl: pci.ACSIsolation}, Driver: "pcieport",
			Below: []pcitest.Fn{gpu}})
	}
	spec := pcitest.B300()
	twin(&spec)
	n := pcitest.New(t, spec)
	l := labelFaulty(t, n, "b300", nil)
	want := map[UnitID]pci.Address{0: n.Addr("gpu0"), 1: n.Addr("gpu0b")}
	for i := 1; i < 8; i++ {
		want[UnitID(i+1)] = n.Addr("gpu" + string(rune('0'+i)))
	}
	sameUnits(t, "intact", want, unitGPUs(l))

	spec = pcitest.B300()
	twin(&spec)
	spec.Fn("gpu3").Vendor = 0xffff
	n = pcitest.New(t, spec)
	sameUnits(t, "gpu3 unreadable", want, unitGPUs(labelFaulty(t, n, "b300", nil)), n.Addr("gpu3"))
}

// TestUnitIDsQEMU: in the qemu profile's topology the switch ports below each unit's
// root port report "Root Port" too; the unit's position is still the port on the root
// bus, so unit 1 stays unit 1 when unit 0's GPU cannot be read.
func TestUnitIDsQEMU(t *testing.T) {
	n0, tree := reference(t, "qemu")
	intact := unitGPUs(mustLabel(t, tree, "qemu"))
	if len(intact) != 2 || intact[0] != n0.Addr("u0gpu") || intact[1] != n0.Addr("u1gpu") {
		t.Fatalf("intact qemu tree: %v", intact)
	}
	spec := qemuSpec()
	spec.Fn("u0gpu").Vendor = 0xffff
	n := pcitest.New(t, spec)
	sameUnits(t, "u0gpu unreadable", intact, unitGPUs(labelFaulty(t, n, "qemu", nil)), n.Addr("u0gpu"))
}
