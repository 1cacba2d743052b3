package pci

import (
	"bytes"
	"strings"
	"testing"
)

// Hostile config spaces: what a function that does not answer, a truncated read or a
// corrupted capability list looks like, and what decodeConfig must say about each.

// bridgeCfg is a type 1 header (a PCI-PCI bridge) of size bytes with a capability list;
// set pokes bytes.
func bridgeCfg(size int, set map[int]byte) Config {
	c := cfg(size, map[int]byte{ConfigVendorID: 0x86, ConfigVendorID + 1: 0x80, ConfigHeaderType: HeaderTypeBridge,
		ConfigClassProg + 1: 0x04, ConfigClassProg + 2: 0x06, ConfigSecondaryBus: 1, ConfigSubordinate: 1})
	for off, v := range set {
		c[off] = v
	}
	return c
}

func decoded(c Config) *Device {
	d := &Device{Config: c, NUMANode: -1, IOMMUGroup: -1}
	d.decodeConfig()
	return d
}

func problemWith(d *Device, substr string) bool {
	for _, p := range d.Problems {
		if strings.Contains(p, substr) {
			return true
		}
	}
	return false
}

func TestConfigAllZeros(t *testing.T) {
	for _, n := range []int{HeaderSize, ConventionalSize, ExtendedSize} {
		d := decoded(make(Config, n))
		if !problemWith(d, "config space reads all zeros (vendor 0x0000: not a valid function)") {
			t.Errorf("%d zero bytes: problems %q", n, d.Problems)
		}
		if d.ExpressKnown() || d.CapsUnknown == "" {
			t.Errorf("%d zero bytes: Express-ness known (%q)", n, d.CapsUnknown)
		}
	}
}

func TestConfigAllOnes(t *testing.T) {
	const want = "config space reads all ones: the function does not answer (removed, or in reset)"
	for _, n := range []int{HeaderSize, ConventionalSize, ExtendedSize} {
		d := decoded(Config(bytes.Repeat([]byte{0xff}, n)))
		if !problemWith(d, want) {
			t.Errorf("%d bytes of 0xff: problems %q", n, d.Problems)
		}
		// The capability pointer 0xff is not a finding of its own: nothing answered.
		if problemWith(d, "unaligned") || problemWith(d, "capability list") {
			t.Errorf("%d bytes of 0xff: capability walk reported %q", n, d.Problems)
		}
		if d.ExpressKnown() || d.Caps != nil || d.ExtCaps != nil {
			t.Errorf("%d bytes of 0xff: caps %v %v known %v", n, d.Caps, d.ExtCaps, d.ExpressKnown())
		}
		// The ID registers keep what was read: the scan then names the function from
		// the kernel's vendor and device files, as it does for a VF.
		if d.VendorID != 0xffff || d.DeviceID != 0xffff {
			t.Errorf("%d bytes of 0xff: IDs %s", n, d.IDs())
		}
	}
	// An SR-IOV VF reads 0xffff in its ID registers and answers everywhere else.
	vf := cfg(ExtendedSize, map[int]byte{0: 0xff, 1: 0xff, 2: 0xff, 3: 0xff, ConfigClassProg + 2: 0x02})
	if d := decoded(vf); len(d.Problems) != 0 || !d.ExpressKnown() {
		t.Errorf("VF: problems %q", d.Problems)
	}
}

func TestConfigTruncatedLengths(t *testing.T) {
	// A device whose list ends inside what was read: 0x40 PM -> end.
	set := map[int]byte{ConfigVendorID: 0x86, ConfigVendorID + 1: 0x80, ConfigCapPtr: 0x40, 0x40: CapPM}
	for _, n := range []int{65, 0x48, 0x80, 0xc0, 255} {
		d := decoded(cfg(ExtendedSize, set)[:n])
		if !problemWith(d, "config space truncated to "+itoa(n)+" bytes") {
			t.Errorf("%d bytes: problems %q", n, d.Problems)
		}
	}
	for _, n := range []int{ConventionalSize, ExtendedSize} {
		if d := decoded(cfg(ExtendedSize, set)[:n]); len(d.Problems) != 0 {
			t.Errorf("%d bytes: problems %q", n, d.Problems)
		}
	}
	// Under 64 bytes the list is not even reachable: Express-ness is unknown.
	for _, n := range []int{1, 63, HeaderSize} {
		d := decoded(bridgeCfg(ExtendedSize, nil)[:n])
		if d.ExpressKnown() || d.CapsUnknown == "" || len(d.Problems) == 0 {
			t.Errorf("%d bytes: Express known %v (%q), problems %q", n, d.ExpressKnown(), d.CapsUnknown, d.Problems)
		}
	}
}

func itoa(n int) string {
	var b [8]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + n%10)
		if n /= 10; n == 0 {
			return string(b[i:])
		}
	}
}

// TestBrokenCapsBridgeNotConventional: a port whose capability list is corrupt has no
// readable Express capability, which is not the same as being a conventional PCI bridge.
func TestBrokenCapsBridgeNotConventional(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  map[int]byte
		want string
	}{
		{"pointer loop", map[int]byte{ConfigCapPtr: 0x40, 0x40: CapPM, 0x41: 0x50, 0x50: CapMSI, 0x51: 0x40}, "loop back to 0x40"},
		{"self loop", map[int]byte{ConfigCapPtr: 0x40, 0x40: CapPM, 0x41: 0x40}, "loop back to 0x40"},
		{"pointer into the header", map[int]byte{ConfigCapPtr: 0x40, 0x40: CapPM, 0x41: 0x10}, "pointer 0x10 into the header"},
		{"first pointer into the header", map[int]byte{ConfigCapPtr: 0x20}, "pointer 0x20 into the header"},
		{"unaligned pointer", map[int]byte{ConfigCapPtr: 0x40, 0x40: CapPM, 0x41: 0x62}, "unaligned pointer 0x62"},
		{"express cut by the end of the read", map[int]byte{ConfigCapPtr: 0xfc, 0xfc: CapExpress}, "express capability at 0xfc truncated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := bridgeCfg(ExtendedSize, tc.set)
			if tc.set[0xfc] == CapExpress {
				c = c[:0xfe]
			}
			d := decoded(c)
			if !d.IsBridge() || !problemWith(d, tc.want) {
				t.Fatalf("bridge %v, problems %q", d.IsBridge(), d.Problems)
			}
			if _, express := d.PortType(); express {
				t.Fatalf("express %+v", d.Express)
			}
			if d.ExpressKnown() || d.CapsUnknown == "" || !strings.Contains(d.CapsUnknown, tc.want) {
				t.Errorf("Express-ness known %v, CapsUnknown %q", d.ExpressKnown(), d.CapsUnknown)
			}
		})
	}
	// A conventional bridge, its list read whole, is known to be one.
	d := decoded(bridgeCfg(ConventionalSize, map[int]byte{ConfigCapPtr: 0x40, 0x40: CapPM}))
	if _, express := d.PortType(); express || !d.ExpressKnown() || d.CapsUnknown != "" || len(d.Problems) != 0 {
		t.Errorf("conventional bridge: known %v %q problems %q", d.ExpressKnown(), d.CapsUnknown, d.Problems)
	}
	// An Express capability whose link registers would lie past 0xff: the port type is
	// read, the link is not made up.
	d = decoded(bridgeCfg(ExtendedSize, map[int]byte{ConfigCapPtr: 0xf8, 0xf8: CapExpress, 0xfa: 0x62, 0x104: 0x06}))
	if pt, express := d.PortType(); !express || pt != PortDownstream || d.Express.HasLink || !problemWith(d, "express capability at 0xf8 runs past 0xff") {
		t.Errorf("express at 0xf8: %v %v %+v problems %q", pt, express, d.Express, d.Problems)
	}
	// A function whose config space could not be read at all (the scan keeps it, with
	// the IDs from sysfs text files) is not known to be conventional either.
	if d := (&Device{VendorID: 0x8086, Problems: []string{"config: permission denied"}}); d.ExpressKnown() {
		t.Error("no config space read: Express-ness known")
	}
	// Express found before the list breaks: the port type is known, the rest of the
	// list is not.
	d = decoded(bridgeCfg(ExtendedSize, map[int]byte{ConfigCapPtr: 0x40, 0x40: CapExpress, 0x41: 0x60, 0x42: 0x62, 0x60: CapPM, 0x61: 0x40}))
	if pt, express := d.PortType(); !express || pt != PortDownstream || !d.ExpressKnown() || d.CapsUnknown == "" {
		t.Errorf("express before the loop: %v %v known %v %q", pt, express, d.ExpressKnown(), d.CapsUnknown)
	}
}

// TestBrokenStdListKeepsExtCaps: the extended list does not hang off the standard one,
// so ACS is read even when the standard list is corrupt.
func TestBrokenStdListKeepsExtCaps(t *testing.T) {
	c := bridgeCfg(ExtendedSize, map[int]byte{ConfigCapPtr: 0x41,
		0x100: 0x0d, 0x102: 0x01, 0x104: 0x1f, 0x106: 0x1d})
	d := decoded(c)
	if d.ACS == nil || d.ACS.Ctl != ACSSV|ACSRR|ACSCR|ACSUF || d.ExtCapsUnknown != "" || d.ExpressKnown() {
		t.Errorf("ACS %+v, ext unknown %q, express known %v, problems %q", d.ACS, d.ExtCapsUnknown, d.ExpressKnown(), d.Problems)
	}
}

func TestExtCapsUnknown(t *testing.T) {
	express := map[int]byte{ConfigCapPtr: 0x40, 0x40: CapExpress, 0x42: 0x62, 0x4c: 0x05, 0x4d: 0x01, 0x52: 0x05, 0x53: 0x01}
	// An extended list cut by the end of what was read.
	set := map[int]byte{0x100: 0x0d, 0x102: 0x01}
	for k, v := range express {
		set[k] = v
	}
	d := decoded(bridgeCfg(ExtendedSize, set)[:0x104])
	if d.ACS != nil || d.ExtCapsUnknown == "" || !problemWith(d, "acs capability at 0x100 truncated") {
		t.Errorf("cut ACS: %+v %q %q", d.ACS, d.ExtCapsUnknown, d.Problems)
	}
	// An extended list that loops.
	set = map[int]byte{0x100: 0x01, 0x102: 0x01, 0x103: 0x10}
	for k, v := range express {
		set[k] = v
	}
	d = decoded(bridgeCfg(ExtendedSize, set))
	if d.ExtCapsUnknown == "" || !strings.Contains(d.ExtCapsUnknown, "loop back to 0x100") || !d.ExpressKnown() {
		t.Errorf("ext loop: %q %q", d.ExtCapsUnknown, d.Problems)
	}
	// A whole, empty extended list is known to hold nothing.
	d = decoded(bridgeCfg(ExtendedSize, express))
	if d.ExtCapsUnknown != "" || d.CapsUnknown != "" || len(d.Problems) != 0 || d.Express == nil || !d.Express.HasLink {
		t.Errorf("clean port: %q %q %q", d.ExtCapsUnknown, d.CapsUnknown, d.Problems)
	}
}
