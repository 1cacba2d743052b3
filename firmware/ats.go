// Package firmware checks what depends on the firmware of the passthrough devices: that
// every ConnectX-8 function of a unit exposes ATS, and what a missing one means for the
// unit and its ACS plan. It reads the scanned tree and never writes anything.
package firmware

import (
	"fmt"
	"slices"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// Policy is what a NIC function without ATS does to its unit (passage.ats=).
type Policy string

const (
	// PolicyPrefer degrades the unit: it is usable, without Direct Translated P2P.
	PolicyPrefer Policy = "prefer"
	// PolicyRequire fails the unit: it must not be scheduled.
	PolicyRequire Policy = "require"
)

// ParsePolicy accepts "prefer" and "require"; "" means prefer.
func ParsePolicy(s string) (Policy, error) {
	switch Policy(s) {
	case "", PolicyPrefer:
		return PolicyPrefer, nil
	case PolicyRequire:
		return PolicyRequire, nil
	}
	return "", fmt.Errorf("ats policy %q: want prefer or require", s)
}

// Finding is the ATS state of one NIC-side function of a unit.
type Finding struct {
	Unit topology.UnitID `json:"unit"`
	Addr pci.Address     `json:"bdf"`
	IDs  string          `json:"ids"`  // "15b3:1023"
	Role string          `json:"role"` // topology.RoleGPUNIC or topology.RoleDataDirect
	// ATS says the ATS extended capability is in config space: with ConnectX-8 that is
	// the firmware's ATS_ENABLED.
	ATS bool `json:"ats"`
	// Enable is ATSCtl Enable as seen at check time. It is not an error when off: the
	// IOMMU driver sets it when the function attaches to a translating domain (at vfio
	// attach, later than this check), so the manifest records it as seen.
	Enable bool   `json:"ats_enable"`
	Offset int    `json:"ats_offset,omitempty"`
	STU    int    `json:"stu,omitempty"`
	Note   string `json:"note,omitempty"`
}

// Missing says the function lacks ATS.
func (f Finding) Missing() bool { return !f.ATS }

func (f Finding) String() string {
	if !f.ATS {
		return fmt.Sprintf("unit %d: %s %s (%s): no ATS capability: firmware ATS_ENABLED is off", f.Unit, f.Role, f.Addr, f.IDs)
	}
	en := "-"
	if f.Enable {
		en = "+"
	}
	return fmt.Sprintf("unit %d: %s %s (%s): ATS at 0x%03x, ATSCtl: Enable%s", f.Unit, f.Role, f.Addr, f.IDs, f.Offset, en)
}

const enableNote = "ATSCtl Enable- as expected before attach: the IOMMU sets it when the function joins a translating domain"

// CheckATS checks every NIC PF and data-direct function of every unit for the ATS
// capability and returns one finding per function. It changes nothing: what a missing
// capability makes of a unit (degraded under PolicyPrefer, its ports losing DT: see
// DropDT; failed under PolicyRequire) is the decision's (package decision, Verdict).
//
// Which functions need ATS is the unit's NIC-side membership, not a device-ID list: on
// HGX B300 those are ConnectX-8 PFs (15b3:1023) and data-direct functions (15b3:2100);
// in the QEMU profile the stand-ins are virtio-net (1af4:1041) with ats=on. The GPU and
// NVMe are not checked.
func CheckATS(units []*topology.Unit) []Finding {
	var out []Finding
	for _, u := range units {
		if u == nil {
			continue
		}
		check := func(d *pci.Device, role topology.Role) {
			if d == nil {
				return
			}
			f := Finding{Unit: u.ID, Addr: d.Addr, IDs: d.IDs(), Role: string(role)}
			if d.ATS != nil {
				f.ATS = true
				f.Enable = d.ATS.Enable
				f.Offset = d.ATS.Offset
				f.STU = d.ATS.STU
				if !f.Enable {
					f.Note = enableNote
				}
			} else if len(d.Config) <= pci.HeaderSize {
				// Without the extended space the capability list is unknown, not empty;
				// the finding still counts as missing, so the unit does not claim DT on
				// a guess.
				f.Note = fmt.Sprintf("config space is %d bytes: capabilities unknown", len(d.Config))
			}
			out = append(out, f)
		}
		for _, d := range u.NICs {
			check(d, topology.RoleGPUNIC)
		}
		for _, d := range u.DataDirect {
			check(d, topology.RoleDataDirect)
		}
	}
	return out
}

// Verdict is what a finding makes of its unit under the policy, with the reason: ""
// for a function that has ATS.
func (f Finding) Verdict(policy Policy) (topology.Status, string) {
	switch {
	case f.ATS:
		return "", ""
	case policy == PolicyRequire:
		return topology.StatusFailed, fmt.Sprintf("ats: %s %s (%s) has no ATS capability (passage.ats=require)", f.Role, f.Addr, f.IDs)
	default:
		return topology.StatusDegraded, fmt.Sprintf("ats: %s %s (%s) has no ATS capability: no Direct Translated P2P for this unit", f.Role, f.Addr, f.IDs)
	}
}

// NoDT returns the units that must not get Direct Translated P2P: those with a NIC-side
// function lacking ATS.
func NoDT(findings []Finding) map[topology.UnitID]bool {
	out := map[topology.UnitID]bool{}
	for _, f := range findings {
		if f.Missing() {
			out[f.Unit] = true
		}
	}
	return out
}

// DropDT returns the plan with DT forced off on the ports of units that lack ATS: DT
// without ATS only opens a path nothing uses. DT stays in the mask so the port ends with
// it clear; every other bit of the plan is kept. The input is not modified.
func DropDT(ports []topology.ACSPort, findings []Finding) []topology.ACSPort {
	no := NoDT(findings)
	out := make([]topology.ACSPort, len(ports))
	for i, p := range ports {
		if p.Flags&pci.ACSDT != 0 && slices.ContainsFunc(p.Units(), func(u topology.UnitID) bool { return no[u] }) {
			p.Flags &^= pci.ACSDT
			if p.Reason != "" {
				p.Reason += "; "
			}
			p.Reason += "DT dropped: a NIC function of the unit has no ATS"
			if p.Target() == p.Current {
				p.Reason += "; already set"
			}
		}
		out[i] = p
	}
	return out
}
