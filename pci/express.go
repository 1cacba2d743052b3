package pci

import "fmt"

// PortType is the Device/Port Type field of the PCI Express Capabilities register
// (PCI_EXP_FLAGS_TYPE, PCIe 6.0 7.5.3.2).
type PortType uint8

const (
	PortEndpoint       PortType = 0x0
	PortLegacyEndpoint PortType = 0x1
	PortRootPort       PortType = 0x4
	PortUpstream       PortType = 0x5
	PortDownstream     PortType = 0x6
	PortPCIeToPCI      PortType = 0x7
	PortPCIToPCIe      PortType = 0x8
	PortRCiEP          PortType = 0x9
	PortRCEC           PortType = 0xa
)

// String uses lspci's words ("Root Port", "Downstream Port", ...).
func (t PortType) String() string {
	switch t {
	case PortEndpoint:
		return "Endpoint"
	case PortLegacyEndpoint:
		return "Legacy Endpoint"
	case PortRootPort:
		return "Root Port"
	case PortUpstream:
		return "Upstream Port"
	case PortDownstream:
		return "Downstream Port"
	case PortPCIeToPCI:
		return "PCI-Express to PCI/PCI-X Bridge"
	case PortPCIToPCIe:
		return "PCI/PCI-X to PCI-Express Bridge"
	case PortRCiEP:
		return "Root Complex Integrated Endpoint"
	case PortRCEC:
		return "Root Complex Event Collector"
	}
	return fmt.Sprintf("Unknown type %d", uint8(t))
}

// IsDownstreamFacing says whether the port forwards traffic to a bus below it that other
// functions share: root ports and switch downstream ports, where PCIe requires ACS for
// peer isolation (PCIe 6.0 6.12.1.1).
func (t PortType) IsDownstreamFacing() bool { return t == PortRootPort || t == PortDownstream }

// LinkSpeed is the encoded Link Speed field (LnkCap/LnkSta bits 3:0): 1 = 2.5 GT/s up to
// 6 = 64 GT/s (PCIe 6.0).
type LinkSpeed uint8

// String follows lspci's link_speed(): "2.5GT/s" ... "64GT/s", "unknown".
func (s LinkSpeed) String() string {
	switch s {
	case 1:
		return "2.5GT/s"
	case 2:
		return "5GT/s"
	case 3:
		return "8GT/s"
	case 4:
		return "16GT/s"
	case 5:
		return "32GT/s"
	case 6:
		return "64GT/s"
	}
	return "unknown"
}

// GTs is the raw rate in GT/s (0 when unknown).
func (s LinkSpeed) GTs() float64 {
	switch s {
	case 1:
		return 2.5
	case 2:
		return 5
	case 3:
		return 8
	case 4:
		return 16
	case 5:
		return 32
	case 6:
		return 64
	}
	return 0
}

// Express is the decoded PCI Express capability (PCI_CAP_ID_EXP).
type Express struct {
	Offset   int
	Version  uint8    // PCI_EXP_FLAGS_VERS
	Type     PortType // PCI_EXP_FLAGS_TYPE
	Slot     bool     // PCI_EXP_FLAGS_SLOT: a slot is implemented (ports only)
	LnkCap   uint32
	LnkSta   uint16
	HasLink  bool // a port type with a link, and the capability holds the link registers
	MaxSpeed LinkSpeed
	MaxWidth uint8
	Speed    LinkSpeed
	Width    uint8
	PortNum  uint8 // LnkCap bits 31:24
}

// Express register offsets within the capability.
const (
	ExpFlags  = 0x02
	ExpDevCap = 0x04
	ExpDevCtl = 0x08
	ExpLnkCap = 0x0c
	ExpLnkCtl = 0x10
	ExpLnkSta = 0x12
)

// decodeExpress reads the capability at off. Without its flags register (the read ended
// first) it returns nil and an error: the port type is unknown. Without the link
// registers a port type with a link has, it returns the capability with HasLink false
// and an error: past the bytes read, or past 0xff, where a standard capability cannot be
// (its link registers would be extended-space bytes, not its own).
func decodeExpress(c Config, off int) (*Express, error) {
	if !c.has(off+ExpFlags, 2) {
		return nil, fmt.Errorf("express capability at 0x%02x truncated: no flags register in the %d bytes read", off, len(c))
	}
	e := &Express{Offset: off}
	flags := c.r16(off + ExpFlags)
	e.Version = uint8(flags & 0xf)
	e.Type = PortType(flags >> 4 & 0xf)
	e.Slot = flags&0x100 != 0
	// Root Complex integrated endpoints and event collectors have no link: their link
	// registers are reserved (PCIe 6.0 7.5.3), and lspci's cap_express skips them.
	if e.Type == PortRCiEP || e.Type == PortRCEC {
		return e, nil
	}
	switch end := off + ExpLnkSta + 2; {
	case end > ConventionalSize:
		return e, fmt.Errorf("express capability at 0x%02x runs past 0xff: no link registers", off)
	case !c.has(off+ExpLnkSta, 2):
		return e, fmt.Errorf("express capability at 0x%02x truncated: no link registers in the %d bytes read", off, len(c))
	}
	e.HasLink = true
	e.LnkCap = c.r32(off + ExpLnkCap)
	e.LnkSta = c.r16(off + ExpLnkSta)
	e.MaxSpeed = LinkSpeed(e.LnkCap & 0xf)
	e.MaxWidth = uint8(e.LnkCap >> 4 & 0x3f)
	e.PortNum = uint8(e.LnkCap >> 24)
	e.Speed = LinkSpeed(e.LnkSta & 0xf)
	e.Width = uint8(e.LnkSta >> 4 & 0x3f)
	return e, nil
}
