package pci

import (
	"bytes"
	"encoding/json"
	"testing"
)

// Seeds beyond these are in testdata/fuzz/<Target>: config spaces and an lspci dump of
// the B300 reference, and the malformed shapes the unit tests name.

func FuzzConfig(f *testing.F) {
	f.Add([]byte{})
	f.Add(make([]byte, 64))
	loop := make([]byte, 4096)
	loop[ConfigStatus] = StatusCapList
	loop[ConfigCapPtr], loop[0x40], loop[0x41], loop[0x50], loop[0x51] = 0x40, CapExpress, 0x50, CapPM, 0x40
	copy(loop[0x100:], []byte{0x0d, 0x00, 0x01, 0x14, 0x7f, 0x00, 0x1d, 0x00})
	copy(loop[0x140:], []byte{0x0f, 0x00, 0x01, 0x10})
	f.Add(loop)
	f.Fuzz(func(t *testing.T, b []byte) {
		c := Config(b)
		std, ext, _ := c.Walk()
		seen := map[int]bool{}
		for _, cp := range std {
			if cp.Offset < HeaderSize || cp.Offset+2 > ConventionalSize || cp.Offset&3 != 0 || seen[cp.Offset] {
				t.Fatalf("bad std capability %+v", cp)
			}
			seen[cp.Offset] = true
		}
		for _, cp := range ext {
			if cp.Offset < ConventionalSize || cp.Offset+4 > len(b) || cp.Offset&3 != 0 || seen[cp.Offset] {
				t.Fatalf("bad ext capability %+v", cp)
			}
			seen[cp.Offset] = true
		}
		d := &Device{Config: c, NUMANode: -1, IOMMUGroup: -1}
		d.decodeConfig()
		for _, off := range []int{offsetOf(d.Express), offsetOf(d.ACS), offsetOf(d.ATS), offsetOf(d.SRIOV)} {
			if off >= len(b) {
				t.Fatalf("capability at 0x%x past %d bytes", off, len(b))
			}
		}
		if _, err := json.Marshal(d.JSON()); err != nil {
			t.Fatal(err)
		}
	})
}

func offsetOf(x any) int {
	switch v := x.(type) {
	case *Express:
		if v != nil {
			return v.Offset
		}
	case *ACS:
		if v != nil {
			return v.Offset
		}
	case *ATS:
		if v != nil {
			return v.Offset
		}
	case *SRIOV:
		if v != nil {
			return v.Offset
		}
	}
	return -1
}

func FuzzParseVPD(f *testing.F) {
	f.Add([]byte{0x82, 2, 0, 'h', 'i', 0x90, 7, 0, 'P', 'N', 1, 'x', 'R', 'V', 0, 0x78})
	f.Add([]byte{0x90, 0xff, 0xff})
	f.Add([]byte{0x91, 3, 0, 'R', 'W', 9})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, _ := ParseVPD(b)
		if v == nil || v.Keywords == nil {
			t.Fatal("nil result")
		}
		for k := range v.Keywords {
			if len(k) != 2 {
				t.Fatalf("keyword %q", k)
			}
		}
	})
}

func FuzzParseDump(f *testing.F) {
	f.Add([]byte("00:01.0 PCI bridge\n00: 86 80 2a 35 06 00 10 00 00 00 04 06 00 00 01 00\n10: 00 00 00 00 00 00 00 00 00 01 01 00\n\n01:00.0 x\n00: de 10 82 31\n"))
	f.Add([]byte("01:00.0 a\n00: 86 80 2a 35 00 00 00 00 00 00 04 06 00 00 01 00\n10: 00 00 00 00 00 00 00 00 01 02 02 00\n\n02:00.0 b\n00: 86 80 2a 35 00 00 00 00 00 00 04 06 00 00 01 00\n10: 00 00 00 00 00 00 00 00 02 01 01 00\n"))
	f.Add([]byte("0000:00:02.0 x\r\nff8: 01 02 03 04 05 06 07 08 09\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		tree, err := ParseDump(bytes.NewReader(b))
		if err != nil {
			return
		}
		seen := map[Address]bool{}
		for _, d := range tree.Devices {
			if seen[d.Addr] {
				t.Fatalf("%s twice", d.Addr)
			}
			seen[d.Addr] = true
			if tree.Lookup(d.Addr) != d {
				t.Fatalf("%s: lookup differs", d.Addr)
			}
			if len(d.Ancestors()) > len(tree.Devices) {
				t.Fatalf("%s: parent chain longer than the tree", d.Addr)
			}
			if d.Parent != nil {
				found := false
				for _, c := range d.Parent.Children {
					found = found || c == d
				}
				if !found {
					t.Fatalf("%s missing from its parent's children", d.Addr)
				}
			}
		}
		if _, err := json.Marshal(tree.JSON()); err != nil {
			t.Fatal(err)
		}
	})
}
