package topology

import (
	"strconv"
	"strings"
	"testing"
)

// TestGuestMMIOB300 sizes guests of the reference B300's units as edk2 does. Per unit the
// GPU's downstream port holds BAR1 (512 GiB) and BAR3 (32 MiB): 512 GiB + 32 MiB, aligned
// 512 GiB; the switch adds the two NIC PFs' 32 MiB: 512 GiB + 96 MiB. The next unit's
// root port starts at the next 512 GiB boundary, 1 TiB on: n units take n TiB, and OVMF's
// window, the top 1/8 of the address space, holds them from 40+log2(n)+3 bits. GPU BAR0
// (32-bit) and the NVMe's 64-bit non-prefetchable BAR go below 4 GiB.
func TestGuestMMIOB300(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	const tib = uint64(1) << 40
	for _, tc := range []struct {
		units []UnitID
		numa  bool
		want  uint64
		width int
	}{
		{[]UnitID{0}, false, 1 * tib, 43},
		{[]UnitID{0, 1}, false, 2 * tib, 44},
		{[]UnitID{0, 1, 2, 3}, false, 4 * tib, 45},
		{nil, false, 8 * tib, 46},
		// An expander per NUMA node is a root bridge of its own: 4 TiB each.
		{nil, true, 8 * tib, 46},
		{[]UnitID{0, 4}, true, 2 * tib, 44},
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
		if got := aperture(tc.children, 1<<20); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
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
