package topology

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/passage-boot/passage/pci"
)

// FunctionLabel is what the rules made of one function.
type FunctionLabel struct {
	Role   Role   `json:"role"`
	Rule   string `json:"rule,omitempty"`   // the rule that gave the role
	Reason string `json:"reason,omitempty"` // why the function is unlabeled
	Unit   UnitID `json:"unit"`             // -1 when the function belongs to no unit
}

// Labels is the outcome of labelling a tree: a role for every function and the units.
type Labels struct {
	Profile *Profile
	Tree    *pci.Tree
	Units   []*Unit // in unit ID order
	// Problems are findings that do not stop labelling: a passthrough function no GPU
	// claims, a data-direct function without a PF, a slot map naming no GPU.
	Problems []string

	byAddr map[pci.Address]*FunctionLabel
}

// Of returns the label of the function at a (unlabeled, unit -1 when it is unknown).
func (l *Labels) Of(a pci.Address) FunctionLabel {
	if fl, ok := l.byAddr[a]; ok {
		return *fl
	}
	return FunctionLabel{Role: RoleUnlabeled, Reason: "not in the tree", Unit: -1}
}

// RoleOf is the role of the function at a.
func (l *Labels) RoleOf(a pci.Address) Role { return l.Of(a).Role }

// UnitOf is the unit ID of a passthrough function or of a bridge on a unit's path.
func (l *Labels) UnitOf(a pci.Address) (UnitID, bool) {
	u := l.Of(a).Unit
	return u, u >= 0
}

// Unit returns the unit with the given ID, or nil.
func (l *Labels) Unit(id UnitID) *Unit {
	for _, u := range l.Units {
		if u.ID == id {
			return u
		}
	}
	return nil
}

// Label gives every function of tree a role from the profile's rules and groups the
// passthrough functions into units. The error joins what makes the labelling unusable
// (two rules disagreeing, unlabeled functions under a profile that forbids them); the
// Labels are returned complete either way, the faulty functions unlabeled with a reason.
func Label(tree *pci.Tree, p *Profile) (*Labels, error) {
	if tree == nil || p == nil {
		return nil, errors.New("topology: label needs a tree and a profile")
	}
	l := &Labels{Profile: p, Tree: tree, byAddr: map[pci.Address]*FunctionLabel{}}
	var errs []error
	for _, d := range tree.Devices {
		fl := &FunctionLabel{Unit: -1}
		l.byAddr[d.Addr] = fl
		var hits []*Rule
		for i := range p.Rules {
			if p.Rules[i].Match.Matches(d) {
				hits = append(hits, &p.Rules[i])
			}
		}
		if len(hits) == 0 {
			fl.Role = RoleUnlabeled
			fl.Reason = fmt.Sprintf("no rule of profile %s matches %s class %06x", p.Name, d.IDs(), d.Class)
			if p.UnlabeledIsError {
				errs = append(errs, fmt.Errorf("label %s: %s", d.Addr, fl.Reason))
			}
			continue
		}
		// The most specific rule wins, as in a driver's ID table: vendor+device beats
		// vendor+class beats class alone, and position constraints add to it. Only
		// rules equally specific that give different roles conflict.
		best := hits[0]
		for _, h := range hits[1:] {
			if h.Match.Specificity().Beats(best.Match.Specificity()) {
				best = h
			}
		}
		fl.Role, fl.Rule = best.Role, best.Name
		for _, h := range hits {
			if h.Role != best.Role && !best.Match.Specificity().Beats(h.Match.Specificity()) {
				fl.Reason = fmt.Sprintf("rules %q (%s) and %q (%s) both match, equally specific", best.Name, best.Role, h.Name, h.Role)
				fl.Role, fl.Rule = RoleUnlabeled, ""
				errs = append(errs, fmt.Errorf("label %s (%s): %s", d.Addr, d.IDs(), fl.Reason))
				break
			}
		}
	}
	if err := l.group(); err != nil {
		errs = append(errs, err)
	}
	return l, errors.Join(errs...)
}

// group builds one unit per GPU. Every other passthrough function joins the GPU it is
// closest to in the tree (deepest common bridge), so a NIC beside two GPUs under one
// switch is ambiguous and joins neither; a data-direct function joins the unit of the PF
// whose VPD V3 it carries.
func (l *Labels) group() error {
	var gpus []*pci.Device
	for _, d := range l.Tree.Devices {
		if l.RoleOf(d.Addr) == RoleGPU {
			gpus = append(gpus, d)
		}
	}
	ids, err := l.numberUnits(gpus)
	if err != nil {
		return err
	}
	byGPU := map[*pci.Device]*Unit{}
	for i, g := range gpus {
		u := &Unit{ID: UnitID(ids[i]), GPU: g, NUMANode: g.NUMANode, Status: StatusReady}
		byGPU[g] = u
		l.Units = append(l.Units, u)
	}
	sort.Slice(l.Units, func(i, j int) bool { return l.Units[i].ID < l.Units[j].ID })

	var dataDirect []*pci.Device
	for _, d := range l.Tree.Devices {
		role := l.RoleOf(d.Addr)
		switch role {
		case RoleGPUNIC, RoleGPUNVMe:
		case RoleDataDirect:
			dataDirect = append(dataDirect, d)
			continue
		default:
			continue
		}
		g := nearestGPU(d, gpus)
		if g == nil {
			l.Problems = append(l.Problems, fmt.Sprintf("%s (%s): no single nearest GPU; kept out of every unit", d.Addr, role))
			continue
		}
		u := byGPU[g]
		if role == RoleGPUNIC {
			u.NICs = append(u.NICs, d)
		} else {
			u.NVMe = append(u.NVMe, d)
		}
	}
	for _, d := range dataDirect {
		u, why := l.pairDataDirect(d, gpus, byGPU)
		if u == nil {
			l.Problems = append(l.Problems, fmt.Sprintf("%s (data-direct): %s; kept out of every unit", d.Addr, why))
			continue
		}
		u.DataDirect = append(u.DataDirect, d)
	}
	for _, u := range l.Units {
		fns := u.Functions()
		seen := map[pci.Address]bool{}
		for _, f := range fns {
			l.byAddr[f.Addr].Unit = u.ID
			for _, a := range f.Ancestors() {
				if !seen[a.Addr] {
					seen[a.Addr] = true
					u.Bridges = append(u.Bridges, a)
				}
			}
		}
		sort.Slice(u.Bridges, func(i, j int) bool { return u.Bridges[i].Addr.Less(u.Bridges[j].Addr) })
		for _, b := range u.Bridges {
			if fl := l.byAddr[b.Addr]; fl.Unit < 0 {
				fl.Unit = u.ID
			} else if fl.Unit != u.ID {
				l.Problems = append(l.Problems, fmt.Sprintf("%s: bridge on the paths of units %d and %d", b.Addr, fl.Unit, u.ID))
			}
		}
	}
	return nil
}

// pairDataDirect finds the unit of the NIC PF whose VPD V3 the function carries; without
// VPD it falls back to the nearest GPU.
func (l *Labels) pairDataDirect(d *pci.Device, gpus []*pci.Device, byGPU map[*pci.Device]*Unit) (*Unit, string) {
	if v3 := d.VPD.V3(); v3 != "" {
		for _, u := range l.Units {
			for _, n := range u.NICs {
				if n.VPD.V3() == v3 {
					return u, ""
				}
			}
		}
		return nil, fmt.Sprintf("no NIC PF carries VPD V3 %q", v3)
	}
	if g := nearestGPU(d, gpus); g != nil {
		return byGPU[g], ""
	}
	return nil, "no VPD V3 and no single nearest GPU"
}

// numberUnits gives each GPU its unit ID: from the profile's slot map (keyed by the GPU's
// or any ancestor's address), the rest the lowest free IDs in GPU address order.
func (l *Labels) numberUnits(gpus []*pci.Device) ([]int, error) {
	ids := make([]int, len(gpus))
	used := map[int]bool{}
	matched := map[pci.Address]bool{}
	for i, g := range gpus {
		ids[i] = -1
		for _, d := range append([]*pci.Device{g}, g.Ancestors()...) {
			if id, ok := l.Profile.slots[d.Addr]; ok {
				if matched[d.Addr] {
					return nil, fmt.Errorf("profile %s: slot %s holds more than one GPU", l.Profile.Name, d.Addr)
				}
				matched[d.Addr] = true
				ids[i] = id
				used[id] = true
				break
			}
		}
	}
	var missing []string
	for a := range l.Profile.slots {
		if !matched[a] {
			missing = append(missing, a.String())
		}
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		l.Problems = append(l.Problems, fmt.Sprintf("profile %s: slots %s hold no GPU", l.Profile.Name, strings.Join(missing, ", ")))
	}
	next := 0
	for i := range gpus {
		if ids[i] >= 0 {
			continue
		}
		for used[next] {
			next++
		}
		ids[i] = next
		used[next] = true
	}
	return ids, nil
}

// nearestGPU is the GPU sharing the deepest common bridge with d, or nil when none
// shares a bridge or two tie.
func nearestGPU(d *pci.Device, gpus []*pci.Device) *pci.Device {
	depth := map[*pci.Device]int{}
	anc := d.Ancestors()
	for i, a := range anc {
		depth[a] = len(anc) - i // deeper bridge, larger number
	}
	best, bestDepth, tie := (*pci.Device)(nil), 0, false
	for _, g := range gpus {
		dd := 0
		for _, a := range g.Ancestors() {
			if v, ok := depth[a]; ok {
				dd = v
				break
			}
		}
		switch {
		case dd == 0:
		case dd > bestDepth:
			best, bestDepth, tie = g, dd, false
		case dd == bestDepth:
			tie = true
		}
	}
	if tie {
		return nil
	}
	return best
}

// Specificity orders rules that match one function. IDs is the identity a rule names:
// 4 for a device ID (with its vendor), 2 for a vendor, 1 for a class, summed (vendor+device
// 6 or 7, vendor+class 3, class alone 1). Constraints counts the other conditions
// (subsystem IDs, port type, bridge, slot, position in the tree, not); ClassBits the
// class bits compared.
type Specificity struct{ IDs, Constraints, ClassBits int }

// Beats says whether s is strictly more specific than o.
func (s Specificity) Beats(o Specificity) bool {
	if s.IDs != o.IDs {
		return s.IDs > o.IDs
	}
	if s.Constraints != o.Constraints {
		return s.Constraints > o.Constraints
	}
	return s.ClassBits > o.ClassBits
}

// Specificity is how precisely the match names a function (see Specificity).
func (m Match) Specificity() Specificity {
	var s Specificity
	if len(m.Device) > 0 {
		s.IDs += 4
	}
	if len(m.Vendor) > 0 {
		s.IDs += 2
	}
	if m.Class != nil {
		s.IDs++
		mask := uint32(0xffffff)
		if m.ClassMask != nil {
			mask = uint32(*m.ClassMask) & 0xffffff
		}
		for ; mask != 0; mask &= mask - 1 {
			s.ClassBits++
		}
	}
	for _, set := range []bool{len(m.SubsystemVendor) > 0, len(m.SubsystemDevice) > 0, len(m.PortType) > 0, m.Bridge != nil,
		len(m.DeviceNumber) > 0, len(m.Function) > 0, m.Parent != nil, m.Sibling != nil, m.NoSibling != nil,
		m.DepthMin != nil, m.DepthMax != nil, m.Not != nil} {
		if set {
			s.Constraints++
		}
	}
	s.Constraints += len(m.Below) + len(m.NotBelow)
	return s
}
