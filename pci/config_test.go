package pci

import (
	"errors"
	"strings"
	"testing"
)

// cfg is a 4096-byte type 0 config space with a capability list; set pokes bytes.
func cfg(size int, set map[int]byte) Config {
	c := make(Config, size)
	c[ConfigStatus] = StatusCapList
	for off, v := range set {
		c[off] = v
	}
	return c
}

func TestWalk(t *testing.T) {
	for _, tc := range []struct {
		name     string
		c        Config
		std, ext []uint16 // IDs found
		err      string   // "" for none
	}{
		{"no cap list bit", func() Config { c := cfg(256, map[int]byte{0x34: 0x40, 0x40: 1}); c[ConfigStatus] = 0; return c }(), nil, nil, ""},
		{"header only", cfg(64, map[int]byte{0x34: 0x40}), nil, nil, "pointer 0x40 past the 64 bytes read at 0x034"},
		{"two caps", cfg(256, map[int]byte{0x34: 0x40, 0x40: CapPM, 0x41: 0x60, 0x60: CapExpress}), []uint16{CapPM, CapExpress}, nil, ""},
		{"std loop", cfg(256, map[int]byte{0x34: 0x40, 0x40: 1, 0x41: 0x50, 0x50: 5, 0x51: 0x40}), []uint16{1, 5}, nil, "capability list: loop back to 0x40 at 0x051"},
		{"std self loop", cfg(256, map[int]byte{0x34: 0x40, 0x40: 1, 0x41: 0x40}), []uint16{1}, nil, "loop back to 0x40 at 0x041"},
		{"into the header", cfg(256, map[int]byte{0x34: 0x3c}), nil, nil, "capability list: pointer 0x3c into the header at 0x034"},
		{"unaligned", cfg(256, map[int]byte{0x34: 0x40, 0x40: 1, 0x41: 0x45}), []uint16{1}, nil, "unaligned pointer 0x45 at 0x041"},
		{"past the bytes read", cfg(128, map[int]byte{0x34: 0x40, 0x40: 1, 0x41: 0x80}), []uint16{1}, nil, "pointer 0x80 past the 128 bytes read at 0x041"},
		{"cardbus pointer", func() Config {
			return cfg(256, map[int]byte{ConfigHeaderType: HeaderTypeCardbus, 0x14: 0x80, 0x80: CapMSI})
		}(), []uint16{CapMSI}, nil, ""},
		{"ext chain", cfg(4096, map[int]byte{0x100: 0x01, 0x102: 0x01, 0x103: 0x14, 0x140: 0x0d, 0x142: 0x01}), nil, []uint16{ExtCapAER, ExtCapACS}, ""},
		{"ext empty", cfg(4096, nil), nil, nil, ""},
		{"ext all ones", func() Config {
			c := cfg(4096, nil)
			copy(c[0x100:], []byte{0xff, 0xff, 0xff, 0xff})
			return c
		}(), nil, nil, ""},
		{"ext loop", cfg(4096, map[int]byte{0x100: 0x01, 0x102: 0x01, 0x103: 0x14, 0x140: 0x0f, 0x142: 0x01, 0x143: 0x10}), nil, []uint16{1, 0xf}, "extended capability list: loop back to 0x100 at 0x140"},
		{"ext below 0x100", cfg(4096, map[int]byte{0x100: 0x01, 0x102: 0x01, 0x103: 0x04}), nil, []uint16{1}, "extended capability list: pointer 0x040 below 0x100 at 0x100"},
		{"ext unaligned", cfg(4096, map[int]byte{0x100: 0x01, 0x102: 0x21, 0x103: 0x14}), nil, []uint16{1}, "extended capability list: unaligned pointer 0x142 at 0x100"},
		{"ext past the bytes read", cfg(512, map[int]byte{0x100: 0x01, 0x102: 0x01, 0x103: 0x40}), nil, []uint16{1}, "pointer 0x400 past the 512 bytes read at 0x100"},
		{"ext empty header mid-list", cfg(4096, map[int]byte{0x100: 0x01, 0x102: 0x01, 0x103: 0x20}), nil, []uint16{1}, "empty header at 0x200"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			std, ext, err := tc.c.Walk()
			ids := func(cs []Capability) []uint16 {
				var out []uint16
				for _, c := range cs {
					out = append(out, c.ID)
				}
				return out
			}
			if got := ids(std); !equal16(got, tc.std) {
				t.Errorf("std %v, want %v", got, tc.std)
			}
			if got := ids(ext); !equal16(got, tc.ext) {
				t.Errorf("ext %v, want %v", got, tc.ext)
			}
			var ce *CapError
			switch {
			case tc.err == "" && err != nil:
				t.Errorf("err %v", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err) || !errors.As(err, &ce)):
				t.Errorf("err %v, want *CapError %q", err, tc.err)
			}
		})
	}
}

func equal16(a, b []uint16) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestExpressDecoding(t *testing.T) {
	c := cfg(256, map[int]byte{0x34: 0x60, 0x60: CapExpress, 0x62: 0x42, // v2, Root Port
		0x6c: 0x06, 0x6d: 0x01, 0x6f: 0x07, // LnkCap: 64GT/s x16, port 7
		0x72: 0x05, 0x73: 0x01, // LnkSta: 32GT/s x16
	})
	d := &Device{Config: c}
	d.decodeConfig()
	e := d.Express
	if e == nil || e.Type != PortRootPort || e.MaxSpeed.String() != "64GT/s" || e.MaxWidth != 16 || e.PortNum != 7 ||
		e.Speed.String() != "32GT/s" || e.Width != 16 || e.Speed.GTs() != 32 {
		t.Fatalf("%+v", e)
	}
	// A root port needs a bridge header.
	if len(d.Problems) != 1 || !strings.Contains(d.Problems[0], "express Root Port without a bridge header") {
		t.Errorf("problems %q", d.Problems)
	}
	// An integrated endpoint has no link, as lspci shows it.
	c[0x62] = 0x92
	d = &Device{Config: c}
	d.decodeConfig()
	if d.Express.Type != PortRCiEP || d.Express.HasLink {
		t.Errorf("RCiEP %+v", d.Express)
	}
	for s, want := range map[LinkSpeed]string{1: "2.5GT/s", 4: "16GT/s", 6: "64GT/s", 7: "unknown", 0: "unknown"} {
		if s.String() != want {
			t.Errorf("speed %d: %q, want %q", s, s.String(), want)
		}
	}
}

func TestACSATSSRIOVDecoding(t *testing.T) {
	c := cfg(4096, map[int]byte{
		0x100: 0x0d, 0x102: 0x01, 0x103: 0x14, // ACS -> 0x140
		0x104: 0x7f, 0x105: 0x08, 0x106: 0x5d, // cap: all flags, egress vector 8; ctl SV RR CR UF DT
		0x140: 0x0f, 0x142: 0x01, 0x143: 0x18, // ATS -> 0x180
		0x144: 0x20, 0x146: 0x05, 0x147: 0x80, // page aligned, queue depth 0 (32); Enable, STU 5
		0x180: 0x10, 0x182: 0x01, // SR-IOV, last
		0x188: 0x01, 0x18e: 0x40, 0x190: 0x10, 0x194: 0x02, 0x196: 0x01, 0x19a: 0x1e, 0x19b: 0x10,
	})
	d := &Device{Config: c}
	d.decodeConfig()
	if len(d.Problems) != 0 {
		t.Fatalf("problems %q", d.Problems)
	}
	if a := d.ACS; a == nil || a.Cap != 0x7f || a.Ctl != ACSSV|ACSRR|ACSCR|ACSUF|ACSDT || a.EgressSize != 8 || a.CtlOffset() != 0x106 {
		t.Errorf("ACS %+v", d.ACS)
	}
	if got := d.ACS.Ctl.Lspci(); got != "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+" {
		t.Errorf("lspci words %q", got)
	}
	if got := d.ACS.Ctl.String(); got != "SV RR CR UF DT" || ACSBits(0).String() != "none" {
		t.Errorf("flags %q", got)
	}
	if a := d.ATS; a == nil || !a.Enable || a.STU != 5 || !a.PageAligned || a.QueueDepth != 0 {
		t.Errorf("ATS %+v", d.ATS)
	}
	if s := d.SRIOV; s == nil || !s.VFEnable || s.TotalVFs != 64 || s.NumVFs != 16 || s.FirstVF != 2 || s.VFStride != 1 || s.VFDeviceID != 0x101e {
		t.Errorf("SR-IOV %+v", d.SRIOV)
	}
	// Capabilities cut off by the end of the bytes read are problems, not panics.
	d = &Device{Config: c[:0x145]}
	d.decodeConfig()
	if d.ATS != nil || !strings.Contains(strings.Join(d.Problems, ";"), "ats capability at 0x140 truncated") {
		t.Errorf("ATS %+v problems %q", d.ATS, d.Problems)
	}
}
