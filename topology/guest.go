package topology

import (
	"fmt"
	"sort"

	"github.com/passage-boot/passage/pci"
)

// GuestOptions choose what a guest gets and how its PCIe tree is laid out.
type GuestOptions struct {
	// Units are the unit IDs to pass through; nil means every unit that is not failed.
	Units []UnitID
	// NUMA puts each unit behind a pxb-pcie expander bound to the guest NUMA node that
	// stands for the unit's host node, so units on one socket read NODE and across
	// sockets SYS, as on the host. Without it every unit's root port is on pcie.0 and
	// other units' NICs read PHB.
	NUMA bool
	// FirstBus is the first guest bus number the plan's ports get in the flat layout
	// (default 1: the plan's root ports are the first bridges firmware numbers). The
	// NCCL topology XML carries guest bus IDs predicted from it.
	FirstBus int
	// RootSlot is the first pcie.0 slot used for the plan's root ports or expanders
	// (default 0x10).
	RootSlot int
	// ExpanderBus0 and ExpanderStride place the expanders' bus numbers (defaults 0x80
	// and 0x10): expander i starts at ExpanderBus0 + i*ExpanderStride.
	ExpanderBus0, ExpanderStride int
	// In lays the units out inside a domain that exists already (the KubeVirt hook's:
	// other devices, controllers and expanders in place); nil lays out a fresh guest as
	// render does. It is the same plan: one switch per unit, one downstream port per
	// function, each function at device 0 of its port.
	In *Placement
}

// Placement is what an existing domain leaves to a guest plan.
type Placement struct {
	// Free are the unused libvirt controller indexes below FirstIndex, ascending, and
	// FirstIndex the first above every used one: the plan's controllers take the free
	// ones first, since libvirt fills a gap in the indexes with a root port of its own.
	Free       []int
	FirstIndex int
	// GuestNodes maps host NUMA nodes to the domain's guest NUMA cells; nil: the domain
	// has none, and every unit's root port goes on pcie.0 (RootPorts), as render's flat
	// layout puts it.
	GuestNodes map[int]int
	// RootPorts are the pcie.0 slots and functions free for the plan's root ports
	// without guest NUMA, in firmware's order, with no bridge of the domain among them:
	// firmware numbers the units' buses consecutively from RootBus on. On pcie.0 the
	// units share OVMF's first root bridge with the domain's own root ports, which it
	// lays out in descending alignment: the units' 512 GiB BARs first, the other ports'
	// padding after them, in the last unit's alignment gap. Under an expander of their
	// own (a root bridge OVMF places after pcie.0) that padding would move every unit up
	// by a GPU BAR's alignment, and eight units, which fill OVMF's 8 TiB window exactly,
	// would no longer fit (topology.MMIO).
	RootPorts []pci.Address
	RootBus   int
	// Expanders are the domain's pxb-pcie expanders (KubeVirt's PCINUMAAwareTopology
	// makes one per guest node): a unit goes under the one of its guest node, after the
	// devices it holds. Their bus numbers are allotted again, downward from 0xff as
	// KubeVirt allots them, each with room for what it holds and for its units' switches.
	Expanders []PlacedExpander
	// OtherPorts are the domain's root ports that stay beside the plan's: the guest's
	// 64-bit MMIO counts them (Guest.MMIO).
	OtherPorts []OtherPort
}

// PlacedExpander is an expander the domain has.
type PlacedExpander struct {
	Index     int // libvirt controller index
	GuestNUMA int // guest node, -1 for none
	// NextSlot is its first slot after the devices it holds; Reserved the bus numbers
	// the bridges among those take (firmware numbers them first: lower slots).
	NextSlot, Reserved int
	// BusNr is the bus number the domain gives it (0: none).
	BusNr int
}

// GuestPort is one emulated port of the guest plan.
type GuestPort struct {
	ID      string `json:"id"`
	Model   string `json:"model"` // pcie-root-port, x3130-upstream, xio3130-downstream
	Bus     string `json:"bus"`   // QEMU id of the bus it plugs into
	Dev     int    `json:"dev"`   // device number on that bus
	Chassis int    `json:"chassis,omitempty"`
	Slot    int    `json:"slot,omitempty"`
	// Addr is where the guest sees the port; Secondary is the bus number it provides.
	Addr      pci.Address `json:"addr"`
	Secondary int         `json:"secondary"`
	// Index is its libvirt controller index and Parent the index of the bus it plugs
	// into (in render's flat layout: the guest bus numbers themselves).
	Index  int `json:"index"`
	Parent int `json:"parent"`
}

// GuestFunction is one passthrough function and its place in the guest.
type GuestFunction struct {
	Host   HostFunction `json:"-"`
	HostID pci.Address  `json:"host"`
	Role   Role         `json:"role"`
	Port   GuestPort    `json:"port"` // the downstream port above it
	ID     string       `json:"id"`   // QEMU device id
	Addr   pci.Address  `json:"addr"` // predicted guest address
}

// Expander is a pxb-pcie host bridge of the guest.
type Expander struct {
	ID       string `json:"id"`
	BusNr    int    `json:"bus_nr"`
	NUMANode int    `json:"numa_node"` // guest node, -1 for none
	Dev      int    `json:"dev"`       // slot on pcie.0
	Index    int    `json:"index"`     // libvirt controller index
	// Kept: the domain had it (Placement); only its bus number is the plan's.
	Kept bool `json:"kept,omitempty"`
}

// GuestUnit is one unit's virtual switch: root port -> upstream -> one downstream port
// per function.
type GuestUnit struct {
	Unit      UnitID          `json:"unit"`
	HostNUMA  int             `json:"host_numa"`
	GuestNUMA int             `json:"guest_numa"`
	Expander  string          `json:"expander,omitempty"`
	RootPort  GuestPort       `json:"root_port"`
	Upstream  GuestPort       `json:"upstream"`
	Functions []GuestFunction `json:"functions"`
	// UpLink is the host's link from the unit to the CPU (the root port's), the link the
	// guest's emulated root port cannot show.
	UpLink Link `json:"uplink"`
}

// Link is a link's negotiated speed and width as LnkSta shows it.
type Link struct {
	Speed pci.LinkSpeed `json:"-"`
	Width int           `json:"width"`
	GTs   float64       `json:"gts"`
}

func linkOf(d *pci.Device) Link {
	if d == nil || d.Express == nil || !d.Express.HasLink {
		return Link{}
	}
	return Link{Speed: d.Express.Speed, Width: int(d.Express.Width), GTs: d.Express.Speed.GTs()}
}

// Guest is the guest's PCIe plan for a set of units.
type Guest struct {
	NUMA      bool        `json:"numa"`
	Expanders []Expander  `json:"expanders,omitempty"`
	Units     []GuestUnit `json:"units"`
	// GuestNodes maps host NUMA nodes to the guest nodes the VM must define.
	GuestNodes map[int]int `json:"guest_nodes,omitempty"`
	// Placed: laid out inside an existing domain (GuestOptions.In).
	Placed bool `json:"placed,omitempty"`
	// OtherPorts: the domain's root ports beside the plan's (Placement.OtherPorts).
	OtherPorts []OtherPort `json:"other_ports,omitempty"`
}

// GuestPlan lays out the chosen units for a guest (PlanGuest over SourcesOf(units)).
func GuestPlan(units []*Unit, opt GuestOptions) (*Guest, error) {
	return PlanGuest(SourcesOf(units), opt)
}

// PlanGuest lays out the chosen units for a guest. Guest bus numbers are predicted the
// way firmware numbers buses (depth first, in slot order); with NUMA the expanders pin
// them.
func PlanGuest(units []GuestSource, opt GuestOptions) (*Guest, error) {
	if opt.FirstBus == 0 {
		opt.FirstBus = 1
	}
	if opt.RootSlot == 0 {
		opt.RootSlot = 0x10
	}
	if opt.ExpanderBus0 == 0 {
		opt.ExpanderBus0 = 0x80
	}
	if opt.ExpanderStride == 0 {
		opt.ExpanderStride = 0x10
	}
	chosen, err := chooseUnits(units, opt.Units)
	if err != nil {
		return nil, err
	}
	if len(chosen) == 0 {
		return nil, fmt.Errorf("guest plan: no unit to pass through")
	}
	if opt.In != nil {
		return placeIn(chosen, opt.In)
	}
	if opt.RootSlot+len(chosen) > 0x1f {
		return nil, fmt.Errorf("guest plan: %d units do not fit pcie.0 from slot %#x", len(chosen), opt.RootSlot)
	}
	g := &Guest{NUMA: opt.NUMA}
	if opt.NUMA {
		var nodes []int
		seen := map[int]bool{}
		for _, u := range chosen {
			if !seen[u.NUMANode] {
				seen[u.NUMANode] = true
				nodes = append(nodes, u.NUMANode)
			}
		}
		sort.Ints(nodes)
		g.GuestNodes = map[int]int{}
		for i, n := range nodes {
			g.GuestNodes[n] = i
		}
	}
	bus := opt.FirstBus
	// libvirt controller indexes, dense from 1: libvirt fills every gap in the indexes
	// with a pcie-root-port of its own (for expanders at bus 0x80 and on, over a hundred
	// hotplug ports on pcie.0, each of which OVMF pads). Without NUMA they are the guest
	// bus numbers themselves.
	next := 0
	index := func() int { next++; return next }
	for i, u := range chosen {
		gu := GuestUnit{Unit: u.ID, HostNUMA: u.NUMANode, UpLink: u.UpLink}
		chassis := i + 1
		prefix := fmt.Sprintf("u%d", u.ID)
		rp := GuestPort{ID: prefix + "rp", Model: "pcie-root-port", Bus: "pcie.0", Dev: opt.RootSlot + i, Chassis: chassis, Slot: 0}
		if opt.NUMA {
			gu.GuestNUMA = g.GuestNodes[u.NUMANode]
			x := Expander{ID: prefix + "pxb", BusNr: opt.ExpanderBus0 + i*opt.ExpanderStride, NUMANode: gu.GuestNUMA, Dev: opt.RootSlot + i}
			x.Index = index()
			if x.BusNr > 0xff {
				return nil, fmt.Errorf("guest plan: %s: expander bus %#x past 0xff", u.ID, x.BusNr)
			}
			g.Expanders = append(g.Expanders, x)
			gu.Expander = x.ID
			rp.Bus, rp.Dev = x.ID, 0
			rp.Addr = pci.Address{Bus: uint8(x.BusNr)}
			bus = x.BusNr + 1
		} else {
			rp.Addr = pci.Address{Bus: 0, Device: uint8(rp.Dev)}
		}
		fns := u.Functions
		need := 2 + len(fns)
		if opt.NUMA && need >= opt.ExpanderStride {
			return nil, fmt.Errorf("guest plan: %s needs %d buses, expander stride is %d", u.ID, need, opt.ExpanderStride)
		}
		if bus+need-1 > 0xff {
			return nil, fmt.Errorf("guest plan: %s: out of guest bus numbers", u.ID)
		}
		if len(fns) > 32 {
			return nil, fmt.Errorf("guest plan: %s: %d functions do not fit one switch", u.ID, len(fns))
		}
		rp.Secondary = bus
		rp.Index, rp.Parent = index(), 0
		if opt.NUMA {
			rp.Parent = g.Expanders[len(g.Expanders)-1].Index
		}
		unitSwitch(&gu, u, rp, prefix, chassis, index)
		bus += need
		g.Units = append(g.Units, gu)
	}
	return g, nil
}

// unitSwitch lays out one unit's switch below its root port rp (rp.Secondary set):
// the upstream port on rp's bus, one downstream port per function, each function at
// device 0 of its port. Controller indexes are the next ones index gives.
func unitSwitch(gu *GuestUnit, u GuestSource, rp GuestPort, prefix string, chassis int, index func() int) {
	bus := rp.Secondary
	us := GuestPort{ID: prefix + "us", Model: "x3130-upstream", Bus: rp.ID, Addr: pci.Address{Bus: uint8(bus)}, Secondary: bus + 1,
		Index: index(), Parent: rp.Index}
	gu.RootPort, gu.Upstream = rp, us
	for k, f := range u.Functions {
		ds := GuestPort{ID: fmt.Sprintf("%sds%d", prefix, k), Model: "xio3130-downstream", Bus: us.ID, Dev: k,
			Addr: pci.Address{Bus: uint8(bus + 1), Device: uint8(k)}, Secondary: bus + 2 + k, Parent: us.Index}
		ds.Index = index()
		if chassis > 0 {
			ds.Chassis, ds.Slot = chassis, k+1
		}
		gu.Functions = append(gu.Functions, GuestFunction{Host: f, HostID: f.Addr, Role: f.Role, Port: ds,
			ID: fmt.Sprintf("%sf%d", prefix, k), Addr: pci.Address{Bus: uint8(ds.Secondary)}})
	}
}

// placeIn lays the chosen units out inside an existing domain (GuestOptions.In): per
// unit the same switch as the fresh plan's, its root port on the expander of its
// guest node (the domain's, or one of the plan's own), expander bus numbers allotted
// downward from 0xff so that the libvirt controller indexes (upward from FirstIndex)
// stay below them.
func placeIn(chosen []GuestSource, in *Placement) (*Guest, error) {
	g := &Guest{NUMA: in.GuestNodes != nil, Placed: true, OtherPorts: in.OtherPorts}
	next := in.FirstIndex
	if next < 1 {
		return nil, fmt.Errorf("guest plan: first controller index %d: want 1 or more (0 is pcie-root)", next)
	}
	free := append([]int(nil), in.Free...)
	index := func() int {
		if len(free) > 0 {
			i := free[0]
			free = free[1:]
			return i
		}
		next++
		return next - 1
	}
	if !g.NUMA {
		return placeFlat(g, chosen, in, index)
	}
	type slot struct {
		x        *Expander
		nextSlot int
		reserved int
		units    []int
	}
	var xs []*slot
	byNode := map[int]*slot{}
	for _, e := range in.Expanders {
		s := &slot{x: &Expander{ID: fmt.Sprintf("pxb%d", e.Index), NUMANode: e.GuestNUMA, Index: e.Index, Kept: true}, nextSlot: e.NextSlot, reserved: e.Reserved}
		xs = append(xs, s)
		if _, dup := byNode[e.GuestNUMA]; !dup && e.GuestNUMA >= 0 {
			byNode[e.GuestNUMA] = s
		}
	}
	// Expanders the plan adds take their indexes first: their root ports plug into them.
	for i, u := range chosen {
		node, ok := in.GuestNodes[u.NUMANode]
		if !ok {
			return nil, fmt.Errorf("guest plan: %s: host NUMA node %d has no guest NUMA cell bound to it", u.ID, u.NUMANode)
		}
		s := byNode[node]
		if s == nil {
			s = &slot{x: &Expander{ID: fmt.Sprintf("pxbn%d", node), NUMANode: node, Index: index()}}
			xs = append(xs, s)
			byNode[node] = s
		}
		s.units = append(s.units, i)
	}
	g.GuestNodes = in.GuestNodes
	units := make([]GuestUnit, len(chosen))
	top := 0xff
	for _, s := range xs {
		need := 1 + s.reserved
		for _, i := range s.units {
			need += 2 + len(chosen[i].Functions)
		}
		s.x.BusNr = top - need + 1
		top = s.x.BusNr - 1
		if s.nextSlot+len(s.units) > 0x20 {
			return nil, fmt.Errorf("guest plan: expander %d: %d units do not fit from slot %#x", s.x.Index, len(s.units), s.nextSlot)
		}
		bus := s.x.BusNr + 1 + s.reserved
		for k, i := range s.units {
			u := chosen[i]
			if len(u.Functions) > 32 {
				return nil, fmt.Errorf("guest plan: %s: %d functions do not fit one switch", u.ID, len(u.Functions))
			}
			prefix := fmt.Sprintf("u%d", u.ID)
			gu := GuestUnit{Unit: u.ID, HostNUMA: u.NUMANode, GuestNUMA: s.x.NUMANode, Expander: s.x.ID, UpLink: u.UpLink}
			rp := GuestPort{ID: prefix + "rp", Model: "pcie-root-port", Bus: s.x.ID, Dev: s.nextSlot + k,
				Addr: pci.Address{Bus: uint8(s.x.BusNr), Device: uint8(s.nextSlot + k)}, Secondary: bus, Index: index(), Parent: s.x.Index}
			unitSwitch(&gu, u, rp, prefix, 0, index)
			bus += 2 + len(u.Functions)
			units[i] = gu
		}
		g.Expanders = append(g.Expanders, *s.x)
	}
	if top < next {
		return nil, fmt.Errorf("guest plan: expander bus numbers reach down to %#x, below the controller indexes (up to %d)", top+1, next-1)
	}
	g.Units = units
	return g, nil
}

// placeFlat puts each unit's root port on pcie.0, at the next of in.RootPorts, its
// buses numbered from in.RootBus (placeIn without guest NUMA).
func placeFlat(g *Guest, chosen []GuestSource, in *Placement, index func() int) (*Guest, error) {
	if len(in.RootPorts) < len(chosen) {
		return nil, fmt.Errorf("guest plan: %d units need a root port each on pcie.0, with none of the domain's bridges among them; %d places are free", len(chosen), len(in.RootPorts))
	}
	bus := in.RootBus
	if bus < 1 {
		return nil, fmt.Errorf("guest plan: first guest bus %d: want 1 or more (0 is pcie.0)", bus)
	}
	for i, u := range chosen {
		at := in.RootPorts[i]
		if at.Domain != 0 || at.Bus != 0 || at.Device < 1 || at.Device > 0x1f || at.Function > 7 {
			return nil, fmt.Errorf("guest plan: %s: not a place for a root port on pcie.0", at)
		}
		if len(u.Functions) > 32 {
			return nil, fmt.Errorf("guest plan: %s: %d functions do not fit one switch", u.ID, len(u.Functions))
		}
		if need := 2 + len(u.Functions); bus+need-1 > 0xff {
			return nil, fmt.Errorf("guest plan: %s: out of guest bus numbers", u.ID)
		}
		prefix := fmt.Sprintf("u%d", u.ID)
		gu := GuestUnit{Unit: u.ID, HostNUMA: u.NUMANode, GuestNUMA: -1, UpLink: u.UpLink}
		rp := GuestPort{ID: prefix + "rp", Model: "pcie-root-port", Bus: "pcie.0", Dev: int(at.Device),
			Addr: at, Secondary: bus, Index: index(), Parent: 0}
		unitSwitch(&gu, u, rp, prefix, 0, index)
		bus += 2 + len(u.Functions)
		g.Units = append(g.Units, gu)
	}
	// The domain's expanders keep their bus numbers: the units' must end below them.
	for _, e := range in.Expanders {
		if e.BusNr > 0 && e.BusNr < bus {
			return nil, fmt.Errorf("guest plan: the units' guest buses %#x-%#x reach the domain's expander %d at bus %#x", in.RootBus, bus-1, e.Index, e.BusNr)
		}
	}
	return g, nil
}

func contains(ds []*pci.Device, d *pci.Device) bool {
	for _, x := range ds {
		if x == d {
			return true
		}
	}
	return false
}

func rootPortOf(d *pci.Device) *pci.Device {
	anc := d.Ancestors()
	if len(anc) == 0 {
		return nil
	}
	return anc[len(anc)-1]
}

func chooseUnits(units []GuestSource, ids []UnitID) ([]GuestSource, error) {
	if ids == nil {
		var out []GuestSource
		for _, u := range units {
			if u.Status != StatusFailed {
				out = append(out, u)
			}
		}
		return out, nil
	}
	var out []GuestSource
	byID := make(map[UnitID]*GuestSource, len(units))
	for i := range units {
		byID[units[i].ID] = &units[i]
	}
	seen := map[UnitID]bool{}
	for _, id := range ids {
		if seen[id] {
			return nil, fmt.Errorf("guest plan: %s chosen twice", id)
		}
		seen[id] = true
		found := byID[id]
		if found == nil {
			return nil, fmt.Errorf("guest plan: no unit %s", id)
		}
		if found.Status == StatusFailed {
			return nil, fmt.Errorf("guest plan: %s is failed: %v", id, found.Reasons)
		}
		out = append(out, *found)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// Matrix is the distance matrix the guest will show: each unit's GPU and NICs under one
// switch (PIX), other units through the host bridge (PHB), or with NUMA through other
// expanders (NODE on one guest node, SYS across).
func (g *Guest) Matrix(nvlinks int) *Matrix {
	var gpus, nics []matrixEntry
	k := 0
	for _, u := range g.Units {
		at := place{host: "pcie.0", numa: 0, switches: []string{u.Upstream.ID}}
		if g.NUMA {
			at.host, at.numa = u.Expander, u.GuestNUMA
		}
		for _, f := range u.Functions {
			switch f.Role {
			case RoleGPU:
				gpus = append(gpus, matrixEntry{name: fmt.Sprintf("GPU%d", len(gpus)), addr: f.Addr, gpu: true, at: at})
			case RoleGPUNIC:
				nics = append(nics, matrixEntry{name: fmt.Sprintf("NIC%d", k), addr: f.Addr, at: at})
				k++
			}
		}
	}
	return buildMatrix(append(gpus, nics...), nvlinks)
}
