package topology

import (
	"encoding/xml"
	"fmt"
	"sort"
	"strings"
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
}

// The libvirt domain XML elements below follow https://libvirt.org/formatdomain.html.
type lvDomain struct {
	XMLName     xml.Name    `xml:"domain"`
	Type        string      `xml:"type,attr"`
	Comment     string      `xml:",comment"`
	Name        string      `xml:"name"`
	Description string      `xml:"description,omitempty"`
	Memory      lvSized     `xml:"memory"`
	VCPU        lvVCPU      `xml:"vcpu"`
	CPUTune     *lvCPUTune  `xml:"cputune"`
	NUMATune    *lvNUMATune `xml:"numatune"`
	OS          lvOS        `xml:"os"`
	Features    lvFeatures  `xml:"features"`
	CPU         *lvCPU      `xml:"cpu"`
	OnPoweroff  string      `xml:"on_poweroff"`
	OnReboot    string      `xml:"on_reboot"`
	OnCrash     string      `xml:"on_crash"`
	Devices     lvDevices   `xml:"devices"`
}

type lvSized struct {
	Unit  string `xml:"unit,attr"`
	Value int    `xml:",chardata"`
}

type lvVCPU struct {
	Placement string `xml:"placement,attr"`
	Value     int    `xml:",chardata"`
}

type lvCPUTune struct {
	Pins []lvVCPUPin `xml:"vcpupin"`
}

type lvVCPUPin struct {
	VCPU   int    `xml:"vcpu,attr"`
	CPUSet string `xml:"cpuset,attr"`
}

type lvNUMATune struct {
	Memory   lvNUMAMemory   `xml:"memory"`
	MemNodes []lvNUMAMemory `xml:"memnode"`
}

type lvNUMAMemory struct {
	CellID  *int   `xml:"cellid,attr,omitempty"`
	Mode    string `xml:"mode,attr"`
	NodeSet string `xml:"nodeset,attr"`
}

type lvOS struct {
	Type lvOSType `xml:"type"`
}

type lvOSType struct {
	Arch    string `xml:"arch,attr"`
	Machine string `xml:"machine,attr"`
	Value   string `xml:",chardata"`
}

type lvFeatures struct {
	ACPI struct{} `xml:"acpi"`
	APIC struct{} `xml:"apic"`
}

type lvCPU struct {
	Mode  string   `xml:"mode,attr,omitempty"`
	Cells []lvCell `xml:"numa>cell"`
}

type lvCell struct {
	ID     int    `xml:"id,attr"`
	CPUs   string `xml:"cpus,attr"`
	Memory int    `xml:"memory,attr"`
	Unit   string `xml:"unit,attr"`
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
	d := lvDomain{Type: opt.Type, Name: opt.Name, Description: opt.Description,
		Comment:    " passage guest: " + g.unitList() + "; each function already on vfio-pci (managed='no') ",
		Memory:     lvSized{Unit: "MiB", Value: opt.MemoryMiB},
		VCPU:       lvVCPU{Placement: "static", Value: opt.VCPUs},
		OS:         lvOS{Type: lvOSType{Arch: "x86_64", Machine: "q35", Value: "hvm"}},
		OnPoweroff: "destroy", OnReboot: "restart", OnCrash: "destroy"}
	if opt.Type == "kvm" {
		d.CPU = &lvCPU{Mode: "host-passthrough"}
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
	devs.Comment = ""
	devs.Controllers = append([]lvController{{Type: "pci", Index: 0, Model: "pcie-root"}}, devs.Controllers...)
	d.Devices = devs
	out, err := xml.MarshalIndent(d, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("libvirt domain: %w", err)
	}
	return append(out, '\n'), nil
}

func (g *Guest) unitList() string {
	var ids []string
	for _, u := range g.Units {
		ids = append(ids, u.Unit.String())
	}
	return "units " + strings.Join(ids, ",")
}

// numaCells adds the guest cells, their memory binding and vCPU pins.
func (g *Guest) numaCells(d *lvDomain, opt DomainOptions) error {
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
	if d.CPU == nil {
		d.CPU = &lvCPU{}
	}
	// A unit whose host node the platform does not say (numa_node -1) still gets its
	// guest cell, but nothing binds the cell's memory: "-1" is no libvirt nodeset.
	var known []int
	for _, h := range host {
		if h >= 0 {
			known = append(known, h)
		}
	}
	nt := &lvNUMATune{Memory: lvNUMAMemory{Mode: "strict", NodeSet: nodeSet(known)}}
	var pins []lvVCPUPin
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
		d.CPU.Cells = append(d.CPU.Cells, lvCell{ID: c, CPUs: cpuRange(first, first+cpus-1), Memory: m, Unit: "MiB"})
		cell := c
		if host[c] < 0 {
			first += cpus
			continue
		}
		nt.MemNodes = append(nt.MemNodes, lvNUMAMemory{CellID: &cell, Mode: "strict", NodeSet: fmt.Sprint(host[c])})
		if set := opt.HostCPUs[host[c]]; set != "" {
			for v := first; v < first+cpus; v++ {
				pins = append(pins, lvVCPUPin{VCPU: v, CPUSet: set})
			}
		}
		first += cpus
	}
	if len(known) > 0 {
		d.NUMATune = nt
	}
	if len(pins) > 0 {
		d.CPUTune = &lvCPUTune{Pins: pins}
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
