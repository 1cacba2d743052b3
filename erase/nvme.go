package erase

import (
	"encoding/binary"
	"fmt"
	"strings"
)

// Admin command opcodes (NVM Express Base Specification 2.0, Figure 28).
const (
	OpGetLogPage = 0x02
	OpIdentify   = 0x06
	OpFormatNVM  = 0x80
	OpSanitize   = 0x84
)

// Identify CNS values (Base Specification 2.0, Figure 273).
const (
	CNSNamespace          = 0x00
	CNSController         = 0x01
	CNSActiveNSList       = 0x02
	CNSAllocatedNSList    = 0x10 // every allocated namespace, attached or not
	CNSAllocatedNamespace = 0x11 // Identify Namespace of an allocated namespace
)

// LogSanitizeStatus is the Sanitize Status log page identifier (Figure 291).
const LogSanitizeStatus = 0x81

// IdentifySize is the size of every Identify data structure.
const IdentifySize = 4096

// SANICAP bits (Identify Controller bytes 331:328).
const (
	SANICAPCES = 1 << 0 // Crypto Erase Support
	SANICAPBES = 1 << 1 // Block Erase Support
	SANICAPOWS = 1 << 2 // Overwrite Support
)

// FNA bits (Format NVM Attributes, Identify Controller byte 524).
const (
	FNAFormatAll = 1 << 0 // a format applies to every namespace
	FNAEraseAll  = 1 << 1 // a secure erase applies to every namespace
	FNACrypto    = 1 << 2 // cryptographic erase is supported as a secure erase setting
)

// OACSFormat is Optional Admin Command Support bit 1: Format NVM is supported.
const OACSFormat = 1 << 1

// OACSNSManagement is OACS bit 3: Namespace Management is supported, so namespaces can
// be allocated and not attached (inactive), where no active namespace list shows them.
const OACSNSManagement = 1 << 3

// Sanitize Actions (Sanitize command CDW10 bits 2:0, Figure 372).
const (
	SanactExitFailure = 0b001
	SanactBlock       = 0b010
	SanactOverwrite   = 0b011
	SanactCrypto      = 0b100
)

// Secure Erase Settings (Format NVM CDW10 bits 11:9, Figure 312).
const (
	SESNone     = 0b000
	SESUserData = 0b001
	SESCrypto   = 0b010
)

// NSIDAll is the broadcast namespace ID.
const NSIDAll = 0xffffffff

// IDController is the part of Identify Controller (CNS 01h) erasing reads.
type IDController struct {
	VID      uint16 // bytes 1:0
	Serial   string // SN, bytes 23:4
	Model    string // MN, bytes 63:24
	Firmware string // FR, bytes 71:64
	OACS     uint16 // bytes 257:256
	SANICAP  uint32 // bytes 331:328
	NN       uint32 // bytes 519:516
	FNA      uint8  // byte 524
}

// ParseIDController decodes an Identify Controller data structure.
func ParseIDController(b []byte) (IDController, error) {
	if len(b) < IdentifySize {
		return IDController{}, fmt.Errorf("identify controller: %d bytes, want %d", len(b), IdentifySize)
	}
	return IDController{
		VID:      binary.LittleEndian.Uint16(b[0:]),
		Serial:   ascii(b[4:24]),
		Model:    ascii(b[24:64]),
		Firmware: ascii(b[64:72]),
		OACS:     binary.LittleEndian.Uint16(b[256:]),
		SANICAP:  binary.LittleEndian.Uint32(b[328:]),
		NN:       binary.LittleEndian.Uint32(b[516:]),
		FNA:      b[524],
	}, nil
}

// ascii is an Identify string field: ASCII, space padded; anything else is shown escaped.
func ascii(b []byte) string {
	s := strings.TrimRight(string(b), " \x00")
	for _, r := range s {
		if r < 0x20 || r > 0x7e {
			return fmt.Sprintf("%q", s)
		}
	}
	return s
}

// LBAFormat is one LBA Format Data Structure (Figure 276).
type LBAFormat struct {
	MS    uint16 // metadata size
	LBADS uint8  // LBA data size, a power of two
}

// IDNamespace is the part of Identify Namespace (CNS 00h) erasing reads.
type IDNamespace struct {
	NSZE   uint64 // bytes 7:0, in logical blocks
	NCAP   uint64 // bytes 15:8
	NUSE   uint64 // bytes 23:16
	NLBAF  uint8  // byte 25, zero-based
	FLBAS  uint8  // byte 26
	DPS    uint8  // byte 29
	DLFEAT uint8  // byte 33
	LBAF   [16]LBAFormat
}

// ParseIDNamespace decodes an Identify Namespace data structure.
func ParseIDNamespace(b []byte) (IDNamespace, error) {
	if len(b) < IdentifySize {
		return IDNamespace{}, fmt.Errorf("identify namespace: %d bytes, want %d", len(b), IdentifySize)
	}
	n := IDNamespace{
		NSZE: binary.LittleEndian.Uint64(b[0:]), NCAP: binary.LittleEndian.Uint64(b[8:]),
		NUSE: binary.LittleEndian.Uint64(b[16:]), NLBAF: b[25], FLBAS: b[26], DPS: b[29], DLFEAT: b[33],
	}
	for i := range n.LBAF {
		o := 128 + 4*i
		n.LBAF[i] = LBAFormat{MS: binary.LittleEndian.Uint16(b[o:]), LBADS: b[o+2]}
	}
	return n, nil
}

// FormatIndex is the LBA format in use: FLBAS bits 3:0, extended by bits 6:5.
func (n IDNamespace) FormatIndex() int { return int(n.FLBAS&0xf) | int(n.FLBAS>>5&0x3)<<4 }

// BlockSize is the size of one logical block in bytes, 0 when the format in use says
// nothing sensible (an LBADS below 9 is not allowed).
func (n IDNamespace) BlockSize() int {
	i := n.FormatIndex()
	if i >= len(n.LBAF) {
		return 0
	}
	ds := n.LBAF[i].LBADS
	if ds < 9 || ds > 24 {
		return 0
	}
	return 1 << ds
}

// Deallocated is the byte a deallocated block reads as, from DLFEAT bits 2:0: 0x00
// (001b, or not reported), 0xff (010b).
func (n IDNamespace) Deallocated() byte {
	if n.DLFEAT&0x7 == 0b010 {
		return 0xff
	}
	return 0x00
}

// FormatCDW10 is Format NVM's CDW10 keeping the namespace's current format (LBAF,
// MSET, PI, PIL, LBAFU) with the given Secure Erase Settings.
func (n IDNamespace) FormatCDW10(ses uint8) uint32 {
	lbaf := uint32(n.FLBAS & 0xf)
	mset := uint32(n.FLBAS>>4) & 1
	lbafu := uint32(n.FLBAS>>5) & 0x3
	pi := uint32(n.DPS & 0x7)
	pil := uint32(n.DPS>>3) & 1
	return lbaf | mset<<4 | pi<<5 | pil<<8 | uint32(ses&0x7)<<9 | lbafu<<12
}

// ParseNSList decodes a namespace ID list (CNS 02h active, 10h allocated): up to 1024
// IDs, ended by 0.
func ParseNSList(b []byte) []uint32 {
	var out []uint32
	for i := 0; i+4 <= len(b) && i < IdentifySize; i += 4 {
		id := binary.LittleEndian.Uint32(b[i:])
		if id == 0 {
			break
		}
		out = append(out, id)
	}
	return out
}

// SanitizeState is SSTAT bits 2:0 of the Sanitize Status log (Figure 292).
type SanitizeState uint8

const (
	SanitizeNever        SanitizeState = 0
	SanitizeCompleted    SanitizeState = 1
	SanitizeInProgress   SanitizeState = 2
	SanitizeFailed       SanitizeState = 3
	SanitizeCompletedNDA SanitizeState = 4 // completed without deallocation
)

func (s SanitizeState) String() string {
	switch s {
	case SanitizeNever:
		return "never sanitized"
	case SanitizeCompleted:
		return "completed"
	case SanitizeInProgress:
		return "in progress"
	case SanitizeFailed:
		return "failed"
	case SanitizeCompletedNDA:
		return "completed without deallocation"
	}
	return fmt.Sprintf("reserved (%d)", uint8(s))
}

// SanitizeStatus is the Sanitize Status log page (81h), its first fields.
type SanitizeStatus struct {
	SPROG  uint16 // progress, numerator of a fraction of 65536
	SSTAT  uint16
	SCDW10 uint32 // the CDW10 of the sanitize the log describes
}

// State is the status of the most recent sanitize.
func (s SanitizeStatus) State() SanitizeState { return SanitizeState(s.SSTAT & 0x7) }

// ParseSanitizeStatus decodes the first 8 bytes of the log.
func ParseSanitizeStatus(b []byte) (SanitizeStatus, error) {
	if len(b) < 8 {
		return SanitizeStatus{}, fmt.Errorf("sanitize status log: %d bytes, want at least 8", len(b))
	}
	return SanitizeStatus{SPROG: binary.LittleEndian.Uint16(b[0:]), SSTAT: binary.LittleEndian.Uint16(b[2:]),
		SCDW10: binary.LittleEndian.Uint32(b[4:])}, nil
}

// Status is the Status Field of a completion as the kernel returns it from the
// passthrough ioctl: SC bits 7:0, SCT bits 10:8, CRD 12:11, More 13, DNR 14.
type Status uint16

func (s Status) SCT() uint8 { return uint8(s >> 8 & 0x7) }
func (s Status) SC() uint8  { return uint8(s) }
func (s Status) DNR() bool  { return s&(1<<14) != 0 }

// Unsupported says the controller refused the command as one it does not implement or
// whose fields it does not accept (Generic Command Status: Invalid Command Opcode,
// Invalid Field in Command): a method to fall back from, not a failed erase.
func (s Status) Unsupported() bool { return s.SCT() == 0 && (s.SC() == 0x01 || s.SC() == 0x02) }

func (s Status) String() string {
	name := ""
	if s.SCT() == 0 {
		switch s.SC() {
		case 0x00:
			name = "successful completion"
		case 0x01:
			name = "invalid command opcode"
		case 0x02:
			name = "invalid field in command"
		case 0x04:
			name = "data transfer error"
		case 0x06:
			name = "internal error"
		case 0x0b:
			name = "invalid namespace or format"
		case 0x1d:
			name = "sanitize in progress"
		case 0x1c:
			name = "sanitize failed"
		}
	}
	if name == "" {
		name = fmt.Sprintf("SCT %d SC 0x%02x", s.SCT(), s.SC())
	}
	if s.DNR() {
		name += ", do not retry"
	}
	return fmt.Sprintf("0x%04x (%s)", uint16(s), name)
}

// StatusError is a command the controller completed with a non-zero status.
type StatusError struct {
	Opcode uint8
	Status Status
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("%s: status %s", opName(e.Opcode), e.Status)
}

func opName(op uint8) string {
	switch op {
	case OpGetLogPage:
		return "get log page"
	case OpIdentify:
		return "identify"
	case OpFormatNVM:
		return "format nvm"
	case OpSanitize:
		return "sanitize"
	}
	return fmt.Sprintf("opcode 0x%02x", op)
}
