package pci

import (
	"fmt"
	"strings"
)

// Device is one PCI function. IDs, header fields and capabilities come from config space;
// the rest from the function's sysfs directory, named beside each field.
type Device struct {
	Addr    Address
	SysPath string // resolved /sys/devices/... path relative to the scan root; empty for dumps

	Parent   *Device   // the bridge whose secondary bus this function sits on; nil on a root bus
	Children []*Device // functions on this bridge's secondary bus, in address order

	VendorID        uint16 // config 0x00 (sysfs vendor)
	DeviceID        uint16 // config 0x02 (sysfs device)
	SubsystemVendor uint16 // config 0x2c, type 0 (sysfs subsystem_vendor)
	SubsystemDevice uint16 // config 0x2e, type 0 (sysfs subsystem_device)
	Class           uint32 // config 0x09..0x0b: base, sub, prog-if (sysfs class)
	Revision        uint8  // config 0x08 (sysfs revision)
	HeaderType      uint8  // config 0x0e bits 6:0
	MultiFunction   bool   // config 0x0e bit 7

	// Bridge bus numbers (type 1 header).
	PrimaryBus, SecondaryBus, SubordinateBus uint8

	NUMANode       int    // /sys/bus/pci/devices/<bdf>/numa_node; -1 when none
	Driver         string // basename of the <bdf>/driver link; "" when unbound
	DriverOverride string // <bdf>/driver_override; "" when "(null)" or absent
	IOMMUGroup     int    // basename of the <bdf>/iommu_group link; -1 when none
	VPD            *VPD   // <bdf>/vpd, when present and readable

	Config  Config       // <bdf>/config
	Caps    []Capability // standard capability list
	ExtCaps []Capability // extended capability list (from 0x100)
	Express *Express     // PCI Express capability
	ACS     *ACS         // ACS extended capability
	ATS     *ATS         // ATS extended capability
	SRIOV   *SRIOV       // SR-IOV extended capability

	// BARs are the function's Base Address Registers, in index order: flags and (in a
	// dump) addresses from config 0x10..0x27, sizes and assigned addresses from
	// <bdf>/resource.
	BARs []BAR

	// Problems are what could not be read or decoded for this function. The function is
	// kept with what was read: bad input loses nothing.
	Problems []string

	// CapsUnknown says why the standard capability list could not be read whole, ""
	// when it was: config space unreadable, truncated, all ones or all zeros, or a list
	// that is malformed (a pointer loop, a pointer into the header, an unaligned
	// pointer). A capability missing from such a list is unknown, not absent: without
	// an Express capability found, whether the function is PCI Express is unknown
	// (ExpressKnown), so a bridge is not thereby a conventional PCI bridge.
	// ExtCapsUnknown is the same for the extended list: ACS, ATS and SR-IOV nil with it
	// set are unknown, not absent. Both are set in decodeConfig (config.go).
	CapsUnknown    string
	ExtCapsUnknown string
}

// IsBridge says whether the function has a type 1 (PCI-PCI bridge) header.
func (d *Device) IsBridge() bool { return d.HeaderType == HeaderTypeBridge }

// PortType is the Express port type, or false for a conventional PCI function.
func (d *Device) PortType() (PortType, bool) {
	if d.Express == nil {
		return 0, false
	}
	return d.Express.Type, true
}

// VFs returns the addresses of the SR-IOV virtual functions the function's SR-IOV
// capability has enabled: routing ID + First VF Offset + i * VF Stride for i below NumVFs
// (SR-IOV 1.1 3.3.10-11), in the function's domain. It stops at a routing ID past bus 255
// and at a zero offset or stride, which no enabled PF has; nil without VFs enabled.
func (d *Device) VFs() []Address {
	sr := d.SRIOV
	if sr == nil || !sr.VFEnable || sr.NumVFs == 0 || sr.FirstVF == 0 {
		return nil
	}
	rid := int(d.Addr.Bus)<<8 | int(d.Addr.Device)<<3 | int(d.Addr.Function)
	out := make([]Address, 0, sr.NumVFs)
	for i := 0; i < sr.NumVFs; i++ {
		v := rid + sr.FirstVF + i*sr.VFStride
		if v > 0xffff || i > 0 && sr.VFStride == 0 {
			break
		}
		out = append(out, Address{Domain: d.Addr.Domain, Bus: uint8(v >> 8), Device: uint8(v>>3) & 0x1f, Function: uint8(v) & 7})
	}
	return out
}

// IDs renders "vvvv:dddd" as lspci -n does.
func (d *Device) IDs() string { return fmt.Sprintf("%04x:%04x", d.VendorID, d.DeviceID) }

func (d *Device) String() string { return d.Addr.String() }

// Ancestors returns the bridges above the function, nearest first.
func (d *Device) Ancestors() []*Device {
	var out []*Device
	for p := d.Parent; p != nil; p = p.Parent {
		out = append(out, p)
	}
	return out
}

func (d *Device) problem(format string, args ...any) {
	d.Problems = append(d.Problems, fmt.Sprintf(format, args...))
}

// Err joins the function's problems into one error naming it, or nil.
func (d *Device) Err() error {
	if len(d.Problems) == 0 {
		return nil
	}
	return fmt.Errorf("%s: %s", d.Addr, strings.Join(d.Problems, "; "))
}
