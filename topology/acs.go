package topology

import (
	"fmt"
	"sort"
	"strings"

	"github.com/passage-boot/passage/pci"
)

// Port positions in an ACS plan. They are found by where a port sits relative to the
// unit's functions, never by its Express port type: in the QEMU topology, root ports
// stand in for switch downstream ports.
const (
	PosNICPort  = "nic-port"  // directly above the CX-8 PFs: DT goes here
	PosGPUPort  = "gpu-port"  // above the GPU
	PosNVMePort = "nvme-port" // above the unit's NVMe only
	PosPathPort = "path-port" // above NIC functions, not directly
	PosRootPort = "root-port" // on a root bus
)

// ACSPlan plans the ACS Control register of every downstream-facing port on the units'
// paths, per NVIDIA's virtualised setting for the inline CX-8 complex: the port directly
// above the NIC PFs gets SV RR CR UF DT, every other port (above the GPU, the NVMe, and
// the root port) SV RR CR UF with DT off. Only bits a port advertises are planned;
// egress control and translation blocking are left as they are. The isolation bits are
// only ever set: RR/CR/SV/UF are never cleared on a path to a passthrough device.
//
// A port without the ACS capability says its unit must fail (its traffic would bypass
// the IOMMU); a NIC port without DT says the unit is degraded (no direct GPU-NIC path):
// Verdict and Problem carry it, the unit itself is not touched. Upstream ports are not
// planned: PCIe requires ACS on downstream-facing ports (PCIe 6.0 6.12.1.1) and the
// kernel checks only those. A port on several units' paths is planned once, for the
// lowest unit, and names the others in Shared: what happens to it happens to them all.
//
// Within a unit the ports that only isolate come first and the ports that gain DT last:
// an executor that stops a unit at its first failure then never leaves DT open above a
// unit whose isolation it could not finish.
func ACSPlan(units []*Unit) []ACSPort {
	var out, unit []ACSPort
	seen := map[pci.Address]int{} // port -> its index in out
	for _, u := range units {
		if u == nil || u.GPU == nil {
			continue
		}
		nicParents := map[*pci.Device]bool{}
		for _, n := range append(append([]*pci.Device{}, u.NICs...), u.DataDirect...) {
			if n.Parent != nil {
				nicParents[n.Parent] = true
			}
		}
		// The ports above the GPU and above the NVMe, each path walked once: asking every
		// port whether it is above every NVMe was quadratic in a unit's size.
		gpuPorts, nvmePorts := portsAbove(u.GPU), portsAbove(u.NVMe...)
		unit = unit[:0] // a scratch: out takes copies
		bridges := append([]*pci.Device{}, u.Bridges...)
		sort.Slice(bridges, func(i, j int) bool { return bridges[i].Addr.Less(bridges[j].Addr) })
		for _, b := range bridges {
			if t, ok := b.PortType(); !ok || !t.IsDownstreamFacing() {
				continue
			}
			if i, ok := seen[b.Addr]; ok {
				out[i].Shared = append(out[i].Shared, u.ID)
				continue
			}
			p := ACSPort{Addr: b.Addr, Unit: u.ID}
			want := pci.ACSIsolation
			switch {
			case nicParents[b]:
				p.Position = PosNICPort
				want |= pci.ACSDT
			case b.Parent == nil:
				p.Position = PosRootPort
			case gpuPorts[b]:
				p.Position = PosGPUPort
			case nvmePorts[b]:
				p.Position = PosNVMePort
			default:
				p.Position = PosPathPort
			}
			if b.ACS == nil && b.ExtCapsUnknown != "" {
				p.Reason = "ACS unknown: the extended capability list could not be read (" + b.ExtCapsUnknown + ")"
				p.Verdict, p.Problem = StatusFailed, fmt.Sprintf("acs %s (%s): ACS unknown: %s", b.Addr, p.Position, b.ExtCapsUnknown)
				unit = append(unit, p)
				continue
			}
			if b.ACS == nil {
				p.Reason = "no ACS capability: peer traffic below this port cannot be redirected to the IOMMU"
				p.Verdict, p.Problem = StatusFailed, fmt.Sprintf("acs %s (%s): no ACS capability", b.Addr, p.Position)
				unit = append(unit, p)
				continue
			}
			p.Offset, p.Cap, p.Current = b.ACS.Offset, b.ACS.Cap, b.ACS.Ctl
			p.Mask = (pci.ACSIsolation | pci.ACSDT) & p.Cap
			p.Flags = want & p.Cap
			var notes []string
			if p.Position == PosNICPort {
				notes = append(notes, "above the CX-8 PFs: SV RR CR UF DT (translated GPU-NIC P2P stays in the switch)")
				if p.Cap&pci.ACSDT == 0 {
					notes = append(notes, "port does not advertise DT: GPU-NIC traffic goes through the root complex")
					p.Verdict, p.Problem = StatusDegraded, fmt.Sprintf("acs %s (%s): no DT capability", b.Addr, p.Position)
				}
			} else {
				notes = append(notes, p.Position+": SV RR CR UF, DT off (isolation default)")
			}
			if lack := pci.ACSIsolation &^ p.Cap; lack != 0 {
				notes = append(notes, "does not advertise "+lack.String())
			}
			if p.Target() == p.Current {
				notes = append(notes, "already set")
			}
			p.Reason = strings.Join(notes, "; ")
			unit = append(unit, p)
		}
		sort.SliceStable(unit, func(i, j int) bool { return unit[i].Flags&pci.ACSDT == 0 && unit[j].Flags&pci.ACSDT != 0 })
		for i, p := range unit {
			seen[p.Addr] = len(out) + i
		}
		out = append(out, unit...)
	}
	return out
}

// portsAbove is the set of bridges above any of ds.
func portsAbove(ds ...*pci.Device) map[*pci.Device]bool {
	out := map[*pci.Device]bool{}
	for _, d := range ds {
		for a := d.Parent; a != nil && !out[a]; a = a.Parent {
			out[a] = true
		}
	}
	return out
}

// ConfigACSFlags renders a port's plan as one pci=config_acs= flags field: seven
// characters, bit 6 (DT) first down to bit 0 (SV); '1' set, '0' clear, 'x' keep
// (Documentation/admin-guide/kernel-parameters.txt, Linux 6.11+).
func ConfigACSFlags(mask, flags pci.ACSBits) string {
	var b strings.Builder
	for bit := 6; bit >= 0; bit-- {
		v := pci.ACSBits(1) << bit
		switch {
		case mask&v == 0:
			b.WriteByte('x')
		case flags&v != 0:
			b.WriteByte('1')
		default:
			b.WriteByte('0')
		}
	}
	return b.String()
}

// KernelArg is the plan as a kernel argument, so an operator can make it persistent:
// pci=config_acs=<flags>@<bdf>;... in plan order. Entries are joined by ';' because the
// pci= option list is itself split on ','. Ports without an ACS capability are left
// out; with nothing to set the result is "".
func KernelArg(ports []ACSPort) string {
	var entries []string
	for _, p := range ports {
		if p.Offset == 0 || p.Mask == 0 {
			continue
		}
		entries = append(entries, fmt.Sprintf("%s@%s", ConfigACSFlags(p.Mask, p.Flags), p.Addr))
	}
	if len(entries) == 0 {
		return ""
	}
	return "pci=config_acs=" + strings.Join(entries, ";")
}
