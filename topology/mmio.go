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
	// OtherPorts counts the domain's root ports that are not the plan's
	// (Guest.OtherPorts), OtherHotplug those of them OVMF pads, and Padding is the
	// 64-bit space it reserves behind each hotplug-capable port at Width (prefPadding).
	OtherPorts   int    `json:"other_ports,omitempty"`
	OtherHotplug int    `json:"other_hotplug,omitempty"`
	Padding      uint64 `json:"padding,omitempty"`
}

// OtherPort is a root port of the domain that is not the plan's: KubeVirt's, for its
// own virtio devices and bare ones for hotplug. It takes OVMF's padding from the
// window like the plan's own ports, and from the root bridge it plugs into.
type OtherPort struct {
	// Expander is the libvirt index of the pxb-pcie it plugs into; 0: pcie.0.
	Expander int `json:"expander"`
	// Hotplug: the port has a hotplug-capable slot (QEMU's default; libvirt's
	// <target hotplug='off'/> clears it).
	Hotplug bool `json:"hotplug"`
	// Index is its libvirt controller index.
	Index int `json:"index"`
}

// resNode is one node of the resource tree: a BAR (no children) or a bridge.
type resNode struct {
	length, align uint64
}

// aperture places nodes as CalculateResourceAperture does and returns the bridge's
// length and alignment. pad is the bridge's hotplug padding (0: none): a padding node
// is placed apart from the typical ones, and the bridge takes the larger of the two
// apertures and the larger of their alignments.
func aperture(children []resNode, bridgeAlign, pad uint64) resNode {
	sort.SliceStable(children, func(i, j int) bool { return children[i].align > children[j].align })
	var off uint64
	for _, c := range children {
		if c.length == 0 {
			continue
		}
		off = alignUp(off, c.align) + c.length
	}
	out := resNode{length: max(alignUp(off, bridgeAlign), alignUp(pad, bridgeAlign)), align: bridgeAlign}
	if len(children) > 0 && children[0].length > 0 && children[0].align > out.align {
		out.align = children[0].align
	}
	out.align = max(out.align, pad)
	return out
}

func alignUp(v, a uint64) uint64 {
	if a <= 1 {
		return v
	}
	return (v + a - 1) / a * a
}

// prefPadding is the 64-bit prefetchable space OVMF reserves behind a hotplug-capable
// port that carries no QEMU resource-reservation hint (libvirt writes none, and
// KubeVirt's DomainSpec keeps none): OvmfPkg/PciHotPlugInitDxe's GetResourcePadding
// asks for the window's 1/256, rounded up to a power of two, once the window is above
// 32 GiB (edk2 9e6b552b4c48, in edk2-stable202211 and every release since). Every
// root port and every switch downstream port QEMU makes is hotplug-capable.
func prefPadding(window uint64) uint64 {
	if window <= 32<<30 {
		return 0
	}
	p := uint64(1)
	for p < window>>8 {
		p <<= 1
	}
	return p
}

// MMIO computes the guest's need for the plan's units beside the domain's other
// ports (Guest.OtherPorts).
func (g *Guest) MMIO() MMIO {
	var m MMIO
	for _, u := range g.Units {
		for _, f := range u.Functions {
			if f.Host.BARs == nil {
				m.Unknown = append(m.Unknown, fmt.Sprintf("%s (%s)", f.HostID, u.Unit))
			}
			for _, b := range f.Host.BARs {
				if !b.IO && !(b.Is64 && b.Prefetch) {
					m.Mem32 += alignUp(b.Size, 4096)
				}
			}
		}
	}
	m.OtherPorts = len(g.OtherPorts)
	for _, o := range g.OtherPorts {
		if o.Hotplug {
			m.OtherHotplug++
		}
	}
	// The padding follows the window and the window the width: the narrowest width
	// whose window holds the layout at that width's padding.
	for m.Width = minWidth; ; m.Width++ {
		window := uint64(1) << (m.Width - ovmfWindowShift)
		m.Prefetchable64, m.Align = g.layout64(prefPadding(window))
		if m.Prefetchable64 <= window || m.Width == 64 {
			break
		}
	}
	if m.Width > OVMFMaxWidth {
		// What OVMF would face at its widest.
		m.Prefetchable64, m.Align = g.layout64(prefPadding(OVMFWindow(OVMFMaxWidth)))
	}
	m.Padding = prefPadding(OVMFWindow(m.Width))
	return m
}

// layout64 is the end of the 64-bit window's layout and its largest alignment when
// every hotplug-capable port is padded with pad. PciHostBridgeDxe places the root
// bridges one after another from the window's base, in its list's order, each aligned
// to its largest child (NotifyPhase, EfiPciHostBridgeAllocateResources, bottom up):
// OVMF lists pcie.0 first and then each pxb-pcie in bus-number order
// (PciHostBridgeUtilityGetRootBridges). So a root port on pcie.0 that needs any 64-bit
// space pushes an expander's units to the next boundary of their alignment: 512 GiB
// for a B300's.
func (g *Guest) layout64(pad uint64) (end, align uint64) {
	type rootBridge struct {
		busNr    int
		children []resNode
	}
	roots := map[string]*rootBridge{"pcie.0": {}}
	byIndex := map[int]string{0: "pcie.0"}
	for _, x := range g.Expanders {
		roots[x.ID] = &rootBridge{busNr: x.BusNr}
		byIndex[x.Index] = x.ID
	}
	add := func(bus string, n resNode) {
		r, ok := roots[bus]
		if !ok {
			// A bus the plan does not list: placed after the ones it does.
			r = &rootBridge{busNr: 0x100 + len(roots)}
			roots[bus] = r
		}
		r.children = append(r.children, n)
	}
	for _, u := range g.Units {
		var ports []resNode
		for _, f := range u.Functions {
			var bars []resNode
			for _, b := range f.Host.BARs {
				if !b.IO && b.Is64 && b.Prefetch {
					bars = append(bars, resNode{b.Size, b.Size})
				}
			}
			// The function sits alone below its downstream port, which is padded.
			ports = append(ports, aperture(bars, bridgeWindowAlign, pad))
		}
		// An upstream port has no slot: no padding.
		up := aperture(ports, bridgeWindowAlign, 0)
		add(u.RootPort.Bus, aperture([]resNode{up}, bridgeWindowAlign, pad))
	}
	for _, o := range g.OtherPorts {
		bus, ok := byIndex[o.Expander]
		if !ok {
			bus = fmt.Sprintf("expander %d", o.Expander)
		}
		// A port that is not hotplug-capable gets only what its device needs: at most
		// a virtio device's 64-bit prefetchable BAR, which takes a bridge's least window.
		n := resNode{bridgeWindowAlign, bridgeWindowAlign}
		if o.Hotplug {
			n = aperture(nil, bridgeWindowAlign, pad)
		}
		add(bus, n)
	}
	ids := make([]string, 0, len(roots))
	for id := range roots {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return roots[ids[i]].busNr < roots[ids[j]].busNr })
	for _, id := range ids {
		if len(roots[id].children) == 0 {
			continue
		}
		r := aperture(roots[id].children, bridgeWindowAlign, 0)
		end = alignUp(end, r.align) + r.length
		align = max(align, r.align)
	}
	return end, align
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
		return fmt.Errorf("guest: %d units%s need %s of 64-bit MMIO, a %d-bit address width; OVMF's window is at most %s (%d bits with 4-level paging)",
			units, m.others(OVMFMaxWidth), Bytes(m.Prefetchable64), m.Width, Bytes(OVMFWindow(OVMFMaxWidth)), OVMFMaxWidth)
	}
	if width < m.Width {
		return fmt.Errorf("guest: %d units%s need %s of 64-bit MMIO, a %d-bit physical address width; the width given is %d bits, whose OVMF window is %s: their BARs would not all be mapped",
			units, m.others(m.Width), Bytes(m.Prefetchable64), m.Width, width, Bytes(OVMFWindow(width)))
	}
	return nil
}

// others says what the domain's other root ports take, at a width.
func (m MMIO) others(width int) string {
	if m.OtherPorts == 0 {
		return ""
	}
	if m.OtherHotplug == 0 {
		return fmt.Sprintf(" beside the domain's %d other root ports (none hotplug-capable)", m.OtherPorts)
	}
	pad := prefPadding(OVMFWindow(width))
	return fmt.Sprintf(" beside the domain's %d other root ports (OVMF pads each of the %d hotplug-capable ones with %s of the window at %d bits, %s in all)",
		m.OtherPorts, m.OtherHotplug, Bytes(pad), width, Bytes(pad*uint64(m.OtherHotplug)))
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
