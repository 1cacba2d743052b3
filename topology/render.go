package topology

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"strings"

	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/pci"
)

// QEMUDevice renders the -device value for one passthrough function, placed on bus
// (the downstream port's id) at device 0. The default passes the host function through.
type QEMUDevice func(f GuestFunction, bus string) string

// VFIODevice is the default QEMUDevice: vfio-pci host=<BDF>.
func VFIODevice(f GuestFunction, bus string) string {
	return fmt.Sprintf("vfio-pci,host=%s,id=%s,bus=%s,addr=0x0", f.HostID, f.ID, bus)
}

// QEMUArgs renders the guest plan as qemu-system-x86_64 arguments (q35). device may be
// nil for VFIODevice; tests substitute emulated stand-ins. Every pcie-root-port and
// xio3130-downstream gets a chassis/slot pair of its own: QEMU refuses duplicates. With
// NUMA the VM must define the guest nodes that Guest.GuestNodes names (-numa node,...).
func (g *Guest) QEMUArgs(device QEMUDevice) []string {
	if device == nil {
		device = VFIODevice
	}
	var args []string
	dev := func(format string, a ...any) { args = append(args, "-device", fmt.Sprintf(format, a...)) }
	for _, x := range g.Expanders {
		dev("pxb-pcie,id=%s,bus=pcie.0,addr=0x%x,bus_nr=%d,numa_node=%d", x.ID, x.Dev, x.BusNr, x.NUMANode)
	}
	for _, u := range g.Units {
		rp := u.RootPort
		dev("pcie-root-port,id=%s,bus=%s,addr=0x%x,chassis=%d,slot=%d", rp.ID, rp.Bus, rp.Dev, rp.Chassis, rp.Slot)
		dev("x3130-upstream,id=%s,bus=%s,addr=0x0", u.Upstream.ID, u.Upstream.Bus)
		for _, f := range u.Functions {
			p := f.Port
			dev("xio3130-downstream,id=%s,bus=%s,addr=0x%x,chassis=%d,slot=%d", p.ID, p.Bus, p.Dev, p.Chassis, p.Slot)
			args = append(args, "-device", device(f, p.ID))
		}
	}
	return args
}

// QEMUText renders the arguments one device per line, shell-continued.
func (g *Guest) QEMUText(device QEMUDevice) string {
	args := g.QEMUArgs(device)
	var b strings.Builder
	for i := 0; i+1 < len(args); i += 2 {
		fmt.Fprintf(&b, "%s %s", args[i], args[i+1])
		if i+2 < len(args) {
			b.WriteString(" \\")
		}
		b.WriteString("\n")
	}
	return b.String()
}

// libvirtAddr is a PCI address as libvirt writes one (https://libvirt.org/formatdomain.html#device-addresses).
func libvirtAddr(a pci.Address) *libvirtxml.DomainAddressPCI {
	return &libvirtxml.DomainAddressPCI{Domain: ptr(uint(a.Domain)), Bus: ptr(uint(a.Bus)), Slot: ptr(uint(a.Device)), Function: ptr(uint(a.Function))}
}

// libvirtController is a PCI controller (https://libvirt.org/formatdomain.html#controllers):
// its index is the guest bus it provides, model names the QEMU device.
func libvirtController(index int, model, qemuModel string, target *libvirtxml.DomainControllerPCITarget, at pci.Address) libvirtxml.DomainController {
	return libvirtxml.DomainController{Type: "pci", Index: ptr(uint(index)), Model: model,
		PCI:     &libvirtxml.DomainControllerPCI{Model: &libvirtxml.DomainControllerPCIModel{Name: qemuModel}, Target: target},
		Address: &libvirtxml.DomainAddress{PCI: libvirtAddr(at)}}
}

// Libvirt renders the plan as a libvirt <devices> fragment: the expanders, root ports
// and switch ports as <controller>s (a PCI controller's index is the guest bus it
// provides), the functions as <hostdev managed='no'>s (passage bound them to vfio-pci
// at boot; libvirt must not rebind them). Paste its children into a domain's <devices>;
// Domain writes the whole domain.
func (g *Guest) Libvirt() ([]byte, error) {
	d, err := g.devices()
	if err != nil {
		return nil, err
	}
	return marshalXML(" passage guest plan: one virtual switch per GPU unit ", d, "devices")
}

// marshalXML writes v as the element name, indented, after a comment.
func marshalXML(comment string, v any, name string) ([]byte, error) {
	var b bytes.Buffer
	e := xml.NewEncoder(&b)
	e.Indent("", "  ")
	err := e.EncodeToken(xml.Comment(comment))
	if err == nil {
		err = e.EncodeToken(xml.CharData("\n"))
	}
	if err == nil {
		err = e.EncodeElement(v, xml.StartElement{Name: xml.Name{Local: name}})
	}
	if err == nil {
		err = e.Close()
	}
	if err != nil {
		return nil, fmt.Errorf("libvirt %s: %w", name, err)
	}
	return append(b.Bytes(), '\n'), nil
}

func (g *Guest) devices() (*libvirtxml.DomainDeviceList, error) {
	d := &libvirtxml.DomainDeviceList{Controllers: g.LibvirtControllers()}
	for _, u := range g.Units {
		for _, f := range u.Functions {
			d.Hostdevs = append(d.Hostdevs, libvirtxml.DomainHostdev{Managed: "no",
				SubsysPCI: &libvirtxml.DomainHostdevSubsysPCI{Source: &libvirtxml.DomainHostdevSubsysPCISource{Address: libvirtAddr(f.HostID)}},
				Address:   f.LibvirtAddress()})
		}
	}
	return d, nil
}

// AliasPrefix starts the user alias (libvirt keeps "ua-" aliases, KubeVirt's DomainSpec
// keeps <alias>) of every controller a placed plan adds: how the KubeVirt hook knows
// its own earlier controllers when virt-launcher hands its output back.
const AliasPrefix = "ua-passage-"

// LibvirtControllers are the plan's PCI controllers in index order: the expanders it
// adds, then per unit its root port, upstream port and downstream ports. A placed plan
// (GuestOptions.In) leaves out the expanders the domain has (Kept), gives each
// controller an alias (AliasPrefix and its id), and leaves to libvirt what KubeVirt's
// DomainSpec does not keep (chassis/port, the QEMU model names) or what libvirt picks
// anyway (an expander's pcie.0 slot).
func (g *Guest) LibvirtControllers() []libvirtxml.DomainController {
	var cs []libvirtxml.DomainController
	add := func(id string, p GuestPort, model, qemuModel string, target *libvirtxml.DomainControllerPCITarget) {
		at := pci.Address{Bus: uint8(p.Parent), Device: uint8(p.Dev)}
		if p.Model == "x3130-upstream" {
			at.Device = 0
		}
		if g.Placed && p.Bus == "pcie.0" {
			at.Function = p.Addr.Function
		}
		c := libvirtController(p.Index, model, qemuModel, target, at)
		if g.Placed {
			c.PCI.Model, c.PCI.Target = nil, nil
			c.Alias = &libvirtxml.DomainAlias{Name: AliasPrefix + id}
		}
		cs = append(cs, c)
	}
	for _, x := range g.Expanders {
		if x.Kept {
			continue
		}
		target := &libvirtxml.DomainControllerPCITarget{BusNr: ptr(uint(x.BusNr))}
		if x.NUMANode >= 0 {
			target.NUMANode = ptr(uint(x.NUMANode))
		}
		c := libvirtController(x.Index, "pcie-expander-bus", "pxb-pcie", target, pci.Address{Device: uint8(x.Dev)})
		if g.Placed {
			c.PCI.Model, c.Address = nil, nil
			c.Alias = &libvirtxml.DomainAlias{Name: AliasPrefix + x.ID}
		}
		cs = append(cs, c)
	}
	// libvirt hands a port's chassis and port to QEMU as chassis and port, and gives it
	// no slot: QEMU's slot stays 0, so the chassis alone must tell the ports apart
	// (QEMU refuses a second port in one chassis slot: "Can't add chassis slot, error
	// -16"). The plan's chassis/slot pairs share a chassis per unit; the controller
	// index is unique in the domain, and it is the chassis libvirt itself gives the
	// ports it adds. port is the PCIe Port Number (Link Capabilities): 0 for a root
	// port, 1 and on for a switch's downstream ports, the plan's slots.
	chassis := func(p GuestPort) *libvirtxml.DomainControllerPCITarget {
		if p.Chassis == 0 {
			return nil
		}
		return &libvirtxml.DomainControllerPCITarget{Chassis: ptr(uint(p.Index)), Port: ptr(uint(p.Slot))}
	}
	for _, u := range g.Units {
		rp := u.RootPort
		if g.Placed {
			// A placed root port's chassis and port are libvirt's to choose.
			rp.Chassis = 0
		}
		add(rp.ID, rp, "pcie-root-port", "pcie-root-port", chassis(rp))
		add(u.Upstream.ID, u.Upstream, "pcie-switch-upstream-port", "x3130-upstream", nil)
		for _, f := range u.Functions {
			add(f.Port.ID, f.Port, "pcie-switch-downstream-port", "xio3130-downstream", chassis(f.Port))
		}
	}
	return cs
}

// LibvirtAddress is the function's guest address as libvirt writes it: device 0 of its
// downstream port's bus (the port's controller index).
func (f GuestFunction) LibvirtAddress() *libvirtxml.DomainAddress {
	return &libvirtxml.DomainAddress{PCI: libvirtAddr(pci.Address{Bus: uint8(f.Port.Index)})}
}

func ptr[T any](v T) *T { return &v }

// NCCL topology XML (NCCL_TOPO_FILE), in the shape NCCL_TOPO_DUMP_FILE writes: one
// <cpu> per guest NUMA node, one <pci> per switch (named by its upstream port, as NCCL
// folds switches), the GPUs and NICs below it. NCCL fills the <gpu>/<nic> children at
// run time, matching the <pci> nodes by bus ID.
type ncclSystem struct {
	XMLName xml.Name  `xml:"system"`
	Version int       `xml:"version,attr"`
	CPUs    []ncclCPU `xml:"cpu"`
}

type ncclCPU struct {
	NUMAID int       `xml:"numaid,attr"`
	PCIs   []ncclPCI `xml:"pci"`
}

type ncclPCI struct {
	BusID           string    `xml:"busid,attr"`
	Class           string    `xml:"class,attr"`
	Vendor          string    `xml:"vendor,attr"`
	Device          string    `xml:"device,attr"`
	SubsystemVendor string    `xml:"subsystem_vendor,attr"`
	SubsystemDevice string    `xml:"subsystem_device,attr"`
	LinkSpeed       string    `xml:"link_speed,attr"`
	LinkWidth       int       `xml:"link_width,attr"`
	GPU             *ncclGPU  `xml:"gpu"`
	PCIs            []ncclPCI `xml:"pci"`
}

// ncclGPU is a GPU's own node, written only to carry its NVLinks: NCCL fills dev and sm
// when they are left out, and asks NVML for NVLinks only when the node has none
// (ncclTopoGetXmlFromGpu, src/graph/xml.cc).
type ncclGPU struct {
	NVLinks []ncclNVLink `xml:"nvlink"`
}

// ncclNVLink is one <nvlink> as NCCL_TOPO_DUMP_FILE writes it in a Blackwell guest, where
// the NVSwitches are not PCI devices: target ncclNVSwitchTarget, tclass
// ncclNVSwitchClass, count the GPU's links. NCCL joins every GPU with such a link to one
// NVSwitch node (ncclTopoAddNvLinks, src/graph/topo.cc).
type ncclNVLink struct {
	Target string `xml:"target,attr"`
	Count  int    `xml:"count,attr"`
	TClass string `xml:"tclass,attr"`
}

// The NVSwitch an NVLink reaches in a guest, as NCCL writes it (testdata/realworld/
// guest-b200x8-nccl-topo.xml): no PCI device, the bus ID NVML gives for a remote end the
// guest cannot see, and the class NCCL reads as an NVSwitch (PCI class 0x0680, "other
// bridge").
const (
	ncclNVSwitchTarget = "fffffff:ff:ff.0"
	ncclNVSwitchClass  = "0x068000"
)

// NCCLOptions are what the NCCL file says beyond the plan's PCIe tree.
type NCCLOptions struct {
	// NVLinks, when above 0, says the guest's GPUs are exactly one NVLink partition of
	// the node's NVSwitch fabric, each GPU with this many NVLinks to it. A file holds one
	// NVSwitch (NCCL has one), so a guest whose GPUs are not one partition gets none:
	// NCCL then asks NVML, as without a file.
	NVLinks int
}

// sysfsSpeed writes a link speed as sysfs current_link_speed does ("32.0 GT/s PCIe"),
// the form NCCL parses.
func sysfsSpeed(l Link) string {
	switch l.GTs {
	case 0:
		return ""
	case 2.5:
		return "2.5 GT/s PCIe"
	}
	return fmt.Sprintf("%.1f GT/s PCIe", l.GTs)
}

// NCCLTopology renders the NCCL topology file. It carries the host's real link speeds
// and widths (Gen6 x16 GPU-NIC, Gen5 x16 to the CPU on B300): QEMU's emulated switch
// ports report 2.5 GT/s x1, and NCCL would size its paths from that.
func (g *Guest) NCCLTopology() ([]byte, error) { return g.NCCLTopologyWith(NCCLOptions{}) }

// NCCLTopologyWith is NCCLTopology with what the PCIe tree cannot show: the GPUs'
// NVLinks when they form one partition.
func (g *Guest) NCCLTopologyWith(o NCCLOptions) ([]byte, error) {
	sys := ncclSystem{Version: 1}
	cpus := map[int]int{}
	for _, u := range g.Units {
		node := 0
		if g.NUMA {
			node = u.GuestNUMA
		}
		ci, ok := cpus[node]
		if !ok {
			ci = len(sys.CPUs)
			cpus[node] = ci
			sys.CPUs = append(sys.CPUs, ncclCPU{NUMAID: node})
		}
		sw := ncclPCI{BusID: u.Upstream.Addr.String(), Class: "0x060400", Vendor: "0x104c", Device: "0x8232",
			SubsystemVendor: "0x0000", SubsystemDevice: "0x0000", LinkSpeed: sysfsSpeed(u.UpLink), LinkWidth: u.UpLink.Width}
		for _, f := range u.Functions {
			if f.Role != RoleGPU && f.Role != RoleGPUNIC && f.Role != RoleDataDirect {
				continue // NCCL has no use for the NVMe
			}
			h, l := f.Host, f.Host.Link
			p := ncclPCI{BusID: f.Addr.String(), Class: fmt.Sprintf("0x%06x", h.Class),
				Vendor: fmt.Sprintf("0x%04x", h.Vendor), Device: fmt.Sprintf("0x%04x", h.Device),
				SubsystemVendor: fmt.Sprintf("0x%04x", h.SubsystemVendor), SubsystemDevice: fmt.Sprintf("0x%04x", h.SubsystemDevice),
				LinkSpeed: sysfsSpeed(l), LinkWidth: l.Width}
			if f.Role == RoleGPU && o.NVLinks > 0 {
				p.GPU = &ncclGPU{NVLinks: []ncclNVLink{{Target: ncclNVSwitchTarget, Count: o.NVLinks, TClass: ncclNVSwitchClass}}}
			}
			sw.PCIs = append(sw.PCIs, p)
		}
		sys.CPUs[ci].PCIs = append(sys.CPUs[ci].PCIs, sw)
	}
	out, err := xml.MarshalIndent(sys, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("nccl topology xml: %w", err)
	}
	return append(out, '\n'), nil
}
