package topology

import (
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
)

// TestGuestMMIOB300 sizes guests of the reference B300's units as edk2 does. Per unit the
// GPU's downstream port holds BAR1 (512 GiB) and BAR3 (32 MiB): 512 GiB + 32 MiB, aligned
// 512 GiB. Every downstream port is hotplug-capable, and OVMF pads each to the window's
// 1/256 (P: 4 GiB at 43 bits, 32 GiB at 46): the NIC PFs' 32 MiB and the NVMe's port
// (no prefetchable BAR) take P each, after the GPU's port rounded up to P. The next
// unit's root port starts at the next 512 GiB boundary, 1 TiB on: n units end at
// (n-1) TiB + 512 GiB + 4P, and OVMF's window, the top 1/8 of the address space, holds
// them from 40+log2(n)+3 bits. GPU BAR0 (32-bit) and the NVMe's 64-bit
// non-prefetchable BAR go below 4 GiB.
func TestGuestMMIOB300(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	const tib, gib = uint64(1) << 40, uint64(1) << 30
	unit := func(p uint64) uint64 { return 512*gib + 4*p }
	for _, tc := range []struct {
		units []UnitID
		numa  bool
		want  uint64
		width int
	}{
		{[]UnitID{0}, false, unit(4 * gib), 43},
		{[]UnitID{0, 1}, false, 1*tib + unit(8*gib), 44},
		{[]UnitID{0, 1, 2, 3}, false, 3*tib + unit(16*gib), 45},
		{nil, false, 7*tib + unit(32*gib), 46},
		// An expander per NUMA node is a root bridge of its own, placed at the next
		// 512 GiB boundary after the first: 3 TiB + 640 GiB, then 4 TiB on.
		{nil, true, 7*tib + unit(32*gib), 46},
		{[]UnitID{0, 4}, true, 1*tib + unit(8*gib), 44},
	} {
		g, err := GuestPlan(l.Units, GuestOptions{Units: tc.units, NUMA: tc.numa})
		if err != nil {
			t.Fatal(err)
		}
		m := g.MMIO()
		if m.Prefetchable64 != tc.want || m.Width != tc.width || m.Align != 512<<30 || len(m.Unknown) != 0 {
			t.Errorf("%d units (numa %v): %+v, want %s at %d bits", len(g.Units), tc.numa, m, Bytes(tc.want), tc.width)
		}
		if want := uint64(len(g.Units)) * (64<<20 + 32<<10); m.Mem32 != want {
			t.Errorf("%d units: mem32 %d, want %d", len(g.Units), m.Mem32, want)
		}
		if err := m.CheckWidth(tc.width, len(g.Units)); err != nil {
			t.Errorf("%d units at the width they need: %v", len(g.Units), err)
		}
		err = m.CheckWidth(tc.width-1, len(g.Units))
		if err == nil || !strings.Contains(err.Error(), "a "+itoa(tc.width)+"-bit physical address width; the width given is "+itoa(tc.width-1)+" bits") {
			t.Errorf("%d units one bit short: %v", len(g.Units), err)
		}
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

// TestApertureEDK2 checks the aperture rule on hand-made bridges: the sum is aligned to
// the bridge's own granularity, not to its largest child, and the bridge then carries
// the largest child's alignment (CalculateResourceAperture).
func TestApertureEDK2(t *testing.T) {
	for _, tc := range []struct {
		name     string
		children []resNode
		want     resNode
	}{
		{"empty", nil, resNode{0, 1 << 20}},
		{"one small BAR rounds to the window granularity", []resNode{{16 << 10, 16 << 10}}, resNode{1 << 20, 1 << 20}},
		{"largest first, whatever the order given", []resNode{{32 << 20, 32 << 20}, {512 << 30, 512 << 30}}, resNode{512<<30 + 32<<20, 512 << 30}},
		{"a small child before a large one would waste; edk2 sorts", []resNode{{1 << 20, 1 << 20}, {1 << 30, 1 << 30}, {1 << 20, 1 << 20}}, resNode{1<<30 + 2<<20, 1 << 30}},
		{"two big ones: the second at the next boundary", []resNode{{512<<30 + 96<<20, 512 << 30}, {512<<30 + 96<<20, 512 << 30}}, resNode{1<<40 + 512<<30 + 96<<20, 512 << 30}},
	} {
		if got := aperture(tc.children, 1<<20, 0); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

// TestAperturePadding: a hotplug port takes the larger of what is below it and its
// padding, and the padding's alignment; measured under Debian 12's OVMF at 46 bits
// (qemu-tests): an empty root port and a downstream port holding a 1 GiB BAR each get
// a 32 GiB prefetchable window, and the upstream port above two such 64 GiB.
func TestAperturePadding(t *testing.T) {
	const gib = uint64(1) << 30
	pad := prefPadding(OVMFWindow(46))
	empty := aperture(nil, 1<<20, pad)
	one := aperture([]resNode{{gib, gib}}, 1<<20, pad)
	up := aperture([]resNode{one, empty}, 1<<20, 0)
	big := aperture([]resNode{{512 * gib, 512 * gib}}, 1<<20, pad)
	for _, c := range []struct {
		name      string
		got, want resNode
	}{
		{"empty port", empty, resNode{32 * gib, 32 * gib}},
		{"1 GiB below", one, resNode{32 * gib, 32 * gib}},
		{"upstream port over both", up, resNode{64 * gib, 32 * gib}},
		{"512 GiB below: the BAR's", big, resNode{512 * gib, 512 * gib}},
	} {
		if c.got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, c.got, c.want)
		}
	}
	for _, c := range []struct {
		width int
		want  uint64
	}{{38, 0}, {40, 512 << 20}, {43, 4 * gib}, {46, 32 * gib}} {
		if got := prefPadding(uint64(1) << (c.width - 3)); got != c.want {
			t.Errorf("padding at %d bits: %d, want %d", c.width, got, c.want)
		}
	}
}

// TestGuestMMIOOtherPorts: KubeVirt's root ports sit on pcie.0, padded 32 GiB each at 46
// bits when hotplug-capable. Without guest NUMA the hook's placement puts the units' root
// ports on pcie.0 beside them: one root bridge, laid out in descending alignment, so the
// padding goes after the last unit, in its alignment gap, and 8 units still fit OVMF's 8
// TiB window. Under an expander of their own (with guest NUMA, the domain's per-node
// ones), a root bridge OVMF places after pcie.0, the same ports push the units to the
// next 512 GiB boundary: 8 units end 128 GiB past the window and no width OVMF uses
// holds them, with or without hotplug (the ports' virtio devices' 64-bit BARs push as
// well).
func TestGuestMMIOOtherPorts(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	const tib, gib = uint64(1) << 40, uint64(1) << 30
	others := func(n int, hotplug bool) []OtherPort {
		var o []OtherPort
		for i := 0; i < n; i++ {
			o = append(o, OtherPort{Expander: 0, Hotplug: hotplug, Index: 50 + i})
		}
		return o
	}
	all := []UnitID{0, 1, 2, 3, 4, 5, 6, 7}
	for _, tc := range []struct {
		name   string
		units  []UnitID
		others []OtherPort
		numa   bool // the units under per-node expanders (all on host node 0 and 1)
		want   uint64
		width  int
		err    string
	}{
		{"8 units alone", nil, nil, false, 7*tib + 640*gib, 46, ""},
		{"8 units, 7 other ports", nil, others(7, true), false, 7*tib + 864*gib, 46, ""},
		{"8 units, 7 ports without hotplug", nil, others(7, false), false, 7*tib + 640*gib + 7<<20, 46, ""},
		{"7 units, 7 other ports", []UnitID{0, 1, 2, 3, 4, 5, 6}, others(7, true), false, 6*tib + 864*gib, 46, ""},
		{"1 unit alone", []UnitID{0}, nil, false, 528 * gib, 43, ""},
		// 28 GiB after the unit at 43 bits: 556 GiB of the 1 TiB window.
		{"1 unit, 7 other ports", []UnitID{0}, others(7, true), false, 556 * gib, 43, ""},
		{"8 units on 2 expanders alone", all, nil, true, 7*tib + 640*gib, 46, ""},
		{"8 units on 2 expanders, 7 other ports", all, others(7, true), true, 8*tib + 128*gib, 47,
			"guest: 8 units beside the domain's 7 other root ports (OVMF pads each of the 7 hotplug-capable ones with 32 GiB of the window at 46 bits, 224 GiB in all) need 8320 GiB of 64-bit MMIO, a 47-bit address width; OVMF's window is at most 8 TiB"},
		{"8 units on 2 expanders, 7 ports without hotplug", all, others(7, false), true, 8*tib + 128*gib, 47, "beside the domain's 7 other root ports (none hotplug-capable)"},
	} {
		in := &Placement{FirstIndex: 2, OtherPorts: tc.others, RootPorts: rootPorts(8), RootBus: 8}
		if tc.numa {
			in.GuestNodes = map[int]int{0: 0, 1: 1}
		}
		g, err := GuestPlan(l.Units, GuestOptions{Units: tc.units, In: in})
		if err != nil {
			t.Fatal(err)
		}
		m := g.MMIO()
		if m.Prefetchable64 != tc.want || m.Width != tc.width || m.OtherPorts != len(tc.others) {
			t.Errorf("%s: %+v (%s), want %s at %d bits", tc.name, m, Bytes(m.Prefetchable64), Bytes(tc.want), tc.width)
		}
		err = m.CheckWidth(46, len(g.Units))
		if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%s at 46 bits: %v, want %q", tc.name, err, tc.err)
		}
	}
}

func TestOVMFWidthLimit(t *testing.T) {
	m := MMIO{Prefetchable64: 9 << 40, Width: 47}
	if err := m.CheckWidth(52, 9); err == nil || !strings.Contains(err.Error(), "OVMF's window is at most 8 TiB (46 bits with 4-level paging)") {
		t.Errorf("9 TiB: %v", err)
	}
	if OVMFWindow(40) != 128<<30 || OVMFWindow(52) != 8<<40 {
		t.Errorf("windows %d %d", OVMFWindow(40), OVMFWindow(52))
	}
}

// rootPorts are n places for root ports on pcie.0: functions of slots 0x10 on.
func rootPorts(n int) []pci.Address {
	var out []pci.Address
	for i := 0; i < n; i++ {
		out = append(out, pci.Address{Device: uint8(0x10 + i/8), Function: uint8(i % 8)})
	}
	return out
}
