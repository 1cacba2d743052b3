package vfiobind

import (
	"fmt"
	"sort"
	"strings"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// Finding kinds.
const (
	// KindGroupShared: a passthrough function's IOMMU group holds a function that is
	// neither in the unit's passthrough set nor a bridge. The unit is refused.
	KindGroupShared = "group-shared"
	// KindNoGroup: a passthrough function has no IOMMU group (no IOMMU, or the kernel
	// did not place it): vfio-pci cannot take it. The unit is refused.
	KindNoGroup = "no-iommu-group"
	// KindSharedFunction: one function is in two units' passthrough sets (a labelling
	// bug upstream). Both units are refused.
	KindSharedFunction = "function-in-two-units"
	// KindIsolationGap: a root or downstream port between a passthrough function and
	// the root complex lacks ACS, or has SV, RR, CR or UF off while advertising it.
	// Linux 6.1 still gives a device below such a port a group of its own, but peer
	// traffic through the port is not forced up to the IOMMU. The unit is degraded.
	KindIsolationGap = "isolation-gap"
	// KindBadUnit: the unit itself is malformed (no GPU, a nil function).
	KindBadUnit = "bad-unit"
	// KindSRIOVActive: a passthrough PF has SR-IOV VFs enabled. Its host driver removes
	// them when it lets the PF go (or cannot let go while one is assigned), so the host
	// or another guest would lose them. The unit is refused; the detail says how to
	// disable SR-IOV first.
	KindSRIOVActive = "sriov-active"
)

// Member is one function of an IOMMU group, with who holds it.
type Member struct {
	Addr   pci.Address `json:"addr"`
	IDs    string      `json:"ids"`
	Driver string      `json:"driver,omitempty"`
	// Owner is "gpuN" (this or another unit's passthrough set), "bridge", or "host"
	// (anything else: management NIC, NVSwitch management, placeholder, unlabeled).
	Owner string `json:"owner"`
}

// Finding is one thing Audit found about a unit.
type Finding struct {
	Kind    string          `json:"kind"`
	Unit    topology.UnitID `json:"unit"`
	Status  topology.Status `json:"status"` // what the finding makes of the unit
	Addr    pci.Address     `json:"addr"`   // the passthrough function, or the port for an isolation gap
	Group   int             `json:"group"`  // -1 when not about a group
	Members []Member        `json:"members,omitempty"`
	Detail  string          `json:"detail"`
}

func (f Finding) String() string {
	s := fmt.Sprintf("%s: %s %s: %s", f.Unit, f.Kind, f.Addr, f.Detail)
	if len(f.Members) > 0 {
		ms := make([]string, len(f.Members))
		for i, m := range f.Members {
			ms[i] = fmt.Sprintf("%s %s (%s)", m.Addr, m.IDs, m.Owner)
		}
		s += "; group " + fmt.Sprint(f.Group) + ": " + strings.Join(ms, ", ")
	}
	return s
}

// Refuses says whether the finding keeps the unit from being bound at all.
func (f Finding) Refuses() bool { return f.Status == topology.StatusFailed }

// Audit checks every unit's passthrough set against the tree's IOMMU groups and the ACS
// of the ports above it, as the tree holds them. It reads only the tree and the units;
// it changes nothing. Findings come in unit order, then address order.
func Audit(tree *pci.Tree, units []*topology.Unit) []Finding {
	return AuditPlanned(tree, units, nil)
}

// AuditPlanned is Audit with the ports in planned judged by the ACS Control they will
// hold once the plan is written, so the audit runs before any write: the decision
// checks what the node will be, not what it was. The groups stay the tree's (the kernel
// forms them at enumeration and never again). A nil map is Audit.
func AuditPlanned(tree *pci.Tree, units []*topology.Unit, planned map[pci.Address]pci.ACSBits) []Finding {
	ctl := func(p *pci.Device) pci.ACSBits {
		if v, ok := planned[p.Addr]; ok {
			return v
		}
		return p.ACS.Ctl
	}
	var out []Finding
	owner := map[pci.Address]topology.UnitID{} // function -> unit
	twice := map[pci.Address][]topology.UnitID{}
	for _, u := range units {
		if u == nil {
			continue
		}
		for _, d := range u.Functions() {
			if d == nil {
				continue
			}
			if prev, ok := owner[d.Addr]; ok && prev != u.ID {
				twice[d.Addr] = append(twice[d.Addr], prev, u.ID)
			}
			owner[d.Addr] = u.ID
		}
	}
	groups := tree.Groups()
	counts := groupCounts{}
	for _, u := range units {
		if u == nil {
			continue
		}
		out = append(out, auditUnit(tree, groups, counts, owner, twice, u, ctl)...)
	}
	return out
}

// maxListed bounds the members a group-shared finding lists.
const maxListed = 16

// groupCount is who holds the functions of one IOMMU group.
type groupCount struct {
	owned  int                     // functions in some unit's passthrough set
	host   int                     // functions in none that are not bridges
	byUnit map[topology.UnitID]int // functions of each unit
}

type groupCounts map[int]*groupCount

func (c groupCounts) of(g int, members []*pci.Device, owner map[pci.Address]topology.UnitID) *groupCount {
	if gc, ok := c[g]; ok {
		return gc
	}
	gc := &groupCount{byUnit: map[topology.UnitID]int{}}
	for _, m := range members {
		switch id, ok := owner[m.Addr]; {
		case ok:
			gc.owned++
			gc.byUnit[id]++
		case !m.IsBridge():
			gc.host++
		}
	}
	c[g] = gc
	return gc
}

func auditUnit(tree *pci.Tree, groups map[int][]*pci.Device, counts groupCounts, owner map[pci.Address]topology.UnitID, twice map[pci.Address][]topology.UnitID, u *topology.Unit,
	ctl func(*pci.Device) pci.ACSBits) []Finding {
	var out []Finding
	if u.GPU == nil {
		out = append(out, Finding{Kind: KindBadUnit, Unit: u.ID, Status: topology.StatusFailed, Group: -1, Detail: "unit has no GPU"})
	}
	fns := unitFunctions(u)
	if len(fns) < len(u.Functions()) {
		out = append(out, Finding{Kind: KindBadUnit, Unit: u.ID, Status: topology.StatusFailed, Group: -1, Detail: "unit lists a nil function"})
	}
	seenGroup := map[int]bool{}
	seenPort := map[pci.Address]bool{}
	for _, ud := range fns {
		// The tree is the truth about groups and ports; the unit may have been labelled
		// from an older scan.
		d := tree.Lookup(ud.Addr)
		if d == nil {
			out = append(out, Finding{Kind: KindBadUnit, Unit: u.ID, Status: topology.StatusFailed, Addr: ud.Addr, Group: -1,
				Detail: "function is not in the scanned tree"})
			continue
		}
		if us, ok := twice[d.Addr]; ok {
			out = append(out, Finding{Kind: KindSharedFunction, Unit: u.ID, Status: topology.StatusFailed, Addr: d.Addr, Group: d.IOMMUGroup,
				Detail: fmt.Sprintf("also in the passthrough set of %v", others(us, u.ID))})
		}
		if vfs := d.VFs(); len(vfs) > 0 {
			out = append(out, Finding{Kind: KindSRIOVActive, Unit: u.ID, Status: topology.StatusFailed, Addr: d.Addr, Group: d.IOMMUGroup,
				Detail: fmt.Sprintf("%d SR-IOV VFs enabled (%s..%s): releasing the PF would remove them; write 0 to its sriov_numvfs first",
					len(vfs), vfs[0], vfs[len(vfs)-1])})
		}
		switch {
		case tree.NoGroups != "":
			// The input carries no groups (a dump): nothing to say about this
			// function's group; the decision says what was not judged.
		case d.IOMMUGroup < 0:
			out = append(out, Finding{Kind: KindNoGroup, Unit: u.ID, Status: topology.StatusFailed, Addr: d.Addr, Group: -1,
				Detail: "no iommu_group link: is the IOMMU on (intel_iommu=on)?"})
		case !seenGroup[d.IOMMUGroup]:
			seenGroup[d.IOMMUGroup] = true
			members := groups[d.IOMMUGroup]
			// Counted once per group (groupCounts), so a node whose functions share one
			// huge group costs the audit its size, not its size squared.
			gc := counts.of(d.IOMMUGroup, members, owner)
			if foreign := gc.owned + gc.host - gc.byUnit[u.ID]; foreign > 0 {
				var listed []Member
				for _, m := range members {
					if len(listed) == maxListed {
						break
					}
					mem := Member{Addr: m.Addr, IDs: m.IDs(), Driver: m.Driver}
					switch id, ok := owner[m.Addr]; {
					case ok:
						mem.Owner = id.String()
					case m.IsBridge():
						// vfio accepts bridges in a group (vfio_dev_driver_allowed): they
						// forward, they do not master DMA for a guest.
						mem.Owner = "bridge"
					default:
						mem.Owner = "host"
					}
					listed = append(listed, mem)
				}
				detail := fmt.Sprintf("iommu group %d holds %d function(s) outside %s", d.IOMMUGroup, foreign, u.ID)
				if len(members) > len(listed) {
					detail += fmt.Sprintf(" (%d of its %d members listed)", len(listed), len(members))
				}
				out = append(out, Finding{Kind: KindGroupShared, Unit: u.ID, Status: topology.StatusFailed, Addr: d.Addr, Group: d.IOMMUGroup,
					Members: listed, Detail: detail})
			}
		}
		for _, p := range d.Ancestors() {
			if seenPort[p.Addr] {
				continue
			}
			if gap := isolationGap(p, ctl); gap != "" {
				seenPort[p.Addr] = true
				out = append(out, Finding{Kind: KindIsolationGap, Unit: u.ID, Status: topology.StatusDegraded, Addr: p.Addr, Group: -1,
					Detail: fmt.Sprintf("%s above %s: %s", portName(p), d.Addr, gap)})
			}
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Addr.Less(out[j].Addr) })
	return out
}

// isolationGap says what a port on the path lacks, or "". It follows the kernel's
// pci_acs_enabled (drivers/pci/pci.c): a conventional bridge, a PCIe-to-PCI bridge, a
// PCI-to-PCIe bridge (its primary side is PCI) and an RCEC never isolate; root and
// downstream ports isolate when their ACS Control has every isolation flag they
// advertise (PCIe 6.0 6.12.1.1); other ports (upstream) are not judged.
func isolationGap(p *pci.Device, ctl func(*pci.Device) pci.ACSBits) string {
	t, express := p.PortType()
	switch {
	case !express && !p.ExpressKnown():
		// Not "conventional": whether it is PCI Express, and has ACS, is unknown.
		why := p.CapsUnknown
		if why == "" {
			why = "config space unreadable"
		}
		return fmt.Sprintf("capability list unreadable (%s): cannot tell whether it is PCI Express or has ACS", why)
	case !express && p.IsBridge():
		return "conventional PCI bridge: no ACS possible"
	case !express:
		return ""
	case t == pci.PortPCIeToPCI:
		return "PCIe-to-PCI bridge: functions behind it share its requester ID"
	case t == pci.PortPCIToPCIe:
		return "PCI-to-PCIe bridge: its primary side is PCI, where ACS does not apply"
	case t == pci.PortRCEC:
		return "root complex event collector: ACS does not apply"
	case !t.IsDownstreamFacing():
		return ""
	case p.ACS == nil && p.ExtCapsUnknown != "":
		return fmt.Sprintf("ACS unknown: extended capability list unreadable (%s)", p.ExtCapsUnknown)
	case p.ACS == nil:
		return "no ACS capability"
	}
	// A flag the port does not advertise is hard-wired: it cannot forward the traffic
	// that flag would redirect (the kernel's pci_acs_flags_enabled reads it the same).
	c := ctl(p)
	want := pci.ACSIsolation & p.ACS.Cap
	if off := want &^ c; off != 0 {
		return fmt.Sprintf("ACSCtl has %s off (ACSCap %s, ACSCtl %s)", off, p.ACS.Cap, c)
	}
	return ""
}

func portName(p *pci.Device) string {
	if t, ok := p.PortType(); ok {
		return t.String() + " " + p.Addr.String()
	}
	return "bridge " + p.Addr.String()
}

func others(ids []topology.UnitID, self topology.UnitID) []topology.UnitID {
	seen := map[topology.UnitID]bool{}
	var out []topology.UnitID
	for _, id := range ids {
		if id != self && !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// unitFunctions is Unit.Functions without nil entries.
func unitFunctions(u *topology.Unit) []*pci.Device {
	var out []*pci.Device
	for _, d := range u.Functions() {
		if d != nil {
			out = append(out, d)
		}
	}
	return out
}
