package pci

import (
	"strings"
	"testing"
)

func TestParseVPD(t *testing.T) {
	good := []byte{0x82, 5, 0, 'C', 'X', '-', '8', ' ',
		0x90, 19, 0, 'P', 'N', 3, 'a', 'b', 'c', 'S', 'N', 2, 'x', 0, 'V', '3', 1, 'q', 'R', 'V', 1, 0,
		0x78}
	for _, tc := range []struct {
		name    string
		in      []byte
		wantErr string
		check   func(t *testing.T, v *VPD)
	}{
		{"good", good, "", func(t *testing.T, v *VPD) {
			if v.Name != "CX-8" || v.PN() != "abc" || v.SN() != "x" || v.V3() != "q" {
				t.Errorf("%+v", v)
			}
			if _, ok := v.Keywords["RV"]; ok {
				t.Error("RV checksum kept as text")
			}
		}},
		{"stops at End", append(append([]byte{}, good...), 0x82, 0xff, 0xff), "", nil},
		{"empty", nil, "", func(t *testing.T, v *VPD) {
			if v.Name != "" || len(v.Keywords) != 0 {
				t.Errorf("%+v", v)
			}
		}},
		{"resource past the data", []byte{0x82, 10, 0, 'a'}, "vpd: resource 0x82 at 0: length 10 runs past 4 bytes", nil},
		{"header truncated", []byte{0x82, 1}, "vpd: resource header at 0 truncated", nil},
		{"keyword past the resource", []byte{0x90, 4, 0, 'P', 'N', 9, 'a'}, `keyword "PN" at 0: length 9 runs past the resource`, nil},
		{"keyword header truncated", []byte{0x90, 2, 0, 'P', 'N'}, "keyword header at 0 truncated", nil},
		{"keeps what came before", []byte{0x82, 1, 0, 'n', 0x90, 9, 0}, "runs past", func(t *testing.T, v *VPD) {
			if v.Name != "n" {
				t.Errorf("%+v", v)
			}
		}},
		{"all 0xff (no VPD programmed)", []byte{0xff, 0xff, 0xff, 0xff}, "length 65535 runs past", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, err := ParseVPD(tc.in)
			if v == nil {
				t.Fatal("nil VPD")
			}
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Errorf("err %v, want %q", err, tc.wantErr)
			}
			if tc.check != nil {
				tc.check(t, v)
			}
		})
	}
	var none *VPD
	if none.PN() != "" {
		t.Error("nil VPD has a PN")
	}
}
