package pci

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// ConfigIO reads and writes a function's config space. The sysfs implementation is the
// only one in production; tests put fault injectors around it.
type ConfigIO interface {
	ReadConfig(a Address, off int64, p []byte) error
	WriteConfig(a Address, off int64, p []byte) error
}

// SysfsConfig accesses <root>/sys/bus/pci/devices/<bdf>/config, the way setpci does.
type SysfsConfig struct{ Root string }

func (s SysfsConfig) path(a Address) string {
	root := s.Root
	if root == "" {
		root = "/"
	}
	return filepath.Join(root, DevicesDir, a.String(), "config")
}

func (s SysfsConfig) ReadConfig(a Address, off int64, p []byte) error {
	f, err := os.Open(s.path(a))
	if err != nil {
		return unwrapPath(err)
	}
	defer f.Close()
	n, err := f.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil {
		err = errors.New("short read")
	}
	return fmt.Errorf("read %d bytes at 0x%03x: %w", len(p), off, unwrapPath(err))
}

func (s SysfsConfig) WriteConfig(a Address, off int64, p []byte) error {
	f, err := os.OpenFile(s.path(a), os.O_WRONLY, 0)
	if err != nil {
		return unwrapPath(err)
	}
	n, err := f.WriteAt(p, off)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && n != len(p) {
		err = errors.New("short write")
	}
	if err != nil {
		return fmt.Errorf("write %d bytes at 0x%03x: %w", len(p), off, unwrapPath(err))
	}
	return nil
}

// Write is the record of one register write: what was there, what was written, and what
// reads back.
type Write struct {
	Addr   Address `json:"bdf"`
	Offset int     `json:"offset"`
	Width  int     `json:"width"` // bytes: 1, 2 or 4
	Before uint32  `json:"before"`
	Value  uint32  `json:"value"`
	After  uint32  `json:"after"`
}

// ErrReadBack is returned when the register reads back a value other than the one written
// (read-only bits, or a device that ignored the write).
var ErrReadBack = errors.New("read-back differs from the value written")

// WriteRegister writes a 1, 2 or 4 byte register and reads it back. It is the one path
// by which passage changes config space. The returned Write holds whatever was learned
// even on error: Before is valid once the first read succeeded, After once the read-back
// did.
func WriteRegister(io ConfigIO, a Address, off, width int, val uint32) (Write, error) {
	w := Write{Addr: a, Offset: off, Width: width, Value: val}
	if width != 1 && width != 2 && width != 4 || off < 0 || off%width != 0 || off+width > ExtendedSize {
		return w, fmt.Errorf("%s: bad register 0x%03x width %d", a, off, width)
	}
	buf := make([]byte, width)
	if err := io.ReadConfig(a, int64(off), buf); err != nil {
		return w, fmt.Errorf("%s: read 0x%03x: %w", a, off, err)
	}
	w.Before = decodeLE(buf)
	encodeLE(buf, val)
	if err := io.WriteConfig(a, int64(off), buf); err != nil {
		return w, fmt.Errorf("%s: write 0x%03x: %w", a, off, err)
	}
	if err := io.ReadConfig(a, int64(off), buf); err != nil {
		return w, fmt.Errorf("%s: read back 0x%03x: %w", a, off, err)
	}
	w.After = decodeLE(buf)
	if w.After != val {
		return w, fmt.Errorf("%s: 0x%03x wrote %#0*x, reads %#0*x: %w", a, off, 2*width+2, val, 2*width+2, w.After, ErrReadBack)
	}
	return w, nil
}

// ReadRegister reads a 1, 2 or 4 byte register.
func ReadRegister(io ConfigIO, a Address, off, width int) (uint32, error) {
	if width != 1 && width != 2 && width != 4 || off < 0 || off+width > ExtendedSize {
		return 0, fmt.Errorf("%s: bad register 0x%03x width %d", a, off, width)
	}
	buf := make([]byte, width)
	if err := io.ReadConfig(a, int64(off), buf); err != nil {
		return 0, fmt.Errorf("%s: read 0x%03x: %w", a, off, err)
	}
	return decodeLE(buf), nil
}

func decodeLE(b []byte) uint32 {
	switch len(b) {
	case 1:
		return uint32(b[0])
	case 2:
		return uint32(binary.LittleEndian.Uint16(b))
	}
	return binary.LittleEndian.Uint32(b)
}

func encodeLE(b []byte, v uint32) {
	switch len(b) {
	case 1:
		b[0] = byte(v)
	case 2:
		binary.LittleEndian.PutUint16(b, uint16(v))
	default:
		binary.LittleEndian.PutUint32(b, v)
	}
}
