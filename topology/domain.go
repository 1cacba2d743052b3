package topology

import (
	"fmt"
	"sort"
	"strings"

	"libvirt.org/go/libvirtxml"
)

// DomainOptions are what a libvirt domain needs beyond the guest plan.
type DomainOptions struct {
	Name string
	// Type is the domain type: "kvm", or "qemu" (TCG) where there is no KVM.
	Type      string
	VCPUs     int
	MemoryMiB int
	// Description goes into <description> (which units are degraded and why).
	Description string
	// HostCPUs are the host NUMA nodes' CPU lists ("0-63,128-191"), for <vcpupin>: the
	// vCPUs of a guest cell are pinned to the CPUs of the host node it stands for. Nodes
	// without a list get no pin.
	HostCPUs map[int]string
	// PhysBits is the guest's physical address width (<maxphysaddr>): OVMF sizes its
	// 64-bit MMIO window from it (Guest.MMIO). 0 leaves it to the CPU model.
	PhysBits int
}

// Domain renders the plan as a complete libvirt <domain>: q35, vCPUs and memory from
// opt, with NUMA one guest cell per guest node the plan names (vCPUs and memory split
// evenly, <numatune> binding each cell's memory to the host node it stands for, and
// <vcpupin> to that node's CPUs when opt.HostCPUs has them), the plan's controllers, and
// each function as <hostdev managed='no'>: passage bound it to vfio-pci at boot, and
// libvirt must not rebind it.
func (g *Guest) Domain(opt DomainOptions) ([]byte, error) {
	switch opt.Type {
	case "kvm", "qemu":
	default:
		return nil, fmt.Errorf("libvirt domain: type %q: want kvm or qemu", opt.Type)
	}
	if opt.Name == "" || strings.ContainsAny(opt.Name, "/\n") {
		return nil, fmt.Errorf("libvirt domain: name %q: want a name without / or newlines", opt.Name)
	}
	if opt.VCPUs < 1 || opt.MemoryMiB < 1 {
		return nil, fmt.Errorf("libvirt domain: %d vCPUs, %d MiB: want at least 1 of each", opt.VCPUs, opt.MemoryMiB)
	}
	// libvirt's own types: every optional element is a nil pointer or an empty slice and
	// is not written, so no element is ever written empty (an empty <numa> inside <cpu>
	// is refused by libvirt's schema and by virsh define).
	d := libvirtxml.Domain{Type: opt.Type, Name: opt.Name, Description: opt.Description,
		Memory:     &libvirtxml.DomainMemory{Unit: "MiB", Value: uint(opt.MemoryMiB)},
		VCPU:       &libvirtxml.DomainVCPU{Placement: "static", Value: uint(opt.VCPUs)},
		OS:         &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Arch: "x86_64", Machine: "q35", Type: "hvm"}},
		Features:   &libvirtxml.DomainFeatureList{ACPI: &libvirtxml.DomainFeature{}, APIC: &libvirtxml.DomainFeatureAPIC{}},
		OnPoweroff: "destroy", OnReboot: "restart", OnCrash: "destroy"}
	// OVMF takes a width above 40 bits only from a CPU with 1 GiB pages (pdpe1gb);
	// type qemu's default model, qemu64, has none. host-passthrough (KVM) and maximum
	// (TCG: QEMU's max, every feature TCG emulates) have them.
	d.CPU = &libvirtxml.DomainCPU{Mode: "host-passthrough"}
	if opt.Type == "qemu" {
		d.CPU.Mode = "maximum"
	}
	if opt.PhysBits > 0 {
		// https://libvirt.org/formatdomain.html#cpu-model-and-topology: mode
		// emulate gives the guest exactly bits (QEMU's phys-bits), with KVM as under
		// TCG; passthrough's limit needs libvirt 9.2. The host must have that width
		// itself (a B300 host's Xeon 6 has 52 bits): KVM cannot map a guest address
		// the host has not.
		d.CPU.MaxPhysAddr = &libvirtxml.DomainCPUMaxPhysAddr{Mode: "emulate", Bits: uint(opt.PhysBits)}
	}
	if g.NUMA && len(g.GuestNodes) > 0 {
		if err := g.numaCells(&d, opt); err != nil {
			return nil, err
		}
	}
	devs, err := g.devices()
	if err != nil {
		return nil, err
	}
	// No USB controller and no balloon: libvirt would add both by default, each on a
	// root port of its own in pcie.0's first free slots, which firmware numbers before
	// the plan's (every unit's guest bus moves: the NCCL file names the plan's) and OVMF
	// pads for hotplug from the units' 64-bit window. A balloon cannot take back memory
	// that vfio has pinned anyway.
	devs.Controllers = append([]libvirtxml.DomainController{{Type: "pci", Index: ptr(uint(0)), Model: "pcie-root"},
		{Type: "usb", Model: "none"}}, devs.Controllers...)
	devs.MemBalloon = &libvirtxml.DomainMemBalloon{Model: "none"}
	d.Devices = devs
	return marshalXML(" passage guest: "+g.unitList()+"; each function already on vfio-pci (managed='no') ", &d, "domain")
}

func (g *Guest) unitList() string {
	var ids []string
	for _, u := range g.Units {
		ids = append(ids, u.Unit.String())
	}
	return "units " + strings.Join(ids, ",")
}

// numaCells adds the guest cells, their memory binding and vCPU pins.
func (g *Guest) numaCells(d *libvirtxml.Domain, opt DomainOptions) error {
	host := make([]int, len(g.GuestNodes)) // guest cell -> host node
	for h, c := range g.GuestNodes {
		if c < 0 || c >= len(host) {
			return fmt.Errorf("libvirt domain: guest node %d of host node %d out of range", c, h)
		}
		host[c] = h
	}
	n := len(host)
	if opt.VCPUs < n || opt.MemoryMiB < n {
		return fmt.Errorf("libvirt domain: %d vCPUs and %d MiB do not cover %d NUMA cells", opt.VCPUs, opt.MemoryMiB, n)
	}
	numa := &libvirtxml.DomainNuma{}
	// A guest cell stands for a host node; one whose host node is not known (numa_node
	// -1: QEMU, a single-socket host) binds its memory nowhere in particular.
	var known []int
	for _, h := range host {
		if h >= 0 {
			known = append(known, h)
		}
	}
	var nt *libvirtxml.DomainNUMATune
	if len(known) > 0 {
		nt = &libvirtxml.DomainNUMATune{Memory: &libvirtxml.DomainNUMATuneMemory{Mode: "strict", Nodeset: nodeSet(known)}}
	}
	var pins []libvirtxml.DomainCPUTuneVCPUPin
	first, mem := 0, opt.MemoryMiB
	for c := 0; c < n; c++ {
		cpus := opt.VCPUs / n
		if c < opt.VCPUs%n {
			cpus++
		}
		m := opt.MemoryMiB / n
		if c == n-1 {
			m = mem
		}
		mem -= m
		numa.Cell = append(numa.Cell, libvirtxml.DomainCell{ID: ptr(uint(c)), CPUs: cpuRange(first, first+cpus-1), Memory: uint(m), Unit: "MiB"})
		if host[c] >= 0 {
			nt.MemNodes = append(nt.MemNodes, libvirtxml.DomainNUMATuneMemNode{CellID: uint(c), Mode: "strict", Nodeset: fmt.Sprint(host[c])})
		}
		if set := opt.HostCPUs[host[c]]; set != "" {
			for v := first; v < first+cpus; v++ {
				pins = append(pins, libvirtxml.DomainCPUTuneVCPUPin{VCPU: uint(v), CPUSet: set})
			}
		}
		first += cpus
	}
	// n >= 1 here: the cells are never empty.
	d.CPU.Numa = numa
	d.NUMATune = nt
	if len(pins) > 0 {
		d.CPUTune = &libvirtxml.DomainCPUTune{VCPUPin: pins}
	}
	return nil
}

func cpuRange(a, b int) string {
	if a == b {
		return fmt.Sprint(a)
	}
	return fmt.Sprintf("%d-%d", a, b)
}

func nodeSet(nodes []int) string {
	s := append([]int(nil), nodes...)
	sort.Ints(s)
	var out []string
	for _, n := range s {
		out = append(out, fmt.Sprint(n))
	}
	return strings.Join(out, ",")
}
