package pciids

import "github.com/passage-boot/passage/topology"

// ProfileWants is what a subset keeps for the profiles: every vendor a rule names, with
// the devices the rules name. A rule that names a vendor and a class but no device
// (NVIDIA's GPUs go by class, so a new GPU needs no new profile) keeps every device of
// that vendor, since pci.ids gives devices no class to filter on; a vendor named with
// neither (QEMU's placeholders by position) keeps its name only.
func ProfileWants(profiles []*topology.Profile) map[uint16]*Wanted {
	want := map[uint16]*Wanted{}
	var walk func(m *topology.Match)
	walk = func(m *topology.Match) {
		if m == nil {
			return
		}
		for _, v := range m.Vendor {
			w := want[v]
			if w == nil {
				w = &Wanted{Devices: map[uint16]bool{}}
				want[v] = w
			}
			if len(m.Device) == 0 && m.Class != nil {
				w.AllDevices = true
			}
			for _, d := range m.Device {
				w.Devices[d] = true
			}
		}
		for i := range m.Below {
			walk(&m.Below[i])
		}
		for i := range m.NotBelow {
			walk(&m.NotBelow[i])
		}
		walk(m.Parent)
		walk(m.Sibling)
		walk(m.NoSibling)
		walk(m.Not)
	}
	for _, p := range profiles {
		for i := range p.Rules {
			walk(&p.Rules[i].Match)
		}
	}
	return want
}
