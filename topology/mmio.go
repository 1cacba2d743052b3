package topology

import (
	"fmt"
	"sort"
)

// The guest's 64-bit MMIO: what OVMF must find room for to map every BAR of the
// passthrough functions, in the layout the plan builds. A B300's frame-buffer BAR is
// 512 GiB; OVMF's 64-bit window is a fixed share of the guest's physical address space
// (PlatformDynamicMmioWindow in OvmfPkg/Library/PlatformInitLib/MemDetect.c: the top
// 1/8), so the address width decides whether the units' BARs are mapped at all. A
// function whose BARs find no room is left without them; in the guest its driver then
// reports "BAR0 is 0M".

// OVMF's rules, cited where they are used.
const (
	// bridgeWindowAlign is a PCI-PCI bridge's memory window granularity (PCI-PCI
	// Bridge 1.2 3.2.5.8): edk2's PciBusDxe starts a bridge's alignment there.
	bridgeWindowAlign = 1 << 20
	// ovmfWindowShift: the dynamic window is 2^(width-3) at the top of the space.
	ovmfWindowShift = 3
	// OVMFMaxWidth is the widest guest address width OVMF uses with 4-level paging
	// (PlatformAddressWidthFromCpuid: "if (PhysBits > 46) PhysBits = 46"): its window
	// is at most 8 TiB.
	OVMFMaxWidth = 46
	// minWidth is the narrowest width render asks for: QEMU's default CPUs have 40 bits.
	minWidth = 40
)

// MMIO is the guest's need, computed as edk2's PciBusDxe sizes bridge windows
// (CalculateResourceAperture in MdeModulePkg/Bus/Pci/PciBusDxe/PciResourceSupport.c):
// a bridge's children are placed in descending alignment, each at the next offset
// aligned to its own alignment; the sum is aligned to the bridge's window granularity
// (1 MiB), and the bridge then takes the largest child alignment as its own. The root
// bridges (pcie.0, or each pxb-pcie expander) are then placed in OVMF's window, each
// aligned to its largest child.
type MMIO struct {
	// Prefetchable64 is the sum over the root bridges of their 64-bit prefetchable
	// aperture, each rounded up to its alignment: the window that holds them all.
	Prefetchable64 uint64 `json:"prefetchable64"`
	// Align is the largest alignment among them (the largest BAR).
	Align uint64 `json:"align"`
	// Mem32 is what goes below 4 GiB: 32-bit BARs and 64-bit non-prefetchable ones,
	// which a bridge's non-prefetchable window (32-bit only) forwards.
	Mem32 uint64 `json:"mem32"`
	// Width is the narrowest guest physical address width (at least 40) whose OVMF
	// window, 2^(Width-3), holds Prefetchable64.
	Width int `json:"width"`
	// Unknown names the functions whose BAR sizes the input does not give (a plan
	// from an lspci dump, a manifest before schema 4): the need is then a lower bound.
	Unknown []string `json:"unknown,omitempty"`
}

// resNode is one node of the resource tree: a BAR (no children) or a bridge.
type resNode struct {
	length, align uint64
}

// aperture places nodes as CalculateResourceAperture does and returns the bridge's
// length and alignment.
func aperture(children []resNode, bridgeAlign uint64) resNode {
	sort.SliceStable(children, func(i, j int) bool { return children[i].align > children[j].align })
	var off uint64
	for _, c := range children {
		if c.length == 0 {
			continue
		}
		off = alignUp(off, c.align) + c.length
	}
	out := resNode{length: alignUp(off, bridgeAlign), align: bridgeAlign}
	if len(children) > 0 && children[0].length > 0 && children[0].align > out.align {
		out.align = children[0].align
	}
	return out
}

func alignUp(v, a uint64) uint64 {
	if a <= 1 {
		return v
	}
	return (v + a - 1) / a * a
}

// MMIO computes the guest's need for the plan's units.
func (g *Guest) MMIO() MMIO {
	var m MMIO
	roots := map[string][]resNode{} // root bridge (the bus a unit's root port plugs into) -> its root ports
	var order []string
	for _, u := range g.Units {
		var ports []resNode
		for _, f := range u.Functions {
			var bars []resNode
			if f.Host.BARs == nil {
				m.Unknown = append(m.Unknown, fmt.Sprintf("%s (%s)", f.HostID, u.Unit))
			}
			for _, b := range f.Host.BARs {
				switch {
				case b.IO:
					// GPUs and ConnectX have none; the 64 KiB I/O space is not sized here.
				case b.Is64 && b.Prefetch:
					bars = append(bars, resNode{b.Size, b.Size})
				default:
					m.Mem32 += alignUp(b.Size, 4096)
				}
			}
			// The function sits alone below its downstream port.
			ports = append(ports, aperture(bars, bridgeWindowAlign))
		}
		up := aperture(ports, bridgeWindowAlign)
		rp := aperture([]resNode{up}, bridgeWindowAlign)
		bus := u.RootPort.Bus
		if _, ok := roots[bus]; !ok {
			order = append(order, bus)
		}
		roots[bus] = append(roots[bus], rp)
	}
	for _, bus := range order {
		r := aperture(roots[bus], 1)
		m.Prefetchable64 += alignUp(r.length, r.align)
		m.Align = max(m.Align, r.align)
	}
	m.Width = minWidth
	for m.Width < 64 && uint64(1)<<(m.Width-ovmfWindowShift) < m.Prefetchable64 {
		m.Width++
	}
	return m
}

// OVMFWindow is the 64-bit MMIO window OVMF opens at a guest address width.
func OVMFWindow(width int) uint64 {
	if width > OVMFMaxWidth {
		width = OVMFMaxWidth
	}
	return uint64(1) << (width - ovmfWindowShift)
}

// CheckWidth refuses a guest address width whose OVMF window cannot hold the need,
// naming the width needed and the width given; and a need no width OVMF uses holds.
func (m MMIO) CheckWidth(width int, units int) error {
	if m.Width > OVMFMaxWidth {
		return fmt.Errorf("guest: %d units need %s of 64-bit MMIO, a %d-bit address width; OVMF's window is at most %s (%d bits with 4-level paging)",
			units, Bytes(m.Prefetchable64), m.Width, Bytes(OVMFWindow(OVMFMaxWidth)), OVMFMaxWidth)
	}
	if width < m.Width {
		return fmt.Errorf("guest: %d units need %s of 64-bit MMIO, a %d-bit physical address width; the width given is %d bits, whose OVMF window is %s: their BARs would not all be mapped",
			units, Bytes(m.Prefetchable64), m.Width, width, Bytes(OVMFWindow(width)))
	}
	return nil
}

// Bytes writes a size as lspci does, in the largest unit it is a whole multiple of
// ("512 GiB", "7680 GiB", "8 TiB").
func Bytes(x uint64) string {
	suffix := []string{"", "K", "M", "G", "T"}
	i := 0
	for ; i < len(suffix)-1 && x != 0 && x%1024 == 0; i++ {
		x /= 1024
	}
	if i == 0 {
		return fmt.Sprintf("%d bytes", x)
	}
	return fmt.Sprintf("%d %siB", x, suffix[i])
}
