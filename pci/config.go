package pci

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Config space layout (PCI Local Bus 3.0 ch. 6; PCIe Base 6.0 ch. 7). Names follow the
// kernel's include/uapi/linux/pci_regs.h.
const (
	ConfigVendorID      = 0x00
	ConfigDeviceID      = 0x02
	ConfigCommand       = 0x04
	ConfigStatus        = 0x06
	ConfigRevision      = 0x08
	ConfigClassProg     = 0x09
	ConfigHeaderType    = 0x0e
	ConfigSubsysVendor  = 0x2c // type 0 only
	ConfigSubsysID      = 0x2e // type 0 only
	ConfigCapPtr        = 0x34
	ConfigCardbusCapPtr = 0x14
	ConfigPrimaryBus    = 0x18 // type 1
	ConfigSecondaryBus  = 0x19 // type 1
	ConfigSubordinate   = 0x1a // type 1

	// StatusCapList is PCI_STATUS_CAP_LIST: the device has a capability list.
	StatusCapList = 0x10

	HeaderTypeNormal  = 0
	HeaderTypeBridge  = 1
	HeaderTypeCardbus = 2

	// ConventionalSize is the config space a conventional PCI function has; ExtendedSize
	// is PCIe's. An unprivileged read of sysfs "config" returns only the first 64 bytes.
	HeaderSize       = 0x40
	ConventionalSize = 0x100
	ExtendedSize     = 0x1000

	// maxCaps bounds a capability walk: 48 standard capabilities fit in 192 bytes, and
	// (4096-256)/8 = 480 extended ones in the extended space (the kernel's
	// PCI_FIND_CAP_TTL and the 480 bound in pci_find_next_ext_capability).
	maxStdCaps = 48
	maxExtCaps = (ExtendedSize - ConventionalSize) / 8
)

// Standard capability IDs (PCI_CAP_ID_*).
const (
	CapPM      = 0x01
	CapVPD     = 0x03
	CapMSI     = 0x05
	CapVendor  = 0x09
	CapSSVID   = 0x0d
	CapExpress = 0x10
	CapMSIX    = 0x11
)

// Extended capability IDs (PCI_EXT_CAP_ID_*), PCI-SIG numbers.
const (
	ExtCapAER    = 0x0001
	ExtCapVC     = 0x0002
	ExtCapDSN    = 0x0003
	ExtCapVNDR   = 0x000b
	ExtCapACS    = 0x000d
	ExtCapARI    = 0x000e
	ExtCapATS    = 0x000f
	ExtCapSRIOV  = 0x0010
	ExtCapPRI    = 0x0013
	ExtCapSecPCI = 0x0019
	ExtCapPASID  = 0x001b
	ExtCapDPC    = 0x001d
	ExtCapL1SS   = 0x001e
	ExtCapPL16   = 0x0026
	ExtCapPL32   = 0x002a
	ExtCapDOE    = 0x002e
	ExtCapPL64   = 0x0031
)

// Config is a function's configuration space as read from sysfs or a dump: 64, 256 or
// 4096 bytes (or anything shorter when the source was truncated).
type Config []byte

// Capability is one entry of the standard or extended capability list.
type Capability struct {
	ID       uint16 `json:"id"`
	Offset   int    `json:"offset"`
	Version  uint8  `json:"version,omitempty"` // extended capabilities only
	Extended bool   `json:"extended"`
}

// CapError reports a malformed capability list: where the walk stopped and why.
type CapError struct {
	Extended bool
	Offset   int // the bad pointer, or the offset of the header that holds it
	Reason   string
}

func (e *CapError) Error() string {
	kind := "capability"
	if e.Extended {
		kind = "extended capability"
	}
	return fmt.Sprintf("%s list: %s at 0x%03x", kind, e.Reason, e.Offset)
}

func (c Config) has(off, n int) bool { return off >= 0 && off+n <= len(c) }

// U8, U16 and U32 read little-endian registers; an offset past the end reads as 0 and
// ok=false, so callers that must tell "absent" from "zero" can.
func (c Config) U8(off int) (uint8, bool) {
	if !c.has(off, 1) {
		return 0, false
	}
	return c[off], true
}

func (c Config) U16(off int) (uint16, bool) {
	if !c.has(off, 2) {
		return 0, false
	}
	return binary.LittleEndian.Uint16(c[off:]), true
}

func (c Config) U32(off int) (uint32, bool) {
	if !c.has(off, 4) {
		return 0, false
	}
	return binary.LittleEndian.Uint32(c[off:]), true
}

func (c Config) r8(off int) uint8   { v, _ := c.U8(off); return v }
func (c Config) r16(off int) uint16 { v, _ := c.U16(off); return v }
func (c Config) r32(off int) uint32 { v, _ := c.U32(off); return v }

// HeaderType is the layout of the header (0 normal, 1 PCI-PCI bridge, 2 CardBus),
// without the multi-function bit.
func (c Config) HeaderType() uint8 { return c.r8(ConfigHeaderType) & 0x7f }

// MultiFunction is bit 7 of the header type register.
func (c Config) MultiFunction() bool { return c.r8(ConfigHeaderType)&0x80 != 0 }

// Walk returns the standard and the extended capability lists. A malformed list is an
// error (a *CapError) alongside the capabilities found before the fault: the walks never
// loop, never read outside the buffer and never follow a pointer into the header. The
// extended list does not hang off the standard one, so it is walked even when the
// standard list is malformed; when both are, the error joins both *CapErrors.
func (c Config) Walk() (std, ext []Capability, err error) {
	std, serr := c.walkStd()
	ext, eerr := c.walkExt()
	switch {
	case serr != nil && eerr != nil:
		return std, ext, errors.Join(serr, eerr)
	case serr != nil:
		return std, ext, serr
	}
	return std, ext, eerr
}

func (c Config) walkStd() ([]Capability, error) {
	if len(c) < HeaderSize {
		return nil, nil
	}
	if c.r16(ConfigStatus)&StatusCapList == 0 {
		return nil, nil
	}
	ptrOff := ConfigCapPtr
	if c.HeaderType() == HeaderTypeCardbus {
		ptrOff = ConfigCardbusCapPtr
	}
	var caps []Capability
	seen := map[int]bool{}
	where := ptrOff
	ptr := int(c.r8(ptrOff))
	for ptr != 0 {
		switch {
		case ptr&3 != 0:
			return caps, &CapError{Offset: where, Reason: fmt.Sprintf("unaligned pointer 0x%02x", ptr)}
		case ptr < HeaderSize:
			return caps, &CapError{Offset: where, Reason: fmt.Sprintf("pointer 0x%02x into the header", ptr)}
		case ptr+2 > ConventionalSize:
			return caps, &CapError{Offset: where, Reason: fmt.Sprintf("pointer 0x%02x past 256 bytes", ptr)}
		case !c.has(ptr, 2):
			return caps, &CapError{Offset: where, Reason: fmt.Sprintf("pointer 0x%02x past the %d bytes read", ptr, len(c))}
		case seen[ptr]:
			return caps, &CapError{Offset: where, Reason: fmt.Sprintf("loop back to 0x%02x", ptr)}
		case len(caps) >= maxStdCaps:
			return caps, &CapError{Offset: where, Reason: "too many capabilities"}
		}
		seen[ptr] = true
		caps = append(caps, Capability{ID: uint16(c[ptr]), Offset: ptr})
		where = ptr + 1
		ptr = int(c[ptr+1])
	}
	return caps, nil
}

func (c Config) walkExt() ([]Capability, error) {
	if len(c) <= ConventionalSize {
		return nil, nil
	}
	var caps []Capability
	seen := map[int]bool{}
	off := ConventionalSize
	where := off
	for {
		switch {
		case off&3 != 0:
			return caps, &CapError{Extended: true, Offset: where, Reason: fmt.Sprintf("unaligned pointer 0x%03x", off)}
		case off < ConventionalSize:
			return caps, &CapError{Extended: true, Offset: where, Reason: fmt.Sprintf("pointer 0x%03x below 0x100", off)}
		case !c.has(off, 4):
			return caps, &CapError{Extended: true, Offset: where, Reason: fmt.Sprintf("pointer 0x%03x past the %d bytes read", off, len(c))}
		case seen[off]:
			return caps, &CapError{Extended: true, Offset: where, Reason: fmt.Sprintf("loop back to 0x%03x", off)}
		case len(caps) >= maxExtCaps:
			return caps, &CapError{Extended: true, Offset: where, Reason: "too many capabilities"}
		}
		seen[off] = true
		h := c.r32(off)
		// An all-zero or all-ones header at 0x100 means no extended capabilities
		// (PCIe 6.0 7.6.3; the kernel's pci_find_next_ext_capability).
		if h == 0 || h == 0xffffffff {
			if off == ConventionalSize {
				return caps, nil
			}
			return caps, &CapError{Extended: true, Offset: where, Reason: fmt.Sprintf("empty header at 0x%03x", off)}
		}
		caps = append(caps, Capability{ID: uint16(h), Version: uint8(h>>16) & 0xf, Offset: off, Extended: true})
		next := int(h >> 20)
		if next == 0 {
			return caps, nil
		}
		where = off
		off = next
	}
}

// Find returns the offset of the first capability with the given ID, or 0.
func Find(caps []Capability, id uint16) int {
	for _, c := range caps {
		if c.ID == id {
			return c.Offset
		}
	}
	return 0
}

// problemNotRoot is the problem a 64-byte config read gets: operators grep for it.
const problemNotRoot = "config space truncated to 64 bytes (not root?)"

// The problems of a config space that is no function's: a read nothing answered returns
// all ones (PCI Local Bus 3.0 6.1: a master abort), and no function has Vendor ID 0x0000
// (the kernel's pci_bus_generic_read_dev_vendor_id takes an ID register of 0 for "no
// function" as it takes ~0).
const (
	problemAllOnes  = "config space reads all ones: the function does not answer (removed, or in reset)"
	problemAllZeros = "config space reads all zeros (vendor 0x0000: not a valid function)"
)

// ExpressKnown says whether config space settles that the function is, or is not, PCI
// Express: true when an Express capability was found, or when the standard capability
// list was read whole without one (a conventional PCI function); false when the list
// could not be read (CapsUnknown says why), and when no config space was read at all
// (the scan could not read the config file: Problems says why; the header type is then
// unknown too). Express nil and ExpressKnown false means unknown: a bridge is then not
// known to be a conventional PCI bridge.
func (d *Device) ExpressKnown() bool {
	return d.Express != nil || d.CapsUnknown == "" && len(d.Config) > 0
}

// capsUnknown records a problem that leaves both capability lists unread.
func (d *Device) capsUnknown(problem string) {
	d.Problems = append(d.Problems, problem)
	if d.CapsUnknown == "" {
		d.CapsUnknown = problem
	}
	if d.ExtCapsUnknown == "" {
		d.ExtCapsUnknown = problem
	}
}

func allBytes(c Config, v byte) bool {
	for _, b := range c {
		if b != v {
			return false
		}
	}
	return true
}

// decodeConfig fills the fields config space determines. A short or malformed config
// space leaves the fields it cannot reach zero, records why in Problems, and says in
// CapsUnknown and ExtCapsUnknown which capability lists it could not read whole.
//
// Sizes: the header is 64 bytes (an unprivileged sysfs read stops there), conventional
// config space 256, PCI Express's 4096. Anything else is a truncated read, except 256
// bytes of an Express function: the kernel offers 256 when the extended space does not
// answer (pci_cfg_space_size), and then it has no extended capabilities to use either.
func (d *Device) decodeConfig() {
	c := d.Config
	d.CapsUnknown, d.ExtCapsUnknown = "", ""
	if len(c) == 0 {
		d.capsUnknown("config space empty")
		return
	}
	switch {
	case allBytes(c, 0xff):
		d.capsUnknown(problemAllOnes)
	case allBytes(c, 0):
		d.capsUnknown(problemAllZeros)
	}
	switch {
	case len(c) < HeaderSize:
		d.capsUnknown(fmt.Sprintf("config space truncated to %d bytes", len(c)))
	case len(c) == HeaderSize:
		// The kernel returns only the header to readers without CAP_SYS_ADMIN
		// (pci_read_config in drivers/pci/pci-sysfs.c): capabilities are then unknown,
		// not absent.
		d.capsUnknown(problemNotRoot)
	case len(c) < ConventionalSize:
		d.problem("config space truncated to %d bytes (conventional config space is 256)", len(c))
	}
	d.VendorID = c.r16(ConfigVendorID)
	d.DeviceID = c.r16(ConfigDeviceID)
	d.Revision = c.r8(ConfigRevision)
	d.Class = uint32(c.r8(ConfigClassProg)) | uint32(c.r8(ConfigClassProg+1))<<8 | uint32(c.r8(ConfigClassProg+2))<<16
	d.HeaderType = c.HeaderType()
	d.MultiFunction = c.MultiFunction()
	switch d.HeaderType {
	case HeaderTypeNormal:
		d.SubsystemVendor = c.r16(ConfigSubsysVendor)
		d.SubsystemDevice = c.r16(ConfigSubsysID)
	case HeaderTypeBridge:
		d.PrimaryBus = c.r8(ConfigPrimaryBus)
		d.SecondaryBus = c.r8(ConfigSecondaryBus)
		d.SubordinateBus = c.r8(ConfigSubordinate)
	}
	d.decodeBARs()
	if d.CapsUnknown == problemAllOnes || d.CapsUnknown == problemAllZeros {
		// Nothing in it is the function's: a capability pointer of 0xff is no finding
		// of its own. The ID registers keep what was read (0xffff: the scan then names
		// the function from the kernel's vendor and device files, as it does a VF's).
		return
	}
	if len(c) <= HeaderSize {
		return
	}
	std, serr := c.walkStd()
	ext, eerr := c.walkExt()
	d.Caps, d.ExtCaps = std, ext
	if serr != nil {
		d.problem("%v", serr)
		d.CapsUnknown = serr.Error()
	}
	if off := Find(std, CapExpress); off != 0 {
		e, err := decodeExpress(c, off)
		if err != nil {
			d.problem("%v", err)
			if d.CapsUnknown == "" {
				d.CapsUnknown = err.Error()
			}
		}
		if d.Express = e; e != nil && (e.Type.IsDownstreamFacing() || e.Type == PortUpstream) && d.HeaderType != HeaderTypeBridge {
			d.problem("express %s without a bridge header", e.Type)
		}
	}
	if eerr != nil {
		d.problem("%v", eerr)
		d.ExtCapsUnknown = eerr.Error()
	}
	if len(c) <= ConventionalSize && !d.ExpressKnown() && d.ExtCapsUnknown == "" {
		// Whether there is an extended space to miss depends on what is unknown.
		d.ExtCapsUnknown = d.CapsUnknown
	}
	if len(c) < ExtendedSize && len(c) > ConventionalSize {
		d.problem("extended config space truncated to %d bytes", len(c))
	}
	for _, ec := range ext {
		var err error
		switch ec.ID {
		case ExtCapACS:
			if d.ACS == nil {
				d.ACS, err = decodeACS(c, ec.Offset)
			}
		case ExtCapATS:
			if d.ATS == nil {
				d.ATS, err = decodeATS(c, ec.Offset)
			}
		case ExtCapSRIOV:
			if d.SRIOV == nil {
				d.SRIOV, err = decodeSRIOV(c, ec.Offset)
			}
		}
		if err != nil {
			d.problem("%v", err)
			if d.ExtCapsUnknown == "" {
				d.ExtCapsUnknown = err.Error()
			}
		}
	}
}
