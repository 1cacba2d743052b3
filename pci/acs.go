package pci

import (
	"fmt"
	"strings"
)

// ACSBits are the ACS Capability and Control register bits (PCIe 6.0 7.7.8; the kernel's
// PCI_ACS_*).
type ACSBits uint16

const (
	ACSSV ACSBits = 0x0001 // Source Validation
	ACSTB ACSBits = 0x0002 // Translation Blocking
	ACSRR ACSBits = 0x0004 // P2P Request Redirect
	ACSCR ACSBits = 0x0008 // P2P Completion Redirect
	ACSUF ACSBits = 0x0010 // Upstream Forwarding
	ACSEC ACSBits = 0x0020 // P2P Egress Control
	ACSDT ACSBits = 0x0040 // Direct Translated P2P

	// ACSIsolation is what the kernel requires on every port on a path for a device to
	// get an IOMMU group of its own (REQ_ACS_FLAGS in drivers/iommu/iommu.c).
	ACSIsolation = ACSSV | ACSRR | ACSCR | ACSUF
	// acsDefined are the seven flag bits; the capability register's high byte is the
	// egress control vector size, not flags.
	acsDefined ACSBits = 0x7f
)

// ACS register offsets within the extended capability.
const (
	ACSCapReg = 0x04
	ACSCtlReg = 0x06
)

var acsNames = []struct {
	bit  ACSBits
	name string // lspci's word
	flag string // the kernel's pci=config_acs= position name
}{
	{ACSSV, "SrcValid", "SV"},
	{ACSTB, "TransBlk", "TB"},
	{ACSRR, "ReqRedir", "RR"},
	{ACSCR, "CmpltRedir", "CR"},
	{ACSUF, "UpstreamFwd", "UF"},
	{ACSEC, "EgressCtrl", "EC"},
	{ACSDT, "DirectTrans", "DT"},
}

// Lspci renders the bits the way lspci -vvv prints ACSCap/ACSCtl:
// "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-".
func (b ACSBits) Lspci() string {
	parts := make([]string, len(acsNames))
	for i, n := range acsNames {
		s := "-"
		if b&n.bit != 0 {
			s = "+"
		}
		parts[i] = n.name + s
	}
	return strings.Join(parts, " ")
}

// String lists the set flags by their spec abbreviations ("SV RR CR UF DT"), or "none".
func (b ACSBits) String() string {
	var parts []string
	for _, n := range acsNames {
		if b&n.bit != 0 {
			parts = append(parts, n.flag)
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}

// ACS is the decoded Access Control Services extended capability.
type ACS struct {
	Offset     int
	Cap        ACSBits // ACS Capability register, flag bits only
	Ctl        ACSBits // ACS Control register
	EgressSize int     // Egress Control Vector Size (cap bits 15:8; 0 means 256 when EC is set)
}

// CtlOffset is the config-space offset of the 16-bit ACS Control register.
func (a *ACS) CtlOffset() int { return a.Offset + ACSCtlReg }

func decodeACS(c Config, off int) (*ACS, error) {
	if !c.has(off+ACSCtlReg, 2) {
		return nil, fmt.Errorf("acs capability at 0x%03x truncated", off)
	}
	capReg := c.r16(off + ACSCapReg)
	return &ACS{
		Offset:     off,
		Cap:        ACSBits(capReg) & acsDefined,
		Ctl:        ACSBits(c.r16(off + ACSCtlReg)),
		EgressSize: int(capReg >> 8),
	}, nil
}

// ATS is the decoded Address Translation Services extended capability. Its presence on a
// ConnectX-8 function means the firmware has ATS enabled; Enable is set by the IOMMU
// driver when the device is attached to a translating domain.
type ATS struct {
	Offset      int
	QueueDepth  int  // Invalidate Queue Depth (0 encodes 32)
	PageAligned bool // Page Aligned Request
	GlobalInval bool // Global Invalidate Supported
	Enable      bool // ATS Control bit 15
	STU         int  // Smallest Translation Unit (ATS Control bits 4:0)
}

// ATS register offsets within the extended capability.
const (
	ATSCapReg = 0x04
	ATSCtlReg = 0x06
)

func decodeATS(c Config, off int) (*ATS, error) {
	if !c.has(off+ATSCtlReg, 2) {
		return nil, fmt.Errorf("ats capability at 0x%03x truncated", off)
	}
	capReg := c.r16(off + ATSCapReg)
	ctl := c.r16(off + ATSCtlReg)
	return &ATS{
		Offset:      off,
		QueueDepth:  int(capReg & 0x1f),
		PageAligned: capReg&0x20 != 0,
		GlobalInval: capReg&0x40 != 0,
		Enable:      ctl&0x8000 != 0,
		STU:         int(ctl & 0x1f),
	}, nil
}

// SRIOV is the decoded Single Root I/O Virtualization extended capability.
type SRIOV struct {
	Offset     int
	VFEnable   bool
	InitialVFs int
	TotalVFs   int
	NumVFs     int
	FirstVF    int // First VF Offset (routing ID offset from the PF)
	VFStride   int
	VFDeviceID uint16
}

// SR-IOV register offsets within the extended capability (PCI_SRIOV_*).
const (
	SRIOVCtl      = 0x08
	SRIOVInitial  = 0x0c
	SRIOVTotal    = 0x0e
	SRIOVNum      = 0x10
	SRIOVVFOffset = 0x14
	SRIOVVFStride = 0x16
	SRIOVVFDID    = 0x1a
)

func decodeSRIOV(c Config, off int) (*SRIOV, error) {
	if !c.has(off+SRIOVVFDID, 2) {
		return nil, fmt.Errorf("sr-iov capability at 0x%03x truncated", off)
	}
	return &SRIOV{
		Offset:     off,
		VFEnable:   c.r16(off+SRIOVCtl)&1 != 0,
		InitialVFs: int(c.r16(off + SRIOVInitial)),
		TotalVFs:   int(c.r16(off + SRIOVTotal)),
		NumVFs:     int(c.r16(off + SRIOVNum)),
		FirstVF:    int(c.r16(off + SRIOVVFOffset)),
		VFStride:   int(c.r16(off + SRIOVVFStride)),
		VFDeviceID: c.r16(off + SRIOVVFDID),
	}, nil
}

// MarshalText writes a register value as JSON carries it everywhere passage prints one:
// "0x005d", the form setpci and lspci -x use.
func (b ACSBits) MarshalText() ([]byte, error) { return []byte(fmt.Sprintf("0x%04x", uint16(b))), nil }

// UnmarshalText reads what MarshalText writes.
func (b *ACSBits) UnmarshalText(t []byte) error {
	var v uint16
	if _, err := fmt.Sscanf(string(t), "0x%04x", &v); err != nil {
		return fmt.Errorf("acs bits %q: want 0xNNNN", t)
	}
	*b = ACSBits(v)
	return nil
}
