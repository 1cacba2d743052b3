package pcitest

import "github.com/passage-boot/passage/pci"

// assignGroups forms IOMMU groups the way Linux does (pci_device_group in
// drivers/iommu/iommu.c): a function shares the group of the first bridge above it whose
// path to the root lacks ACS isolation (SV RR CR UF on root and downstream ports), of the
// PCIe-to-PCI bridge it aliases to, or of a sibling function of a multi-function device
// without ACS. Groups are numbered in enumeration order.
func assignGroups(all []*built) map[*built]int {
	groups := map[*built]int{}
	nextID := 0
	var groupOf func(b *built) int
	groupOf = func(b *built) int {
		if g, ok := groups[b]; ok {
			return g
		}
		p := b
		// DMA alias: conventional functions behind a PCIe-to-PCI bridge are seen by the
		// IOMMU with the bridge's requester ID.
		for up := b.parent; up != nil; up = up.parent {
			if up.fn.Port == pci.PortPCIeToPCI && !up.fn.Conventional {
				p = up
			}
		}
		if p != b {
			g := groupOf(p)
			groups[b] = g
			return g
		}
		// The kernel walks up the buses, but returns at the first bridge without an ACS
		// path to the root: bridges are grouped before the functions below them, so
		// that bridge always has a group to join.
		if up := b.parent; up != nil && !acsPathEnabled(up) {
			g := groupOf(up)
			groups[b] = g
			return g
		}
		if b.multi && !acsEnabled(b) {
			for _, o := range all {
				if o != b && o.parent == b.parent && o.addr.Bus == b.addr.Bus && o.addr.Device == b.addr.Device && !acsEnabled(o) {
					if g, ok := groups[o]; ok {
						groups[b] = g
						return g
					}
				}
			}
		}
		g := nextID
		nextID++
		groups[b] = g
		return g
	}
	for _, b := range all {
		groupOf(b)
	}
	return groups
}

func acsPathEnabled(b *built) bool {
	for x := b; x != nil; x = x.parent {
		if !acsEnabled(x) {
			return false
		}
	}
	return true
}

// acsEnabled mirrors pci_acs_enabled (drivers/pci/pci.c): conventional functions,
// PCIe-to-PCI and PCI-to-PCIe bridges and RCECs never isolate; root and downstream ports and multi-function devices need the flags (those a
// port does not advertise count as hard-wired on); upstream ports and single-function
// endpoints are fine.
func acsEnabled(b *built) bool {
	f := b.fn
	if f.Conventional || f.Port == pci.PortPCIeToPCI || f.Port == pci.PortPCIToPCIe || f.Port == pci.PortRCEC {
		return false
	}
	if f.Port == pci.PortRootPort || f.Port == pci.PortDownstream || b.multi {
		if f.ACS == nil {
			return false
		}
		want := pci.ACSIsolation & (f.ACS.Cap | pci.ACSEC)
		return f.ACS.Ctl&want == want
	}
	return true
}
