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

// Unit returns the unit with the given ID, or nil. Units are in ID order.
func (l *Labels) Unit(id UnitID) *Unit {
	i := sort.Search(len(l.Units), func(i int) bool { return l.Units[i].ID >= id })
	if i < len(l.Units) && l.Units[i].ID == id {
		return l.Units[i]
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
			if best.Role.Passthrough() && !h.Role.Passthrough() {
				// Precedence settles which host role or which passthrough role a function
				// gets, never whether it leaves the host: a profile that keeps a function
				// for the host and also passes it through contradicts itself.
				fl.Reason = fmt.Sprintf("rule %q passes it through as %s, rule %q keeps it for the host as %s", best.Name, best.Role, h.Name, h.Role)
				fl.Role, fl.Rule = RoleUnlabeled, ""
				errs = append(errs, fmt.Errorf("label %s (%s): %s", d.Addr, d.IDs(), fl.Reason))
				break
			}
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
	l.numberModules()

	near := indexGPUs(gpus)
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
		g := near.nearestGPU(d)
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
	byV3 := map[string]*Unit{}
	if len(dataDirect) > 0 {
		for _, u := range l.Units {
			for _, n := range u.NICs {
				if v3 := n.VPD.V3(); v3 != "" && byV3[v3] == nil {
					byV3[v3] = u
				}
			}
		}
	}
	for _, d := range dataDirect {
		u, why := l.pairDataDirect(d, near, byGPU, byV3)
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
			for a := f.Parent; a != nil; a = a.Parent {
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
				l.Problems = append(l.Problems, fmt.Sprintf("%s: bridge on the paths of %s and %s", b.Addr, fl.Unit, u.ID))
			}
		}
	}
	return nil
}

// pairDataDirect finds the unit of the NIC PF whose VPD V3 the function carries (byV3:
// each V3 to the first unit, in unit order, with a NIC carrying it); without VPD it
// falls back to the nearest GPU.
func (l *Labels) pairDataDirect(d *pci.Device, near *gpuIndex, byGPU map[*pci.Device]*Unit, byV3 map[string]*Unit) (*Unit, string) {
	if v3 := d.VPD.V3(); v3 != "" {
		if u := byV3[v3]; u != nil {
			return u, ""
		}
		return nil, fmt.Sprintf("no NIC PF carries VPD V3 %q", v3)
	}
	if g := near.nearestGPU(d); g != nil {
		return byGPU[g], ""
	}
	return nil, "no VPD V3 and no single nearest GPU"
}

// numberUnits gives each GPU its unit ID from where the GPU is, so that an ID stays with
// its place across boots and faults (`unbind --unit gpu3` must never reach what was gpu4):
//
//   - The profile's slot map first (keyed by the GPU's or any ancestor's address). Every
//     ID the map names is reserved, whether or not its slot holds a GPU today.
//   - Every other GPU by position. A position is a port on a root bus (a GPU's topmost
//     ancestor; a GPU on a root bus is its own) below which some function has a
//     passthrough role, or some function that no rule labelled could not be read (its
//     Vendor ID reads 0xffff or 0, its header type all ones, or not even the header was
//     read) behind a switch, unless a function below the port is labelled mgmt-nic or
//     nvswitch-mgmt. The positions take the free IDs in address order: one per GPU below
//     (in GPU address order when there are several) and one when none can be read, which
//     then stays unused. A GPU that cannot be read has no unit, and the others keep their
//     IDs: its complex keeps its position through its NICs, or through what is unreadable.
//
// It also refuses a passthrough role on a bridge (a type 1 header), which no profile can
// mean: the bridge is left unlabeled, and the error names it and the rule.
func (l *Labels) numberUnits(gpus []*pci.Device) ([]int, error) {
	var refused []error
	for _, d := range l.Tree.Devices {
		if fl := l.byAddr[d.Addr]; d.IsBridge() && fl.Role.Passthrough() {
			fl.Reason = fmt.Sprintf("rule %q gives the passthrough role %s to a bridge; a bridge never passes through", fl.Rule, fl.Role)
			fl.Role, fl.Rule = RoleUnlabeled, ""
			refused = append(refused, fmt.Errorf("label %s (%s): %s", d.Addr, d.IDs(), fl.Reason))
		}
	}
	if len(refused) > 0 {
		return nil, errors.Join(refused...)
	}

	ids := make([]int, len(gpus))
	used := map[int]bool{}
	for _, id := range l.Profile.slots {
		used[id] = true
	}
	matched := map[pci.Address]bool{}
	for i, g := range gpus {
		ids[i] = -1
		for d := g; d != nil; d = d.Parent {
			if id, ok := l.Profile.slots[d.Addr]; ok {
				if matched[d.Addr] {
					return nil, fmt.Errorf("profile %s: slot %s holds more than one GPU", l.Profile.Name, d.Addr)
				}
				matched[d.Addr] = true
				ids[i] = id
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

	top := func(d *pci.Device) *pci.Device {
		for d.Parent != nil {
			d = d.Parent
		}
		return d
	}
	unreadable := func(d *pci.Device) bool {
		return d.VendorID == 0xffff || d.VendorID == 0 || d.HeaderType == 0x7f ||
			len(d.Problems) > 0 && len(d.Config) < pci.HeaderSize
	}
	type position struct {
		gpus    []int // the GPUs below it the slot map did not number, in address order
		claimed bool  // the slot map names it or a function below it
		// Below it: a passthrough function, an unreadable unlabeled function behind a
		// switch, a management NIC or NVSwitch function.
		unit, unreadable, host bool
	}
	pos := map[*pci.Device]*position{}
	at := func(r *pci.Device) *position {
		p := pos[r]
		if p == nil {
			p = &position{}
			pos[r] = p
		}
		return p
	}
	for a := range l.Profile.slots {
		if d := l.Tree.Lookup(a); d != nil {
			at(top(d)).claimed = true
		}
	}
	for _, d := range l.Tree.Devices {
		switch role := l.byAddr[d.Addr].Role; {
		case role.Passthrough():
			at(top(d)).unit = true
		case role == RoleMgmtNIC || role == RoleNVSwitchMgmt:
			at(top(d)).host = true
		case role == RoleUnlabeled && d.Parent != nil && d.Parent.Parent != nil && unreadable(d):
			at(top(d)).unreadable = true
		}
	}
	for i, g := range gpus {
		if ids[i] < 0 {
			p := at(top(g))
			p.gpus = append(p.gpus, i)
		}
	}
	var order []*pci.Device
	for r, p := range pos {
		if p.unit || p.unreadable && !p.host {
			order = append(order, r)
		}
	}
	sort.Slice(order, func(i, j int) bool { return order[i].Addr.Less(order[j].Addr) })
	next := 0
	take := func() int {
		for used[next] {
			next++
		}
		used[next] = true
		return next
	}
	for _, r := range order {
		p := pos[r]
		if len(p.gpus) == 0 && !p.claimed {
			l.Problems = append(l.Problems, fmt.Sprintf("%s: holds passthrough or unreadable functions but no readable GPU; unit %s is left unused", r.Addr, UnitID(take())))
		}
		for _, i := range p.gpus {
			ids[i] = take()
		}
	}
	return ids, nil
}

// numberModules gives each unit the Module ID the profile's modules map names for its
// GPU: the entry keyed by the GPU's address or by the nearest bridge above it, as slots
// are looked up. An entry above two GPUs gives its ID to neither (two GPUs are never one
// module, and which of them it meant is a guess), and an entry above none is reported:
// both leave Module IDs at 0, unknown, and say so in the labelling's problems.
func (l *Labels) numberModules() {
	if len(l.Profile.modules) == 0 {
		return
	}
	under := map[pci.Address][]*Unit{}
	for _, u := range l.Units {
		for d := u.GPU; d != nil; d = d.Parent {
			if _, ok := l.Profile.modules[d.Addr]; ok {
				under[d.Addr] = append(under[d.Addr], u)
				break
			}
		}
	}
	keys := make([]pci.Address, 0, len(l.Profile.modules))
	for a := range l.Profile.modules {
		keys = append(keys, a)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].Less(keys[j]) })
	var missing []string
	for _, a := range keys {
		id := l.Profile.modules[a]
		switch us := under[a]; len(us) {
		case 0:
			missing = append(missing, a.String())
		case 1:
			us[0].ModuleID = id
			us[0].ModuleSource = fmt.Sprintf("profile %s: modules[%s]", l.Profile.Name, a)
		default:
			var names []string
			for _, u := range us {
				names = append(names, u.ID.String())
			}
			l.Problems = append(l.Problems, fmt.Sprintf("profile %s: modules %s (Module ID %d) is above the GPUs of %s: none of them is given it",
				l.Profile.Name, a, id, strings.Join(names, ", ")))
		}
	}
	if len(missing) > 0 {
		l.Problems = append(l.Problems, fmt.Sprintf("profile %s: modules %s hold no GPU", l.Profile.Name, strings.Join(missing, ", ")))
	}
}

// gpuIndex answers nearestGPU for every function of a tree in time linear in the tree:
// it knows, for each bridge, whether no GPU, one GPU or several sit below it, and
// remembers each bridge's answer. Walking every GPU's path for every function instead
// made labelling a dump of 20 000 GPUs quadratic.
type gpuIndex struct {
	below map[*pci.Device]gpusBelow
	near  map[*pci.Device]*pci.Device // bridge -> nearestGPU of a function directly below it
	path  []*pci.Device               // scratch
}

// gpusBelow counts the GPUs below a bridge up to two (two means two or more); first is
// the one when there is one.
type gpusBelow struct {
	n     int
	first *pci.Device
}

func indexGPUs(gpus []*pci.Device) *gpuIndex {
	x := &gpuIndex{below: map[*pci.Device]gpusBelow{}, near: map[*pci.Device]*pci.Device{}}
	for _, g := range gpus {
		for a := g.Parent; a != nil; a = a.Parent {
			c := x.below[a]
			if c.n >= 2 {
				break // and so has every bridge above it: each bridge is counted at most twice
			}
			if c.n == 0 {
				c.first = g
			}
			c.n++
			x.below[a] = c
		}
	}
	return x
}

// nearestGPU is the GPU sharing the deepest common bridge with d, or nil when none
// shares a bridge or two tie: the GPU below d's nearest bridge that has any GPU below
// it, when that bridge has only one.
func (x *gpuIndex) nearestGPU(d *pci.Device) *pci.Device {
	x.path = x.path[:0]
	var g *pci.Device
	for a := d.Parent; a != nil; a = a.Parent {
		if r, ok := x.near[a]; ok {
			g = r
			break
		}
		x.path = append(x.path, a)
		if c := x.below[a]; c.n > 0 {
			if c.n == 1 {
				g = c.first
			}
			break
		}
	}
	for _, a := range x.path {
		x.near[a] = g
	}
	return g
}

// Specificity orders rules that match one function. IDs is the identity a rule names:
// 4 for a device ID (with its vendor), 2 for a vendor, 1 for a class, summed (vendor+device
// 6 or 7, vendor+class 3, class alone 1). Constraints counts the other conditions
// (subsystem IDs, port type, bridge, slot, position in the tree, not, vpd); ClassBits
// the class bits compared.
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
		m.DepthMin != nil, m.DepthMax != nil, m.Not != nil, m.VPD != nil} {
		if set {
			s.Constraints++
		}
	}
	s.Constraints += len(m.Below) + len(m.NotBelow)
	return s
}
