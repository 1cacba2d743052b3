package pcitest

import (
	"fmt"

	"github.com/passage-boot/passage/pci"
)

// PCI IDs of the reference nodes (B300.md).
const (
	VendorNVIDIA   = 0x10de
	VendorMellanox = 0x15b3
	VendorBroadcom = 0x1000
	VendorIntel    = 0x8086
	VendorSamsung  = 0x144d
	VendorBCMNet   = 0x14e4

	DevB300         = 0x3182 // GB110 [B300 SXM6 AC]
	DevB200         = 0x2901 // GB100 [B200]
	DevCX8          = 0x1023 // ConnectX-8
	DevCX7          = 0x1021 // ConnectX-7
	DevCX8Bridge    = 0x197c // mlx5Gen PCIe Bridge (the switch inside ConnectX-8)
	DevCX8DD        = 0x2100 // ConnectX-8 data-direct function
	DevPEX890xx     = 0xc030 // Broadcom PEX890xx Gen5 switch
	DevBCMHolder    = 0x02b2 // Broadcom Virtual PCIe Placeholder Endpoint
	DevBCMMgmt      = 0x00b2 // Broadcom switch management endpoint
	DevPM9A3        = 0xa80a // Samsung PM9A3 NVMe
	DevNVSwitch     = 0x22a3 // NVSwitch management function
	DevRootPort     = 0x352a // Xeon root port
	DevBCM57414     = 0x16d7 // Broadcom NetXtreme-E, the management NIC
	DevCX8VF        = 0x101e // ConnectX virtual function
	ClassGPU        = 0x030200
	ClassEthernet   = 0x020000
	ClassInfiniBand = 0x020700
	ClassNVMe       = 0x010802
	ClassBridge     = 0x060400
	ClassOther      = 0x068000 // bridge, other: NVSwitch management
	ClassHolder     = 0x0b4000 // co-processor: Broadcom placeholder / mgmt endpoint
)

// Link speeds.
const (
	Gen4 = 4
	Gen5 = 5
	Gen6 = 6
)

var (
	gen5x16 = Link{Speed: Gen5, Width: 16}
	gen6x16 = Link{Speed: Gen6, Width: 16}
	gen4x4  = Link{Speed: Gen4, Width: 4}
	// kernelACS is what Linux leaves in ACS Control once an IOMMU is on: SV RR CR UF of
	// what the port advertises (pci_std_enable_acs).
	portACS  = &ACS{Cap: pci.ACSSV | pci.ACSTB | pci.ACSRR | pci.ACSCR | pci.ACSUF | pci.ACSDT, Ctl: pci.ACSIsolation}
	rootACS  = &ACS{Cap: pci.ACSIsolation, Ctl: pci.ACSIsolation}
	bcmDSACS = &ACS{Cap: pci.ACSSV | pci.ACSTB | pci.ACSRR | pci.ACSCR | pci.ACSUF | pci.ACSDT, Ctl: pci.ACSIsolation}
)

// BAR sizes of the reference nodes. A B300 carries 288 GB of HBM, and its frame-buffer
// BAR (BAR1) is the power of two above it, 512 GiB; a B200's 180 GB make 256 GiB (the
// issue this models, citing a public B200 write-up). The rest of the GPU's layout is
// that of NVIDIA's GPUs in testdata/realworld/host-cx7-lspci-vvv.txt (BAR0 32-bit
// non-prefetchable registers, BAR1 and BAR3 64-bit prefetchable), without the I/O BAR
// (GPUs of the SXM parts have none); BAR0's 64 MiB and BAR3's 32 MiB, ConnectX's 32 MiB
// BAR0 and the PM9A3's 32 KiB are the sizes lspci shows on their predecessors, not read
// from a B300 node.
var (
	B300GPUBARs = []BAR{{Index: 0, Size: 64 << 20}, {Index: 1, Size: 512 << 30, Is64: true, Prefetch: true}, {Index: 3, Size: 32 << 20, Is64: true, Prefetch: true}}
	B200GPUBARs = []BAR{{Index: 0, Size: 64 << 20}, {Index: 1, Size: 256 << 30, Is64: true, Prefetch: true}, {Index: 3, Size: 32 << 20, Is64: true, Prefetch: true}}
	CXBARs      = []BAR{{Index: 0, Size: 32 << 20, Is64: true, Prefetch: true}}
	NVMeBARs    = []BAR{{Index: 0, Size: 32 << 10, Is64: true}}
	// BCM57414: BAR0 64 KiB, BAR2 1 MiB, BAR4 8 KiB, all 64-bit prefetchable.
	MgmtNICBARs  = []BAR{{Index: 0, Size: 64 << 10, Is64: true, Prefetch: true}, {Index: 2, Size: 1 << 20, Is64: true, Prefetch: true}, {Index: 4, Size: 8 << 10, Is64: true, Prefetch: true}}
	NVSwitchBARs = []BAR{{Index: 0, Size: 32 << 20}}
)

// B300GPUBuses are the root buses of the eight GPU complexes: four per NUMA node, the
// last one laid out as B300.md's lspci -t excerpt ([eb-f4] below root port ea:02.0).
var B300GPUBuses = [8]uint8{0x15, 0x2a, 0x3f, 0x54, 0x96, 0xab, 0xc0, 0xea}

// B300Unit is one GPU complex of an HGX B300, exactly as B300.md's lspci -t shows it:
//
//	root port 02.0 - Broadcom PEX890xx upstream port
//	  +-00.0 Mellanox virtual port - CX-8 switch upstream port (15b3:197c)
//	  |     +-00.0 downstream port (DT goes here) - CX-8 PF0 00.0, PF1 00.1
//	  |     \-02.0 downstream port - nested switch upstream - downstream - GPU
//	  +-01.0 - Broadcom Virtual PCIe Placeholder Endpoint
//	  \-02.0 - NVMe
func B300Unit(i int) Fn {
	cx8 := func(fn uint8) Fn {
		return Fn{Name: fmt.Sprintf("nic%d.%d", i, fn), Dev: 0, Func: fn, Vendor: VendorMellanox, Device: DevCX8,
			SubVendor: VendorMellanox, SubDevice: 0x0023, Class: ClassEthernet, Port: pci.PortEndpoint,
			Link: gen6x16, ATS: &ATS{}, Driver: "mlx5_core", BARs: CXBARs,
			VPD: &pci.VPD{Name: "NVIDIA ConnectX-8 SuperNIC", Keywords: map[string]string{
				"PN": "900-9X81E-00EX-ST0", "SN": fmt.Sprintf("MT2450X%05d", 1000+i), "V3": fmt.Sprintf("c8a1b2c3d4e5f6%02d", i), "EC": "A1"}}}
	}
	bridge := func(name string, dev uint8, vendor, device uint16, port pci.PortType, link Link, acs *ACS, below ...Fn) Fn {
		return Fn{Name: name, Dev: dev, Vendor: vendor, Device: device, Class: ClassBridge, Port: port, Link: link, ACS: acs, Driver: "pcieport", Below: below}
	}
	gpu := Fn{Name: fmt.Sprintf("gpu%d", i), Vendor: VendorNVIDIA, Device: DevB300, SubVendor: VendorNVIDIA, SubDevice: 0x2101,
		Class: ClassGPU, Rev: 0xa1, Port: pci.PortEndpoint, Link: gen6x16, Driver: "nvidia", BARs: B300GPUBARs}
	nvme := Fn{Name: fmt.Sprintf("nvme%d", i), Vendor: VendorSamsung, Device: DevPM9A3, SubVendor: VendorSamsung, SubDevice: 0xa813,
		Class: ClassNVMe, Port: pci.PortEndpoint, Link: gen4x4, Driver: "nvme", BARs: NVMeBARs}
	holder := Fn{Name: fmt.Sprintf("holder%d", i), Vendor: VendorBroadcom, Device: DevBCMHolder, SubVendor: VendorBroadcom, SubDevice: 0xa064,
		Class: ClassHolder, Port: pci.PortEndpoint, Link: gen5x16}
	n := func(s string) string { return fmt.Sprintf("%s%d", s, i) }
	return bridge(n("rp"), 2, VendorIntel, DevRootPort, pci.PortRootPort, gen5x16, rootACS,
		bridge(n("bcm-usp"), 0, VendorBroadcom, DevPEX890xx, pci.PortUpstream, gen5x16, nil,
			bridge(n("bcm-dsp-cx"), 0, VendorMellanox, DevCX8Bridge, pci.PortDownstream, gen6x16, bcmDSACS,
				bridge(n("cx-usp"), 0, VendorMellanox, DevCX8Bridge, pci.PortUpstream, gen6x16, nil,
					bridge(n("cx-dsp-nic"), 0, VendorMellanox, DevCX8Bridge, pci.PortDownstream, gen6x16, portACS,
						cx8(0), cx8(1)),
					bridge(n("cx-dsp-gpu"), 2, VendorMellanox, DevCX8Bridge, pci.PortDownstream, gen6x16, portACS,
						bridge(n("gpu-usp"), 0, VendorMellanox, DevCX8Bridge, pci.PortUpstream, gen6x16, nil,
							bridge(n("gpu-dsp"), 0, VendorMellanox, DevCX8Bridge, pci.PortDownstream, gen6x16, portACS,
								gpu))))),
			bridge(n("bcm-dsp-holder"), 1, VendorBroadcom, DevPEX890xx, pci.PortDownstream, gen5x16, bcmDSACS, holder),
			bridge(n("bcm-dsp-nvme"), 2, VendorBroadcom, DevPEX890xx, pci.PortDownstream, gen4x4, bcmDSACS, nvme)))
}

// MgmtNIC is a management NIC on its own root port.
func MgmtNIC(name string, dev uint8, vendor, device uint16) Fn {
	return Fn{Name: "rp-" + name, Dev: dev, Vendor: VendorIntel, Device: DevRootPort, Class: ClassBridge, Port: pci.PortRootPort,
		Link: Link{Speed: Gen4, Width: 8}, ACS: rootACS, Driver: "pcieport", Below: []Fn{{
			Name: name, Vendor: vendor, Device: device, SubVendor: vendor, SubDevice: 0x1402, Class: ClassEthernet,
			Port: pci.PortEndpoint, Link: Link{Speed: Gen4, Width: 8}, Driver: "bnxt_en", BARs: MgmtNICBARs}}}
}

// B300 is the reference HGX B300 node: eight GPU complexes on two NUMA nodes, two
// management NICs on their own root ports, four NVSwitch management functions behind a
// switch of their own.
func B300() Spec {
	var s Spec
	s.Hosts = append(s.Hosts, Host{Bus: 0x00, NUMA: 0, Fns: []Fn{
		MgmtNIC("mgmt0", 1, VendorBCMNet, DevBCM57414),
		MgmtNIC("mgmt1", 3, VendorBCMNet, DevBCM57414),
	}})
	for i, bus := range B300GPUBuses {
		s.Hosts = append(s.Hosts, Host{Bus: bus, NUMA: i / 4, Fns: []Fn{B300Unit(i)}})
	}
	var sw []Fn
	for k := 0; k < 4; k++ {
		sw = append(sw, Fn{Name: fmt.Sprintf("nvsw-dsp%d", k), Dev: uint8(k), Vendor: VendorBroadcom, Device: DevPEX890xx, Class: ClassBridge,
			Port: pci.PortDownstream, Link: Link{Speed: Gen4, Width: 2}, ACS: bcmDSACS, Driver: "pcieport", Below: []Fn{{
				Name: fmt.Sprintf("nvswitch%d", k), Vendor: VendorNVIDIA, Device: DevNVSwitch, SubVendor: VendorNVIDIA, SubDevice: 0x1796,
				Class: ClassOther, Port: pci.PortEndpoint, Link: Link{Speed: Gen4, Width: 2}, Driver: "nvidia-nvswitch", BARs: NVSwitchBARs}}})
	}
	s.Hosts = append(s.Hosts, Host{Bus: 0x80, NUMA: 1, Fns: []Fn{{
		Name: "rp-nvsw", Dev: 1, Vendor: VendorIntel, Device: DevRootPort, Class: ClassBridge, Port: pci.PortRootPort,
		Link: Link{Speed: Gen4, Width: 8}, ACS: rootACS, Driver: "pcieport", Below: []Fn{{
			Name: "nvsw-usp", Vendor: VendorBroadcom, Device: DevPEX890xx, Class: ClassBridge, Port: pci.PortUpstream,
			Link: Link{Speed: Gen4, Width: 8}, Driver: "pcieport", Below: sw}}}}})
	return s
}

// B200Unit is one HGX B200 GPU complex: GPU, ConnectX-7, NVMe and the Broadcom switch's
// management endpoint as siblings below one PEX890xx switch.
func B200Unit(i int) Fn {
	dsp := func(name string, dev uint8, link Link, below Fn) Fn {
		return Fn{Name: name, Dev: dev, Vendor: VendorBroadcom, Device: DevPEX890xx, Class: ClassBridge, Port: pci.PortDownstream,
			Link: link, ACS: bcmDSACS, Driver: "pcieport", Below: []Fn{below}}
	}
	n := func(s string) string { return fmt.Sprintf("%s%d", s, i) }
	return Fn{Name: n("rp"), Dev: 1, Vendor: VendorIntel, Device: DevRootPort, Class: ClassBridge, Port: pci.PortRootPort,
		Link: gen5x16, ACS: rootACS, Driver: "pcieport", Below: []Fn{{
			Name: n("bcm-usp"), Vendor: VendorBroadcom, Device: DevPEX890xx, Class: ClassBridge, Port: pci.PortUpstream,
			Link: gen5x16, Driver: "pcieport", Below: []Fn{
				dsp(n("bcm-dsp-gpu"), 0, gen5x16, Fn{Name: n("gpu"), Vendor: VendorNVIDIA, Device: DevB200, SubVendor: VendorNVIDIA,
					SubDevice: 0x1999, Class: ClassGPU, Port: pci.PortEndpoint, Link: gen5x16, Driver: "nvidia", BARs: B200GPUBARs}),
				dsp(n("bcm-dsp-nic"), 1, gen5x16, Fn{Name: n("nic") + ".0", Vendor: VendorMellanox, Device: DevCX7,
					SubVendor: VendorMellanox, SubDevice: 0x0051, Class: ClassEthernet, Port: pci.PortEndpoint, Link: gen5x16,
					ATS: &ATS{}, Driver: "mlx5_core", BARs: CXBARs}),
				dsp(n("bcm-dsp-nvme"), 2, gen4x4, Fn{Name: n("nvme"), Vendor: VendorSamsung, Device: DevPM9A3, SubVendor: VendorSamsung,
					SubDevice: 0xa813, Class: ClassNVMe, Port: pci.PortEndpoint, Link: gen4x4, Driver: "nvme", BARs: NVMeBARs}),
				dsp(n("bcm-dsp-mgmt"), 0x1f, gen4x4, Fn{Name: n("bcm-mgmt"), Vendor: VendorBroadcom, Device: DevBCMMgmt,
					SubVendor: VendorBroadcom, SubDevice: 0xa064, Class: ClassHolder, Port: pci.PortEndpoint, Link: gen4x4}),
			}}}}
}

// B200GPUBuses are the root buses of the B200 reference's GPU complexes (the last as in
// B300.md: [98-9d] below root port 97:01.0).
var B200GPUBuses = [8]uint8{0x15, 0x2a, 0x3f, 0x54, 0x83, 0x97, 0xab, 0xc0}

// B200 is the reference HGX B200 node.
func B200() Spec {
	var s Spec
	s.Hosts = append(s.Hosts, Host{Bus: 0x00, NUMA: 0, Fns: []Fn{
		MgmtNIC("mgmt0", 1, VendorBCMNet, DevBCM57414),
		MgmtNIC("mgmt1", 3, VendorBCMNet, DevBCM57414),
	}})
	for i, bus := range B200GPUBuses {
		s.Hosts = append(s.Hosts, Host{Bus: bus, NUMA: i / 4, Fns: []Fn{B200Unit(i)}})
	}
	return s
}

// SRIOVNode is a node of ConnectX-8 adapters with SR-IOV on: units root ports on host bus
// 0, each above one CX-8 whose PF0 and PF1 carry vfs0 and vfs1 VFs. It has
// units*(3+vfs0+vfs1) functions: SRIOVNode(8, 255, 254) has 4096.
func SRIOVNode(units, vfs0, vfs1 int) Spec {
	pf := func(i int, fn uint8, vfs int) Fn {
		return Fn{Name: fmt.Sprintf("nic%d.%d", i, fn), Func: fn, Vendor: VendorMellanox, Device: DevCX8,
			SubVendor: VendorMellanox, SubDevice: 0x0023, Class: ClassEthernet, Port: pci.PortEndpoint,
			Link: gen6x16, ATS: &ATS{}, Driver: "mlx5_core", BARs: CXBARs,
			SRIOV: &SRIOV{Total: vfs, Num: vfs, VFDevice: DevCX8VF, VFDriver: "mlx5_core"}}
	}
	var fns []Fn
	for i := 0; i < units; i++ {
		fns = append(fns, Fn{Name: fmt.Sprintf("rp%d", i), Dev: uint8(i + 1), Vendor: VendorIntel, Device: DevRootPort,
			Class: ClassBridge, Port: pci.PortRootPort, Link: gen5x16, ACS: rootACS, Driver: "pcieport",
			Below: []Fn{pf(i, 0, vfs0), pf(i, 1, vfs1)}})
	}
	return Spec{Hosts: []Host{{Bus: 0, NUMA: 0, Fns: fns}}}
}

// SWMngVA is the VPD keyword VA of an NVSwitch bridge's limited PF on HGX B200/B300:
// ConnectX's colon-separated vendor fields with SMDL=SW_MNG among them (FM User Guide,
// "NVIDIA HGX B200/B300 GPU Baseboard"; the field layout as ConnectX-7 adapters show it
// under lspci -vvv, and as kata-containers/pcilibs-rs src/nvlink.rs tests it). No B300
// node's VPD was available: MODL here, and the bridge's PN and SN below, are made up.
const SWMngVA = "MLX:MN=MLNX:CSKU=V2:UUID=V3:PCI=V0:SMDL=SW_MNG:MODL=CX7NVSW"

// NVSwitchBridge is the ConnectX-7 bridge integrated in an HGX B200/B300 baseboard, below
// a Broadcom downstream port at dev: two ports, each exposing a limited PF that carries
// SMDL=SW_MNG in its VPD (nvsw-lpf0 at 00.0, nvsw-lpf1 at 00.1) and a full-capability PF
// that does not (nvsw-fc0 at 00.2, nvsw-fc1 at 00.3), all 15b3:1021 InfiniBand
// functions on mlx5_core (FM User Guide). Which function is which is not published; the
// order is pcilibs-rs's test layout.
func NVSwitchBridge(dev uint8) Fn {
	pf := func(name string, fn uint8, va string) Fn {
		return Fn{Name: name, Func: fn, Vendor: VendorMellanox, Device: DevCX7, SubVendor: VendorMellanox, SubDevice: 0x0051,
			Class: ClassInfiniBand, Port: pci.PortEndpoint, Link: gen5x16, Driver: "mlx5_core", BARs: CXBARs,
			VPD: &pci.VPD{Name: "NVIDIA ConnectX-7 NVSwitch bridge", Keywords: map[string]string{
				"PN": "900-2G133-0000-000", "SN": fmt.Sprintf("MT2420X%05d", 9000+int(fn)), "VA": va}}}
	}
	const fc = "MLX:MN=MLNX:CSKU=V2:UUID=V3:PCI=V0:MODL=CX7NVSW"
	return Fn{Name: "nvsw-bridge-dsp", Dev: dev, Vendor: VendorBroadcom, Device: DevPEX890xx, Class: ClassBridge,
		Port: pci.PortDownstream, Link: gen5x16, ACS: bcmDSACS, Driver: "pcieport", Below: []Fn{
			pf("nvsw-lpf0", 0, SWMngVA), pf("nvsw-lpf1", 1, SWMngVA), pf("nvsw-fc0", 2, fc), pf("nvsw-fc1", 3, fc)}}
}

// NVSwitchBridgeFns names the bridge's four PFs.
var NVSwitchBridgeFns = []string{"nvsw-lpf0", "nvsw-lpf1", "nvsw-fc0", "nvsw-fc1"}

// WithNVSwitchBridge adds the NVSwitch bridge (NVSwitchBridge) to a B300 or B200
// reference spec below the Broadcom switch of GPU complex 0, beside the unit's own
// functions: where it shares a root port and a switch with a unit, so that a reset
// reaching past the unit's functions would reach it. Where the bridge sits on a real
// baseboard is not published.
func WithNVSwitchBridge(s Spec) Spec {
	usp := s.Fn("bcm-usp0")
	usp.Below = append(usp.Below, NVSwitchBridge(3))
	return s
}
