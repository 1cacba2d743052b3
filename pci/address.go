package pci

import (
	"fmt"
	"strconv"
	"strings"
)

// Address is a PCI function's location: domain (segment), bus, device, function, as the
// kernel names it in /sys/bus/pci/devices ("0000:f2:00.0").
type Address struct {
	Domain   uint16
	Bus      uint8
	Device   uint8 // 0..31
	Function uint8 // 0..7
}

func (a Address) String() string {
	return fmt.Sprintf("%04x:%02x:%02x.%x", a.Domain, a.Bus, a.Device, a.Function)
}

// Less orders addresses the way lspci lists them.
func (a Address) Less(b Address) bool {
	if a.Domain != b.Domain {
		return a.Domain < b.Domain
	}
	if a.Bus != b.Bus {
		return a.Bus < b.Bus
	}
	if a.Device != b.Device {
		return a.Device < b.Device
	}
	return a.Function < b.Function
}

// ParseAddress parses "DDDD:BB:DD.F" or, with domain 0 implied, "BB:DD.F".
func ParseAddress(s string) (Address, error) {
	var a Address
	parts := strings.Split(s, ":")
	switch len(parts) {
	case 2:
	case 3:
		d, err := strconv.ParseUint(parts[0], 16, 16)
		if err != nil || len(parts[0]) == 0 || len(parts[0]) > 4 {
			return a, fmt.Errorf("pci address %q: bad domain", s)
		}
		a.Domain = uint16(d)
		parts = parts[1:]
	default:
		return a, fmt.Errorf("pci address %q: want DDDD:BB:DD.F", s)
	}
	b, err := strconv.ParseUint(parts[0], 16, 8)
	if err != nil || len(parts[0]) == 0 || len(parts[0]) > 2 {
		return a, fmt.Errorf("pci address %q: bad bus", s)
	}
	df := strings.Split(parts[1], ".")
	if len(df) != 2 || len(df[0]) == 0 || len(df[0]) > 2 || len(df[1]) != 1 {
		return a, fmt.Errorf("pci address %q: want DD.F after the bus", s)
	}
	dev, err := strconv.ParseUint(df[0], 16, 8)
	if err != nil || dev > 31 {
		return a, fmt.Errorf("pci address %q: bad device number", s)
	}
	fn, err := strconv.ParseUint(df[1], 16, 8)
	if err != nil || fn > 7 {
		return a, fmt.Errorf("pci address %q: bad function number", s)
	}
	a.Bus, a.Device, a.Function = uint8(b), uint8(dev), uint8(fn)
	return a, nil
}

// MustParseAddress is ParseAddress for constants in tests and tables.
func MustParseAddress(s string) Address {
	a, err := ParseAddress(s)
	if err != nil {
		panic(err)
	}
	return a
}

// MarshalText writes the address as the kernel names it ("0000:f2:00.0"), so every JSON
// document passage prints carries BDF strings, never the struct's fields.
func (a Address) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText reads what MarshalText writes (and "BB:DD.F", domain 0).
func (a *Address) UnmarshalText(b []byte) error {
	v, err := ParseAddress(string(b))
	if err != nil {
		return err
	}
	*a = v
	return nil
}
