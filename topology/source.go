package topology

import (
	"errors"
	"fmt"
	"strings"

	"github.com/passage-boot/passage/pci"
)

// GuestSource is everything a guest plan and its renderings read about one unit: its
// verdict, its host NUMA node, its link to the CPU and its passthrough functions. It is
// built either from a decision's units (SourcesOf: planning, before a node exists) or
// from a verified manifest (package hypervisor): the renderers cannot tell the two
// apart, so a rendering from a manifest is byte for byte the rendering from the tree
// the manifest was written on.
type GuestSource struct {
	ID       UnitID
	Status   Status
	Reasons  []string
	NUMANode int
	// UpLink is the link of the root port above the unit's GPU: what the guest's
	// emulated root port cannot show and the NCCL topology file carries.
	UpLink Link
	// Functions in the unit's order: the GPU, its NICs, data-direct, NVMe.
	Functions []HostFunction
}

// HostFunction is one passthrough function as the host has it.
type HostFunction struct {
	Addr            pci.Address
	Role            Role
	Vendor, Device  uint16
	SubsystemVendor uint16
	SubsystemDevice uint16
	Class           uint32
	Link            Link
	// BARs are the function's BARs with their sizes; nil when the input does not give
	// them (an lspci dump gives BARs without sizes, a manifest before schema 4 none).
	BARs []pci.BAR
}

// SourcesOf turns units into guest sources, with the units' statuses as they stand.
func SourcesOf(units []*Unit) []GuestSource {
	out := make([]GuestSource, 0, len(units))
	for _, u := range units {
		s := GuestSource{ID: u.ID, Status: u.Status, Reasons: append([]string(nil), u.Reasons...), NUMANode: u.NUMANode, UpLink: UpLinkOf(u)}
		for _, f := range u.Functions() {
			if f == nil {
				continue
			}
			role := RoleGPU
			switch {
			case contains(u.NICs, f):
				role = RoleGPUNIC
			case contains(u.DataDirect, f):
				role = RoleDataDirect
			case contains(u.NVMe, f):
				role = RoleGPUNVMe
			}
			s.Functions = append(s.Functions, HostFunction{Addr: f.Addr, Role: role, Vendor: f.VendorID, Device: f.DeviceID,
				SubsystemVendor: f.SubsystemVendor, SubsystemDevice: f.SubsystemDevice, Class: f.Class, Link: linkOf(f), BARs: sizedBARs(f)})
		}
		out = append(out, s)
	}
	return out
}

// sizedBARs are a function's BARs when the scan sized them all, else nil (unknown): a
// dump's BARs carry no sizes. A function without BARs has an empty, non-nil list.
func sizedBARs(d *pci.Device) []pci.BAR {
	out := make([]pci.BAR, 0, len(d.BARs))
	for _, b := range d.BARs {
		if b.Size == 0 {
			return nil
		}
		out = append(out, b)
	}
	return out
}

// UpLinkOf is the link of the root port above the unit's GPU (zero when there is none).
func UpLinkOf(u *Unit) Link { return linkOf(u.RootPort()) }

// RootPort is the root port above the unit's GPU (nil when there is none).
func (u *Unit) RootPort() *pci.Device {
	if u.GPU == nil {
		return nil
	}
	return rootPortOf(u.GPU)
}

// LinkFrom is a link from lspci's speed word ("64GT/s", as LinkSpeed.String writes it)
// and a width; an empty speed is no link. Any other word is an error.
func LinkFrom(speed string, width int) (Link, error) {
	if speed == "" && width == 0 {
		return Link{}, nil
	}
	for s := pci.LinkSpeed(1); s.GTs() != 0; s++ {
		if s.String() == speed {
			if width < 0 || width > 32 {
				return Link{}, fmt.Errorf("link width %d: not a PCIe width", width)
			}
			return Link{Speed: s, Width: width, GTs: s.GTs()}, nil
		}
	}
	return Link{}, fmt.Errorf("link speed %q: not a PCIe speed (2.5GT/s ... 64GT/s)", speed)
}

// Admit checks that every unit asked for may go into a guest, by the verdict the
// sources carry (the decision's, or the manifest's): ready, or degraded when the caller
// accepts degraded units. ids nil asks for every unit so admitted. It returns the units
// admitted and which of them are degraded; the error names every unit refused and why.
// It decides nothing: it reads verdicts already given.
func Admit(src []GuestSource, ids []UnitID, allowDegraded bool) (admitted, degraded []UnitID, err error) {
	byID := make(map[UnitID]*GuestSource, len(src))
	for i := range src {
		byID[src[i].ID] = &src[i]
	}
	all := ids == nil
	if all {
		for _, s := range src {
			if s.Status == StatusReady || s.Status == StatusDegraded && allowDegraded {
				ids = append(ids, s.ID)
			}
		}
		if len(ids) == 0 {
			return nil, nil, fmt.Errorf("no unit is ready%s", map[bool]string{true: " or degraded", false: ""}[allowDegraded])
		}
	}
	var refused []string
	for _, id := range ids {
		s := byID[id]
		switch {
		case s == nil:
			refused = append(refused, fmt.Sprintf("no unit %s", id))
		case s.Status == StatusReady:
			admitted = append(admitted, id)
		case s.Status == StatusDegraded && allowDegraded:
			admitted = append(admitted, id)
			degraded = append(degraded, id)
		case s.Status == StatusDegraded:
			refused = append(refused, fmt.Sprintf("%s is degraded (%s): only with --allow-degraded", id, strings.Join(s.Reasons, "; ")))
		default:
			refused = append(refused, fmt.Sprintf("%s is %s: %s", id, orNone(string(s.Status)), strings.Join(s.Reasons, "; ")))
		}
	}
	if len(refused) > 0 {
		return nil, nil, errors.New(strings.Join(refused, "; "))
	}
	return admitted, degraded, nil
}

func orNone(s string) string {
	if s == "" {
		return "without a verdict"
	}
	return s
}
