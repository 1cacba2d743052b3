// Package hook is passage's KubeVirt hook sidecar: on OnDefineDomain it moves a VMI's
// passage unit functions (DRA host devices) behind one virtual PCIe switch per unit, laid
// out by topology's guest plan (the plan passage render writes), read from the node's
// verified manifest.
package hook

import (
	"encoding/xml"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// Config says which manifest to trust, as passage-dra's plugin does.
type Config struct {
	Manifest string // the node's manifest (DSSE envelope)
	Keys     string // public key file or enrolled key directory (passage verify --pub)
	TPM      bool   // the keys are TPM keys
	// NodeUUID is this node's DMI product UUID: a manifest of another node is refused
	// even when a fleet key directory verifies it.
	NodeUUID      string
	MinGeneration uint64
	// NCCLDisk, when set, is the path (as QEMU opens it) of the guest's NCCL disk
	// image: the returned domain carries a read-only CD-ROM on it (attachNCCLDisk), and
	// the caller writes NCCLImage(Result.NCCL) there before handing the domain back.
	NCCLDisk string
	// HostPhysBits is the node's physical address width (HostPhysBits): a guest whose
	// CPU mode gives a width that cannot map its units' BARs is refused (largebar.go).
	// 0 does not check.
	HostPhysBits int
}

// verify reads the manifest through manifest.Keyring.VerifyFile, the path passage
// verify, render and passage-dra share, and holds it to this node.
func (c Config) verify() (*manifest.Manifest, error) {
	kr, err := manifest.LoadKeyring(c.Keys, c.TPM)
	if err != nil {
		return nil, err
	}
	v, _, err := kr.VerifyFile(c.Manifest, manifest.VerifyOptions{MinGeneration: c.MinGeneration})
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w", c.Manifest, err)
	}
	if c.NodeUUID == "" || !strings.EqualFold(v.Manifest.Node.DMIUUID, c.NodeUUID) {
		return nil, fmt.Errorf("manifest %s: %w: this node is dmi_uuid %q, the manifest says %q", c.Manifest, manifest.ErrWrongNode,
			manifest.Printable(c.NodeUUID), manifest.Printable(v.Manifest.Node.DMIUUID))
	}
	return v.Manifest, nil
}

// Result is one OnDefineDomain's outcome.
type Result struct {
	Domain []byte // the domain to hand back (the input itself when nothing changed)
	Guest  *topology.Guest
	// NCCL is the guest's NCCL topology file, its bus IDs read from the returned domain
	// as firmware numbers its buses (nil without passage devices).
	NCCL []byte
}

// DefineDomain rebuilds the passage part of a domain's PCIe tree. A domain without PCI
// host devices is returned as it came; one with a function of a passage unit is
// refused, naming the function, when the manifest does not verify, names another node,
// or the unit is not ready, or when the domain holds part of a unit only.
func (c Config) DefineDomain(in []byte) (*Result, error) {
	d, err := parseDomain(in)
	if err != nil {
		return nil, err
	}
	if d.Devices == nil {
		return &Result{Domain: in}, nil
	}
	var pciHost []int
	for i, h := range d.Devices.Hostdevs {
		if h.SubsysPCI != nil && h.SubsysPCI.Source != nil && h.SubsysPCI.Source.Address != nil {
			pciHost = append(pciHost, i)
		}
	}
	if len(pciHost) == 0 {
		return &Result{Domain: in}, nil
	}
	m, err := c.verify()
	if err != nil {
		// Without a verified manifest no hostdev can be told apart from a unit's
		// function: every PCI host device is refused.
		var names []string
		for _, i := range pciHost {
			names = append(names, sourceOf(d.Devices.Hostdevs[i]).String())
		}
		return nil, fmt.Errorf("hostdev %s: may be a passage unit function and the manifest does not verify: %w", strings.Join(names, ", "), err)
	}
	sources, err := hypervisor.Sources(m)
	if err != nil {
		return nil, err
	}
	type owner struct {
		unit topology.UnitID
		role topology.Role
	}
	owners := map[pci.Address]owner{}
	for _, s := range sources {
		for _, f := range s.Functions {
			owners[f.Addr] = owner{s.ID, f.Role}
		}
	}
	// The domain's passage hostdevs, by host address.
	mine := map[pci.Address]int{}
	present := map[topology.UnitID]int{}
	for _, i := range pciHost {
		a := sourceOf(d.Devices.Hostdevs[i])
		if o, ok := owners[a]; ok {
			mine[a] = i
			present[o.unit]++
		}
	}
	if len(mine) == 0 {
		return &Result{Domain: in}, nil
	}
	var ids []topology.UnitID
	for id := range present {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	for _, s := range sources {
		n, ok := present[s.ID]
		if !ok {
			continue
		}
		if s.Status != topology.StatusReady {
			return nil, fmt.Errorf("hostdev %s (%s %s): %s is %s in the manifest: %s", s.Functions[0].Addr, s.ID, s.Functions[0].Role,
				s.ID, s.Status, strings.Join(s.Reasons, "; "))
		}
		if n != len(s.Functions) {
			for _, f := range s.Functions {
				if _, ok := mine[f.Addr]; !ok {
					return nil, fmt.Errorf("unit %s: the domain holds %d of its %d functions, not %s (%s): a unit goes into a guest whole",
						s.ID, n, len(s.Functions), f.Addr, f.Role)
				}
			}
		}
	}
	t := newTree(d.Devices)
	if err := t.checkSwitches(func(a pci.Address) (topology.UnitID, bool) {
		o, ok := owners[a]
		return o.unit, ok
	}); err != nil {
		return nil, err
	}
	isMine := func(h libvirtxml.DomainHostdev) bool { _, ok := mine[sourceOf(h)]; return ok }
	if err := t.strip(isMine); err != nil {
		return nil, err
	}
	place, err := t.placement(d)
	if err != nil {
		return nil, err
	}
	// Admission is the manifest's verdict, as render reads it: every unit here is ready.
	if _, _, err := topology.Admit(sources, ids, false); err != nil {
		return nil, err
	}
	g, err := topology.PlanGuest(sources, topology.GuestOptions{Units: ids, NUMA: place.GuestNodes != nil, In: place})
	if err != nil {
		return nil, err
	}
	// Apply: the plan's controllers, the kept expanders' new bus numbers, and each
	// hostdev's address on its downstream port; nothing else of the domain changes.
	d.Devices.Controllers = append(d.Devices.Controllers, g.LibvirtControllers()...)
	for _, x := range g.Expanders {
		if !x.Kept {
			continue
		}
		c := t.pciController(x.Index)
		if c.PCI == nil {
			c.PCI = &libvirtxml.DomainControllerPCI{}
		}
		if c.PCI.Target == nil {
			c.PCI.Target = &libvirtxml.DomainControllerPCITarget{}
		}
		c.PCI.Target.BusNr = ptr(uint(x.BusNr))
	}
	for _, u := range g.Units {
		for _, f := range u.Functions {
			h := &d.Devices.Hostdevs[mine[f.HostID]]
			h.Address = f.LibvirtAddress()
		}
	}
	if err := checkGuestWidth(&d, g, c.HostPhysBits); err != nil {
		return nil, err
	}
	if c.NCCLDisk != "" {
		if err := attachNCCLDisk(d.Devices, c.NCCLDisk); err != nil {
			return nil, err
		}
	}
	out, err := d.Marshal()
	if err != nil {
		return nil, fmt.Errorf("domain xml: %w", err)
	}
	nccl, err := NCCL(g, []byte(out))
	if err != nil {
		return nil, err
	}
	return &Result{Domain: []byte(out), Guest: g, NCCL: nccl}, nil
}

func ptr[T any](v T) *T { return &v }

// parseDomain reads the domain virt-launcher sends. It is KubeVirt's api.DomainSpec
// written out, so it is read as one first: KubeVirt's DRA host devices carry no mode,
// which libvirt defaults to subsystem and libvirtxml requires; nothing virt-launcher
// keeps is lost on the way, as virt-launcher keeps only what DomainSpec holds.
func parseDomain(in []byte) (libvirtxml.Domain, error) {
	var d libvirtxml.Domain
	var spec api.DomainSpec
	if err := xml.Unmarshal(in, &spec); err != nil {
		return d, fmt.Errorf("domain xml: %w", err)
	}
	for i := range spec.Devices.HostDevices {
		if spec.Devices.HostDevices[i].Mode == "" {
			spec.Devices.HostDevices[i].Mode = "subsystem"
		}
	}
	b, err := xml.Marshal(spec)
	if err != nil {
		return d, fmt.Errorf("domain xml: %w", err)
	}
	if err := d.Unmarshal(string(b)); err != nil {
		return d, fmt.Errorf("domain xml: %w", err)
	}
	return d, nil
}

func sourceOf(h libvirtxml.DomainHostdev) pci.Address {
	a := h.SubsysPCI.Source.Address
	v := func(p *uint) uint {
		if p == nil {
			return 0
		}
		return *p
	}
	return pci.Address{Domain: uint16(v(a.Domain)), Bus: uint8(v(a.Bus)), Device: uint8(v(a.Slot)), Function: uint8(v(a.Function))}
}

// tree is the domain's PCI controllers by index and what plugs into each bus.
type tree struct {
	devs *libvirtxml.DomainDeviceList
}

func newTree(devs *libvirtxml.DomainDeviceList) *tree { return &tree{devs: devs} }

func (t *tree) pciController(index int) *libvirtxml.DomainController {
	for i := range t.devs.Controllers {
		c := &t.devs.Controllers[i]
		if c.Type == "pci" && c.Index != nil && int(*c.Index) == index {
			return c
		}
	}
	return nil
}

// pciBus is the bus an address plugs into (-1: no PCI address).
func pciBus(a *libvirtxml.DomainAddress) int {
	if a == nil || a.PCI == nil || a.PCI.Bus == nil {
		return -1
	}
	return int(*a.PCI.Bus)
}

func pciSlot(a *libvirtxml.DomainAddress) (int, int) {
	if a == nil || a.PCI == nil {
		return 0, 0
	}
	s, f := 0, 0
	if a.PCI.Slot != nil {
		s = int(*a.PCI.Slot)
	}
	if a.PCI.Function != nil {
		f = int(*a.PCI.Function)
	}
	return s, f
}

// child is one thing plugged into a bus: a controller (index >= 0) or another device.
type child struct {
	index      int // controller index, -1 for a device
	hostdev    int // index into Hostdevs, -1 otherwise
	slot, fn   int
	controller *libvirtxml.DomainController
	addr       **libvirtxml.DomainAddress // another device's address
}

// children lists what plugs into bus, in slot/function order (firmware's order).
func (t *tree) children(bus int) []child {
	var out []child
	for i := range t.devs.Controllers {
		c := &t.devs.Controllers[i]
		if c.Type == "pci" && c.Index != nil && pciBus(c.Address) == bus && !(bus == 0 && *c.Index == 0) {
			s, f := pciSlot(c.Address)
			out = append(out, child{index: int(*c.Index), hostdev: -1, slot: s, fn: f, controller: c})
		}
	}
	for i, h := range t.devs.Hostdevs {
		if pciBus(h.Address) == bus {
			s, f := pciSlot(h.Address)
			out = append(out, child{index: -1, hostdev: i, slot: s, fn: f})
		}
	}
	// Every other device with a PCI address counts as a device on its bus.
	for _, a := range otherAddresses(t.devs) {
		if pciBus(*a) == bus {
			s, f := pciSlot(*a)
			out = append(out, child{index: -1, hostdev: -1, slot: s, fn: f, addr: a})
		}
	}
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].slot != out[j].slot {
			return out[i].slot < out[j].slot
		}
		return out[i].fn < out[j].fn
	})
	return out
}

// otherAddresses are the PCI addresses of the devices that are neither controllers nor
// host devices: they keep their places, and their buses are not the plan's to remove.
func otherAddresses(d *libvirtxml.DomainDeviceList) []**libvirtxml.DomainAddress {
	var out []**libvirtxml.DomainAddress
	for i := range d.Disks {
		out = append(out, &d.Disks[i].Address)
	}
	for i := range d.Interfaces {
		out = append(out, &d.Interfaces[i].Address)
	}
	for i := range d.Videos {
		out = append(out, &d.Videos[i].Address)
	}
	for i := range d.Inputs {
		out = append(out, &d.Inputs[i].Address)
	}
	for i := range d.Sounds {
		out = append(out, &d.Sounds[i].Address)
	}
	for i := range d.Filesystems {
		out = append(out, &d.Filesystems[i].Address)
	}
	for i := range d.Channels {
		out = append(out, &d.Channels[i].Address)
	}
	for i := range d.Consoles {
		out = append(out, &d.Consoles[i].Address)
	}
	for i := range d.Serials {
		out = append(out, &d.Serials[i].Address)
	}
	for i := range d.RNGs {
		out = append(out, &d.RNGs[i].Address)
	}
	for i := range d.Watchdogs {
		out = append(out, &d.Watchdogs[i].Address)
	}
	for i := range d.Controllers {
		if d.Controllers[i].Type != "pci" {
			out = append(out, &d.Controllers[i].Address)
		}
	}
	if d.MemBalloon != nil {
		out = append(out, &d.MemBalloon.Address)
	}
	if d.VSock != nil {
		out = append(out, &d.VSock.Address)
	}
	return out
}

func own(c libvirtxml.DomainController) bool {
	return c.Alias != nil && strings.HasPrefix(c.Alias.Name, topology.AliasPrefix)
}

func isSwitchPort(model string) bool {
	return model == "pcie-switch-upstream-port" || model == "pcie-switch-downstream-port"
}

// checkSwitches refuses a switch that holds functions of two units: the plan never
// writes one, and a tree that has one was not laid out by it.
func (t *tree) checkSwitches(unitOf func(pci.Address) (topology.UnitID, bool)) error {
	for _, c := range t.devs.Controllers {
		if c.Type != "pci" || c.Model != "pcie-switch-upstream-port" || c.Index == nil || own(c) {
			// The hook's own switches are laid out again whatever libvirt put on them.
			continue
		}
		first, firstAt := topology.UnitID(0), pci.Address{}
		seen := false
		var walk func(bus int) error
		walk = func(bus int) error {
			for _, ch := range t.children(bus) {
				if ch.index >= 0 {
					if err := walk(ch.index); err != nil {
						return err
					}
					continue
				}
				if ch.hostdev < 0 {
					continue
				}
				h := t.devs.Hostdevs[ch.hostdev]
				if h.SubsysPCI == nil || h.SubsysPCI.Source == nil || h.SubsysPCI.Source.Address == nil {
					continue
				}
				a := sourceOf(h)
				u, ok := unitOf(a)
				if !ok {
					continue
				}
				if !seen {
					first, firstAt, seen = u, a, true
				} else if u != first {
					return fmt.Errorf("hostdev %s (%s) is in the switch of controller %d with %s (%s): a switch holds one unit's functions",
						a, u, *c.Index, firstAt, first)
				}
			}
			return nil
		}
		if err := walk(int(*c.Index)); err != nil {
			return err
		}
	}
	return nil
}

// strip removes what an earlier call of the hook, libvirt or KubeVirt built for the
// passage hostdevs: the hook's own controllers (AliasPrefix) and every root port or
// switch port whose subtree holds passage hostdevs and nothing else. Bare root ports
// (hotplug slots) and expanders KubeVirt made stay. A device that is not the plan's
// found below a controller to be removed is an error naming it.
func (t *tree) strip(isMine func(libvirtxml.DomainHostdev) bool) error {
	remove := map[int]bool{}
	// holds: 1 = a passage hostdev below, 2 = anything else below.
	var holds func(bus int) int
	holds = func(bus int) int {
		h := 0
		for _, ch := range t.children(bus) {
			switch {
			case ch.index >= 0:
				h |= holds(ch.index)
			case ch.hostdev >= 0 && isMine(t.devs.Hostdevs[ch.hostdev]):
				h |= 1
			default:
				h |= 2
			}
		}
		return h
	}
	for _, c := range t.devs.Controllers {
		if c.Type != "pci" || c.Index == nil {
			continue
		}
		ours := own(c)
		h := holds(int(*c.Index))
		switch {
		case ours:
			// libvirt places devices without an address on any free port, the hook's
			// empty earlier ones too: those devices lose that place and libvirt gives
			// them another when the domain is defined.
			t.unplace(int(*c.Index), isMine)
			remove[int(*c.Index)] = true
		case (c.Model == "pcie-root-port" || isSwitchPort(c.Model)) && h == 1:
			remove[int(*c.Index)] = true
		case isSwitchPort(c.Model) && h == 0:
			// An empty switch port is an earlier layout's: neither libvirt nor KubeVirt
			// adds one.
			remove[int(*c.Index)] = true
		}
	}
	// A removed switch leaves its root port empty: that root port was the layout's too.
	for changed := true; changed; {
		changed = false
		for _, c := range t.devs.Controllers {
			if c.Type != "pci" || c.Index == nil || remove[int(*c.Index)] || c.Model != "pcie-root-port" {
				continue
			}
			kids := t.children(int(*c.Index))
			if len(kids) == 0 {
				continue
			}
			all := true
			for _, k := range kids {
				if k.index < 0 || !remove[k.index] {
					all = false
				}
			}
			if all {
				remove[int(*c.Index)] = true
				changed = true
			}
		}
	}
	var keep []libvirtxml.DomainController
	for _, c := range t.devs.Controllers {
		if c.Type == "pci" && c.Index != nil && remove[int(*c.Index)] {
			continue
		}
		keep = append(keep, c)
	}
	t.devs.Controllers = keep
	for i := range t.devs.Hostdevs {
		if isMine(t.devs.Hostdevs[i]) {
			t.devs.Hostdevs[i].Address = nil
		}
	}
	return nil
}

// unplace drops the guest address of every device below bus that is not a passage
// unit function.
func (t *tree) unplace(bus int, isMine func(libvirtxml.DomainHostdev) bool) {
	for _, ch := range t.children(bus) {
		switch {
		case ch.index >= 0:
			t.unplace(ch.index, isMine)
		case ch.hostdev >= 0 && !isMine(t.devs.Hostdevs[ch.hostdev]):
			t.devs.Hostdevs[ch.hostdev].Address = nil
		case ch.addr != nil:
			*ch.addr = nil
		}
	}
}

// placement reads what the domain leaves to the plan: the first free controller index,
// its guest NUMA cells and the host nodes they are bound to, and its expanders.
func (t *tree) placement(d libvirtxml.Domain) (*topology.Placement, error) {
	p := &topology.Placement{FirstIndex: 1}
	used := map[int]bool{}
	for _, c := range t.devs.Controllers {
		if c.Type == "pci" && c.Index != nil {
			used[int(*c.Index)] = true
			if int(*c.Index)+1 > p.FirstIndex {
				p.FirstIndex = int(*c.Index) + 1
			}
		}
	}
	for i := 1; i < p.FirstIndex; i++ {
		if !used[i] {
			p.Free = append(p.Free, i)
		}
	}
	if d.CPU != nil && d.CPU.Numa != nil && len(d.CPU.Numa.Cell) > 0 {
		p.GuestNodes = map[int]int{}
		if d.NUMATune != nil {
			for _, mn := range d.NUMATune.MemNodes {
				h, err := strconv.Atoi(mn.Nodeset)
				if err != nil {
					// A cell bound to several host nodes stands for none of them.
					continue
				}
				if _, dup := p.GuestNodes[h]; !dup {
					p.GuestNodes[h] = int(mn.CellID)
				}
			}
		}
	}
	var reserved func(bus int) int
	reserved = func(bus int) int {
		n := 0
		for _, ch := range t.children(bus) {
			if ch.index >= 0 {
				n += 1 + reserved(ch.index)
			}
		}
		return n
	}
	for _, c := range t.devs.Controllers {
		if c.Type != "pci" || c.Index == nil || c.Model != "pcie-expander-bus" {
			continue
		}
		e := topology.PlacedExpander{Index: int(*c.Index), GuestNUMA: -1}
		if c.PCI != nil && c.PCI.Target != nil && c.PCI.Target.NUMANode != nil {
			e.GuestNUMA = int(*c.PCI.Target.NUMANode)
		}
		for _, ch := range t.children(e.Index) {
			if ch.slot+1 > e.NextSlot {
				e.NextSlot = ch.slot + 1
			}
		}
		e.Reserved = reserved(e.Index)
		p.Expanders = append(p.Expanders, e)
	}
	return p, nil
}

// GuestBuses numbers the buses of a domain as the guest's firmware does: pcie.0 is bus
// 0 and each bridge on it takes the next number, depth first in slot order; each
// expander's root bus is its busNr and the bridges below it follow the same way. It
// returns the guest bus each PCI controller index provides.
func GuestBuses(domain []byte) (map[int]int, error) {
	d, err := parseDomain(domain)
	if err != nil {
		return nil, err
	}
	if d.Devices == nil {
		return nil, errors.New("domain xml: no devices")
	}
	t := newTree(d.Devices)
	buses := map[int]int{0: 0}
	var walk func(index, bus int, next *int)
	walk = func(index, bus int, next *int) {
		buses[index] = bus
		for _, ch := range t.children(index) {
			if ch.index < 0 || ch.controller.Model == "pcie-expander-bus" {
				continue
			}
			n := *next
			*next = n + 1
			walk(ch.index, n, next)
		}
	}
	next := 1
	walk(0, 0, &next)
	for _, c := range d.Devices.Controllers {
		if c.Type != "pci" || c.Index == nil || c.Model != "pcie-expander-bus" {
			continue
		}
		if c.PCI == nil || c.PCI.Target == nil || c.PCI.Target.BusNr == nil {
			return nil, fmt.Errorf("controller %d: pcie-expander-bus without busNr", *c.Index)
		}
		nr := int(*c.PCI.Target.BusNr)
		n := nr + 1
		walk(int(*c.Index), nr, &n)
	}
	return buses, nil
}

// NCCL renders the guest's NCCL topology file with each bus ID read from domain (the
// one handed back) as the guest will number it; a plan whose predicted bus IDs the
// domain does not give is an error, not a file with the wrong ones.
func NCCL(g *topology.Guest, domain []byte) ([]byte, error) {
	buses, err := GuestBuses(domain)
	if err != nil {
		return nil, err
	}
	for _, u := range g.Units {
		for _, f := range u.Functions {
			b, ok := buses[f.Port.Index]
			if !ok || b != int(f.Addr.Bus) {
				return nil, fmt.Errorf("function %s (%s): the domain puts it on guest bus %#x, the plan on %#x", f.HostID, u.Unit, b, f.Addr.Bus)
			}
		}
		if b := buses[u.RootPort.Index]; b != int(u.Upstream.Addr.Bus) {
			return nil, fmt.Errorf("unit %s: the domain numbers its switch bus %#x, the plan %#x", u.Unit, b, u.Upstream.Addr.Bus)
		}
	}
	return g.NCCLTopology()
}
