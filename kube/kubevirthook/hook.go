// Package hook is passage's KubeVirt hook sidecar: on OnDefineDomain it moves a VMI's
// passage unit functions (DRA host devices) behind one virtual PCIe switch per unit, laid
// out by topology's guest plan (the plan passage render writes), read from the node's
// verified manifest.
package kubevirthook

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
	// NodeUUID is this node's DMI product UUID and BootID its kernel's boot ID: a
	// manifest of another node or boot is refused even when a fleet key directory
	// verifies it. At least one is set; each set one is checked.
	NodeUUID      string
	BootID        string
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
	if c.NodeUUID == "" && c.BootID == "" {
		return nil, fmt.Errorf("manifest %s: %w: no node identity (node UUID, boot ID) to hold it to", c.Manifest, manifest.ErrWrongNode)
	}
	v, _, err := kr.VerifyFile(c.Manifest, manifest.VerifyOptions{MinGeneration: c.MinGeneration, BootID: c.BootID})
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w", c.Manifest, err)
	}
	if c.NodeUUID != "" && !strings.EqualFold(v.Manifest.Node.DMIUUID, c.NodeUUID) {
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
	if len(in) > MaxDomain {
		return nil, fmt.Errorf("domain xml: %d bytes, over the %d bytes virt-launcher sends", len(in), MaxDomain)
	}
	d, err := parseDomain(in)
	if err != nil {
		return nil, err
	}
	if d.Devices == nil {
		return &Result{Domain: in}, nil
	}
	// The PCI functions among the hostdevs, by hostdev index; every other hostdev (USB,
	// mdev, SCSI) is no unit's function and stays as it is.
	hostAt := map[int]pci.Address{}
	var pciHost []int
	for i, h := range d.Devices.Hostdevs {
		a, ok, err := hostPCI(h)
		if err != nil {
			return nil, err
		}
		if ok {
			hostAt[i] = a
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
			names = append(names, hostAt[i].String())
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
	// The domain's passage hostdevs, by host address: each once, since a function
	// passed through twice is not a unit's function twice over (the whole-unit check
	// below counts functions, not entries).
	mine := map[pci.Address]int{}
	present := map[topology.UnitID]int{}
	for _, i := range pciHost {
		a := hostAt[i]
		o, ok := owners[a]
		if !ok {
			continue
		}
		if j, dup := mine[a]; dup {
			return nil, fmt.Errorf("hostdev %s (%s %s): listed twice (%s and %s): a function goes into a guest once",
				a, o.unit, o.role, hostdevName(d.Devices.Hostdevs[j]), hostdevName(d.Devices.Hostdevs[i]))
		}
		mine[a] = i
		present[o.unit]++
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
		for _, f := range s.Functions {
			if _, ok := mine[f.Addr]; !ok {
				return nil, fmt.Errorf("unit %s: the domain holds %d of its %d functions, not %s (%s): a unit goes into a guest whole",
					s.ID, n, len(s.Functions), f.Addr, f.Role)
			}
		}
	}
	t, err := newTree(d.Devices)
	if err != nil {
		return nil, err
	}
	if err := t.checkSwitches(func(i int) (topology.UnitID, pci.Address, bool) {
		a, ok := hostAt[i]
		if !ok {
			return 0, a, false
		}
		o, ok := owners[a]
		return o.unit, a, ok
	}); err != nil {
		return nil, err
	}
	isMine := func(i int) bool {
		a, ok := hostAt[i]
		if !ok {
			return false
		}
		j, ok := mine[a]
		return ok && j == i
	}
	if t, err = t.strip(isMine); err != nil {
		return nil, err
	}
	place, err := t.placement(d, len(ids))
	if err != nil {
		return nil, err
	}
	place.OtherPorts = t.otherPorts()
	// Admission is the manifest's verdict, as render reads it: every unit here is ready.
	if _, _, err := topology.Admit(sources, ids, false); err != nil {
		return nil, err
	}
	g, err := topology.PlanGuest(sources, topology.GuestOptions{Units: ids, NUMA: place.GuestNodes != nil, In: place})
	if err != nil {
		return nil, err
	}
	// Apply: the kept expanders' new bus numbers (before the append below moves the
	// controllers the tree points at), the plan's controllers, and each hostdev's
	// address on its downstream port; nothing else of the domain changes.
	for _, x := range g.Expanders {
		if !x.Kept {
			continue
		}
		e := t.pciController(x.Index)
		if e == nil {
			return nil, fmt.Errorf("controller pci %d: the plan keeps an expander the domain does not have", x.Index)
		}
		if e.PCI == nil {
			e.PCI = &libvirtxml.DomainControllerPCI{}
		}
		if e.PCI.Target == nil {
			e.PCI.Target = &libvirtxml.DomainControllerPCITarget{}
		}
		e.PCI.Target.BusNr = ptr(uint(x.BusNr))
	}
	added := g.LibvirtControllers()
	for _, a := range added {
		if a.Index != nil && *a.Index > maxPCIIndex {
			return nil, fmt.Errorf("controller pci %d: the domain's controllers leave the plan no index within libvirt's %d", *a.Index, maxPCIIndex)
		}
	}
	d.Devices.Controllers = append(d.Devices.Controllers, added...)
	if err := addressRootPorts(d.Devices, g); err != nil {
		return nil, err
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
	// The buses of the domain handed back, numbered from d itself rather than from out
	// read again: every part GuestBuses reads (PCI controllers' index, model, address,
	// busNr) is one virt-launcher's DomainSpec keeps (KUBEVIRT.md), and a third and
	// fourth XML pass were a third of a large domain's time.
	buses, err := guestBuses(d.Devices)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(ids))
	for i, id := range ids {
		names[i] = id.String()
	}
	// The NCCL file says the GPUs share NVLink when the units are one partition of the
	// manifest's layout, the only guest Fabric Manager joins by NVLink.
	nv, err := hypervisor.GuestNVLinks(m, names)
	if err != nil {
		return nil, err
	}
	nccl, err := ncclOf(g, buses, topology.NCCLOptions{NVLinks: nv})
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

// The bounds a domain's PCI tree is read within: libvirt's own
// (src/conf/domain_validate.c, virDomainControllerDefValidate: "PCI controller index %d
// too high, maximum is 255", busNr 1-254) and PCI's (an address is a 16-bit domain, an
// 8-bit bus, a 5-bit device and a 3-bit function). libvirt refuses a domain outside
// them; the hook refuses it first, so that no number it reads sizes a loop or a table.
const (
	maxPCIIndex = 255
	maxBusNr    = 254
	maxSlot     = 0x1f
	// maxNUMANode is Linux's MAX_NUMNODES at its largest (NODES_SHIFT 10).
	maxNUMANode = 1<<10 - 1
	// MaxDomain bounds the domain XML: virt-launcher's gRPC client sends at most gRPC's
	// default 4 MiB message, and every walk of the domain is linear in its size.
	MaxDomain = 4 << 20
)

// pciFields reads an address's domain, bus, slot and function within PCI's ranges.
func pciFields(a *libvirtxml.DomainAddressPCI) (pci.Address, error) {
	v := func(p *uint) uint {
		if p == nil {
			return 0
		}
		return *p
	}
	d, b, s, f := v(a.Domain), v(a.Bus), v(a.Slot), v(a.Function)
	switch {
	case d > 0xffff:
		return pci.Address{}, fmt.Errorf("domain %#x is above PCI's 0xffff", d)
	case b > 0xff:
		return pci.Address{}, fmt.Errorf("bus %#x is above PCI's 0xff", b)
	case s > 0x1f:
		return pci.Address{}, fmt.Errorf("slot %#x is above PCI's 0x1f", s)
	case f > 7:
		return pci.Address{}, fmt.Errorf("function %#x is above PCI's 7", f)
	}
	return pci.Address{Domain: uint16(d), Bus: uint8(b), Device: uint8(s), Function: uint8(f)}, nil
}

// hostPCI is the host function a hostdev passes through: ok is false for a device that
// is not a PCI function (USB, mdev, SCSI, a PCI hostdev without a source address),
// which the hook leaves as it is.
func hostPCI(h libvirtxml.DomainHostdev) (a pci.Address, ok bool, err error) {
	if h.SubsysPCI == nil || h.SubsysPCI.Source == nil || h.SubsysPCI.Source.Address == nil {
		return pci.Address{}, false, nil
	}
	a, err = pciFields(h.SubsysPCI.Source.Address)
	if err != nil {
		return pci.Address{}, false, fmt.Errorf("hostdev %s: source address: %w", hostdevName(h), err)
	}
	return a, true, nil
}

// hostdevName names a hostdev in an error: its alias, else its source as written.
func hostdevName(h libvirtxml.DomainHostdev) string {
	if h.Alias != nil && h.Alias.Name != "" {
		return h.Alias.Name
	}
	if h.SubsysPCI != nil && h.SubsysPCI.Source != nil && h.SubsysPCI.Source.Address != nil {
		a := h.SubsysPCI.Source.Address
		v := func(p *uint) uint {
			if p == nil {
				return 0
			}
			return *p
		}
		return fmt.Sprintf("%#x:%#x:%#x.%#x", v(a.Domain), v(a.Bus), v(a.Slot), v(a.Function))
	}
	return "(unnamed)"
}

// guestAddr is where a device plugs into the guest's PCI tree: ok is false without a
// PCI address.
type guestAddr struct {
	bus, slot, fn int
}

func readGuest(a *libvirtxml.DomainAddress) (guestAddr, bool, error) {
	if a == nil || a.PCI == nil || a.PCI.Bus == nil {
		return guestAddr{}, false, nil
	}
	p, err := pciFields(a.PCI)
	if err != nil {
		return guestAddr{}, false, err
	}
	return guestAddr{int(p.Bus), int(p.Device), int(p.Function)}, true, nil
}

// tree is the domain's PCI controllers by index and what plugs into each bus, read once:
// every walk below follows kids, so each is linear in the domain.
type tree struct {
	devs *libvirtxml.DomainDeviceList
	ctl  map[int]*libvirtxml.DomainController
	kids map[int][]child
	// post lists the controller indexes children first (a post-order of the forest the
	// controllers form): a bottom-up pass is one loop over it, a top-down one over it
	// backwards.
	post []int
	// parent of each controller plugged into another one's bus.
	parent map[int]int
}

// child is one thing plugged into a bus: a controller (index >= 0) or another device.
type child struct {
	index    int // controller index, -1 for a device
	hostdev  int // index into Hostdevs, -1 otherwise
	slot, fn int
	addr     **libvirtxml.DomainAddress // another device's address
}

// newTree reads the PCI tree of devs, refusing what libvirt would refuse and what would
// make a walk of it unbounded: an index or number outside libvirt's or PCI's ranges, two
// PCI controllers with one index, a controller plugged into its own bus (directly or
// through others).
func newTree(devs *libvirtxml.DomainDeviceList) (*tree, error) {
	t := &tree{devs: devs, ctl: map[int]*libvirtxml.DomainController{}, kids: map[int][]child{}, parent: map[int]int{}}
	for i := range devs.Controllers {
		c := &devs.Controllers[i]
		if c.Type != "pci" || c.Index == nil {
			continue
		}
		if *c.Index > maxPCIIndex {
			return nil, fmt.Errorf("controller pci %d: index above libvirt's %d", *c.Index, maxPCIIndex)
		}
		idx := int(*c.Index)
		if _, dup := t.ctl[idx]; dup {
			return nil, fmt.Errorf("controller pci %d: listed twice", idx)
		}
		t.ctl[idx] = c
		if c.PCI != nil && c.PCI.Target != nil {
			if nr := c.PCI.Target.BusNr; nr != nil && (*nr < 1 || *nr > maxBusNr) {
				return nil, fmt.Errorf("controller pci %d: busNr %d outside libvirt's 1-%d", idx, *nr, maxBusNr)
			}
			if n := c.PCI.Target.NUMANode; n != nil && *n > maxNUMANode {
				return nil, fmt.Errorf("controller pci %d: numa node %d above Linux's %d", idx, *n, maxNUMANode)
			}
		}
		g, ok, err := readGuest(c.Address)
		if err != nil {
			return nil, fmt.Errorf("controller pci %d: address: %w", idx, err)
		}
		// pcie-root (index 0) has no address; one that claims bus 0 is not its own child.
		if ok && idx != 0 {
			t.parent[idx] = g.bus
			t.kids[g.bus] = append(t.kids[g.bus], child{index: idx, hostdev: -1, slot: g.slot, fn: g.fn})
		}
	}
	for i, h := range devs.Hostdevs {
		g, ok, err := readGuest(h.Address)
		if err != nil {
			return nil, fmt.Errorf("hostdev %s: guest address: %w", hostdevName(h), err)
		}
		if ok {
			t.kids[g.bus] = append(t.kids[g.bus], child{index: -1, hostdev: i, slot: g.slot, fn: g.fn})
		}
	}
	// Every other device with a PCI address counts as a device on its bus.
	for _, a := range otherAddresses(devs) {
		g, ok, err := readGuest(*a)
		if err != nil {
			return nil, fmt.Errorf("device on guest bus: address: %w", err)
		}
		if ok {
			t.kids[g.bus] = append(t.kids[g.bus], child{index: -1, hostdev: -1, slot: g.slot, fn: g.fn, addr: a})
		}
	}
	for bus := range t.kids {
		k := t.kids[bus]
		// Firmware's order; controllers before devices at one slot and function, as the
		// lists were read.
		sort.SliceStable(k, func(i, j int) bool {
			if k[i].slot != k[j].slot {
				return k[i].slot < k[j].slot
			}
			return k[i].fn < k[j].fn
		})
	}
	// A controller whose chain of parents comes back to itself is no tree: refused,
	// before any walk follows it. Each index is entered once (state 2: done).
	state := map[int]int{}
	for idx := range t.ctl {
		var chain []int
		for cur := idx; ; {
			if state[cur] == 2 {
				break
			}
			if state[cur] == 1 {
				return nil, fmt.Errorf("controller pci %d: plugged into its own bus (through controllers %v)", cur, chain)
			}
			state[cur] = 1
			chain = append(chain, cur)
			p, ok := t.parent[cur]
			if _, known := t.ctl[p]; !ok || !known {
				break
			}
			cur = p
		}
		for _, c := range chain {
			state[c] = 2
		}
	}
	// Post-order from every root (a controller on no other controller's bus), in index
	// order so that the result does not depend on map order.
	var roots []int
	for idx := range t.ctl {
		if p, ok := t.parent[idx]; !ok || t.ctl[p] == nil {
			roots = append(roots, idx)
		}
	}
	sort.Ints(roots)
	var visit func(idx int)
	visit = func(idx int) {
		// Depth is at most maxPCIIndex+1: each level is another controller.
		for _, k := range t.kids[idx] {
			if k.index >= 0 {
				visit(k.index)
			}
		}
		t.post = append(t.post, idx)
	}
	for _, r := range roots {
		visit(r)
	}
	return t, nil
}

func (t *tree) pciController(index int) *libvirtxml.DomainController { return t.ctl[index] }

// children lists what plugs into bus, in slot/function order (firmware's order).
func (t *tree) children(bus int) []child { return t.kids[bus] }

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
	// virtio-mem and virtio-pmem: KubeVirt's memory hotplug (api.MemoryDevice) gives one
	// a PCI address.
	for i := range d.Memorydevs {
		out = append(out, &d.Memorydevs[i].Address)
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
// writes one, and a tree that has one was not laid out by it. unitOf names the unit of a
// hostdev (by index), ok false for a hostdev of none.
func (t *tree) checkSwitches(unitOf func(hostdev int) (topology.UnitID, pci.Address, bool)) error {
	// What each bus holds, bottom up: the first unit function met in firmware's order
	// and the first function of another unit after it.
	type seen struct {
		ok, mixed    bool
		first, other topology.UnitID
		at, otherAt  pci.Address
	}
	sum := map[int]seen{}
	add := func(s *seen, u topology.UnitID, a pci.Address) {
		switch {
		case !s.ok:
			s.ok, s.first, s.at = true, u, a
		case !s.mixed && u != s.first:
			s.mixed, s.other, s.otherAt = true, u, a
		}
	}
	for _, idx := range t.post {
		var s seen
		for _, k := range t.kids[idx] {
			switch {
			case k.index >= 0:
				c := sum[k.index]
				if c.ok {
					add(&s, c.first, c.at)
				}
				if c.mixed {
					add(&s, c.other, c.otherAt)
				}
			case k.hostdev >= 0:
				if u, a, ok := unitOf(k.hostdev); ok {
					add(&s, u, a)
				}
			}
		}
		sum[idx] = s
	}
	for i := range t.devs.Controllers {
		c := t.devs.Controllers[i]
		if c.Type != "pci" || c.Model != "pcie-switch-upstream-port" || c.Index == nil || own(c) {
			// The hook's own switches are laid out again whatever libvirt put on them.
			continue
		}
		if s := sum[int(*c.Index)]; s.mixed {
			return fmt.Errorf("hostdev %s (%s) is in the switch of controller %d with %s (%s): a switch holds one unit's functions",
				s.otherAt, s.other, *c.Index, s.at, s.first)
		}
	}
	return nil
}

// strip removes what an earlier call of the hook, libvirt or KubeVirt built for the
// passage hostdevs: the hook's own controllers (AliasPrefix) and every root port or
// switch port whose subtree holds passage hostdevs and nothing else. Bare root ports
// (hotplug slots) and expanders KubeVirt made stay. It returns the domain's tree after.
func (t *tree) strip(isMine func(hostdev int) bool) (*tree, error) {
	// libvirt places devices without an address on any free port, the hook's empty
	// earlier ones too: those devices lose that place and libvirt gives them another
	// when the domain is defined. Top down, so a subtree is entered once.
	below := map[int]bool{}
	for i := len(t.post) - 1; i >= 0; i-- {
		idx := t.post[i]
		below[idx] = below[t.parentOf(idx)] || own(*t.ctl[idx])
		if !below[idx] {
			continue
		}
		for _, k := range t.kids[idx] {
			switch {
			case k.hostdev >= 0 && !isMine(k.hostdev):
				t.devs.Hostdevs[k.hostdev].Address = nil
			case k.addr != nil:
				*k.addr = nil
			}
		}
	}
	t, err := newTree(t.devs)
	if err != nil {
		return nil, err
	}
	remove := map[int]bool{}
	// holds, bottom up: 1 = a passage hostdev below, 2 = anything else below.
	holds := map[int]int{}
	for _, idx := range t.post {
		h := 0
		for _, k := range t.kids[idx] {
			switch {
			case k.index >= 0:
				h |= holds[k.index]
			case k.hostdev >= 0 && isMine(k.hostdev):
				h |= 1
			default:
				h |= 2
			}
		}
		holds[idx] = h
		c := t.ctl[idx]
		switch {
		case own(*c):
			remove[idx] = true
		case (c.Model == "pcie-root-port" || isSwitchPort(c.Model)) && h == 1:
			remove[idx] = true
		case isSwitchPort(c.Model) && h == 0:
			// An empty switch port is an earlier layout's: neither libvirt nor KubeVirt
			// adds one.
			remove[idx] = true
		case c.Model == "pcie-root-port" && len(t.kids[idx]) > 0:
			// A removed switch leaves its root port empty: that root port was the
			// layout's too. Its children come first in post, so they are decided.
			all := true
			for _, k := range t.kids[idx] {
				if k.index < 0 || !remove[k.index] {
					all = false
					break
				}
			}
			remove[idx] = all
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
		if isMine(i) {
			t.devs.Hostdevs[i].Address = nil
		}
	}
	return newTree(t.devs)
}

// parentOf is the controller whose bus idx plugs into, -1 for none.
func (t *tree) parentOf(idx int) int {
	if p, ok := t.parent[idx]; ok && t.ctl[p] != nil {
		return p
	}
	return -1
}

// placement reads what the domain leaves to the plan: the first free controller index,
// its guest NUMA cells and the host nodes they are bound to, and its expanders.
func (t *tree) placement(d libvirtxml.Domain, units int) (*topology.Placement, error) {
	p := &topology.Placement{FirstIndex: 1}
	for idx := range t.ctl {
		if idx+1 > p.FirstIndex {
			p.FirstIndex = idx + 1
		}
	}
	// Bounded by maxPCIIndex: newTree refused any index above it.
	for i := 1; i < p.FirstIndex; i++ {
		if t.ctl[i] == nil {
			p.Free = append(p.Free, i)
		}
	}
	if d.CPU != nil && d.CPU.Numa != nil && len(d.CPU.Numa.Cell) > 0 {
		p.GuestNodes = map[int]int{}
		if d.NUMATune != nil {
			for _, mn := range d.NUMATune.MemNodes {
				h, err := strconv.Atoi(mn.Nodeset)
				if err != nil || h < 0 || h > maxNUMANode {
					// A cell bound to several host nodes stands for none of them.
					continue
				}
				if _, dup := p.GuestNodes[h]; !dup {
					p.GuestNodes[h] = int(mn.CellID)
				}
			}
		}
	}
	// The controllers below each bus, bottom up.
	reserved := map[int]int{}
	for _, idx := range t.post {
		n := 0
		for _, k := range t.kids[idx] {
			if k.index >= 0 {
				n += 1 + reserved[k.index]
			}
		}
		reserved[idx] = n
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
		e.Reserved = reserved[e.Index]
		if c.PCI != nil && c.PCI.Target != nil && c.PCI.Target.BusNr != nil {
			e.BusNr = int(*c.PCI.Target.BusNr)
		}
		p.Expanders = append(p.Expanders, e)
	}
	// The units' root ports without guest NUMA go on pcie.0 where no bridge of the
	// domain is numbered among them (RootPorts): before its first bridge, in firmware's
	// order, or else after its last. Before is where they stay from call to call:
	// libvirt puts the root ports it adds itself into the functions of the units' slots
	// after theirs (it aggregates root ports into multifunction slots), or in later
	// slots.
	type place struct{ slot, fn int }
	taken := map[place]bool{}
	first, last := place{maxSlot + 1, 0}, place{0, 7}
	before := func(a, b place) bool { return a.slot < b.slot || a.slot == b.slot && a.fn < b.fn }
	for _, k := range t.children(0) {
		at := place{k.slot, k.fn}
		taken[at] = true
		if k.index >= 0 && t.ctl[k.index].Model != "pcie-expander-bus" {
			if before(at, first) {
				first = at
			}
			if before(last, at) {
				last = at
			}
		}
	}
	// free lists the places from..to (inclusive) the plan may take: function 0 of a free
	// slot, and the other functions of a slot whose function 0 it takes.
	free := func(from, to place) []pci.Address {
		var out []pci.Address
		for s := max(from.slot, 1); s <= min(to.slot, maxSlot); s++ {
			mine := false
			for f := 0; f <= 7; f++ {
				at := place{s, f}
				if before(at, from) || before(to, at) {
					continue
				}
				if taken[at] {
					if f == 0 {
						break
					}
					continue
				}
				if f == 0 {
					mine = true
				}
				if mine {
					out = append(out, pci.Address{Device: uint8(s), Function: uint8(f)})
				}
			}
		}
		return out
	}
	p.RootPorts, p.RootBus = nil, 1
	if first.slot <= maxSlot {
		// Up to the one before the first bridge.
		end := place{first.slot, first.fn - 1}
		if first.fn == 0 {
			end = place{first.slot - 1, 7}
		}
		p.RootPorts = free(place{1, 0}, end)
	} else {
		p.RootPorts = free(place{1, 0}, place{maxSlot, 7})
	}
	if len(p.RootPorts) < units {
		var err error
		if _, p.RootBus, err = t.buses(); err != nil {
			return nil, err
		}
		p.RootPorts = free(place{last.slot + 1, 0}, place{maxSlot, 7})
	}
	return p, nil
}

// addressRootPorts gives each root port without an address (virt-launcher's bare ones
// for hotplug, KUBEVIRT.md's third call) a free pcie.0 slot above the units' root ports,
// in index order: left to libvirt, it would take the lowest free slot, perhaps one below
// them, and move the units' guest bus numbers after the hook has written them into the
// NCCL file.
func addressRootPorts(devs *libvirtxml.DomainDeviceList, g *topology.Guest) error {
	t, err := newTree(devs)
	if err != nil {
		return err
	}
	used := map[int]bool{0: true}
	for _, k := range t.children(0) {
		used[k.slot] = true
	}
	var slots []int
	for s := 1; s <= maxSlot; s++ {
		if !used[s] {
			slots = append(slots, s)
		}
	}
	if !g.NUMA {
		top := 0
		for _, u := range g.Units {
			top = max(top, u.RootPort.Dev)
		}
		for len(slots) > 0 && slots[0] <= top {
			slots = slots[1:]
		}
	}
	var bare []*libvirtxml.DomainController
	for i := range devs.Controllers {
		c := &devs.Controllers[i]
		if c.Type == "pci" && c.Index != nil && c.Model == "pcie-root-port" && c.Address == nil {
			bare = append(bare, c)
		}
	}
	sort.Slice(bare, func(i, j int) bool { return *bare[i].Index < *bare[j].Index })
	if len(bare) > len(slots) {
		return fmt.Errorf("controller pci %d: %d root ports without an address, %d pcie.0 slots free above the units' root ports", *bare[0].Index, len(bare), len(slots))
	}
	for i, c := range bare {
		c.Address = &libvirtxml.DomainAddress{PCI: &libvirtxml.DomainAddressPCI{Domain: ptr(uint(0)), Bus: ptr(uint(0)), Slot: ptr(uint(slots[i])), Function: ptr(uint(0))}}
	}
	return nil
}

// otherPorts are the root ports the strip left: KubeVirt's, for its own devices and
// bare ones for hotplug (KUBEVIRT.md: call 3 adds those). OVMF pads each from the same
// 64-bit window as the units (topology.MMIO), so the plan is sized with them. Only a
// root port on a root bus counts: KubeVirt nests none.
func (t *tree) otherPorts() []topology.OtherPort {
	var out []topology.OtherPort
	for _, idx := range t.post {
		c := t.ctl[idx]
		if c.Model != "pcie-root-port" || own(*c) {
			continue
		}
		p := max(t.parentOf(idx), 0)
		if p != 0 && t.ctl[p].Model != "pcie-expander-bus" {
			continue
		}
		// KubeVirt v1.9.0's DomainSpec, which virt-launcher and parseDomain read the
		// domain through, keeps no hotplug attribute: every port is hotplug-capable
		// until a KubeVirt that keeps one (its main branch sets it on occupied ports).
		hotplug := c.PCI == nil || c.PCI.Target == nil || c.PCI.Target.Hotplug != "off"
		out = append(out, topology.OtherPort{Expander: p, Hotplug: hotplug, Index: idx})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out
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
	return guestBuses(d.Devices)
}

// guestBuses is GuestBuses of a domain's devices already read.
func guestBuses(devs *libvirtxml.DomainDeviceList) (map[int]int, error) {
	t, err := newTree(devs)
	if err != nil {
		return nil, err
	}
	buses, _, err := t.buses()
	return buses, err
}

// buses numbers the tree's buses (GuestBuses); next is the first bus number after the
// ones pcie.0's bridges take.
func (t *tree) buses() (buses map[int]int, next int, err error) {
	devs := t.devs
	buses = map[int]int{0: 0}
	var walk func(index, bus int, next *int)
	walk = func(index, bus int, next *int) {
		buses[index] = bus
		for _, ch := range t.children(index) {
			if ch.index < 0 || t.ctl[ch.index].Model == "pcie-expander-bus" {
				continue
			}
			n := *next
			*next = n + 1
			walk(ch.index, n, next)
		}
	}
	next = 1
	walk(0, 0, &next)
	after := next
	for _, c := range devs.Controllers {
		if c.Type != "pci" || c.Index == nil || c.Model != "pcie-expander-bus" {
			continue
		}
		if c.PCI == nil || c.PCI.Target == nil || c.PCI.Target.BusNr == nil {
			return nil, 0, fmt.Errorf("controller %d: pcie-expander-bus without busNr", *c.Index)
		}
		nr := int(*c.PCI.Target.BusNr)
		n := nr + 1
		walk(int(*c.Index), nr, &n)
	}
	return buses, after, nil
}

// NCCL renders the guest's NCCL topology file with each bus ID read from domain (the
// one handed back) as the guest will number it, and o's NVLinks; a plan whose predicted
// bus IDs the domain does not give is an error, not a file with the wrong ones.
func NCCL(g *topology.Guest, domain []byte, o topology.NCCLOptions) ([]byte, error) {
	buses, err := GuestBuses(domain)
	if err != nil {
		return nil, err
	}
	return ncclOf(g, buses, o)
}

// ncclOf is NCCL with the domain's guest buses already numbered.
func ncclOf(g *topology.Guest, buses map[int]int, o topology.NCCLOptions) ([]byte, error) {
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
	return g.NCCLTopologyWith(o)
}
