package pci

import "fmt"

// VPD is the parsed Vital Product Data (PCI 3.0 Appendix I; sysfs "vpd"): the identifier
// string and the read-only keywords. A ConnectX data-direct function pairs with its PF
// through V3, a vendor keyword both carry.
type VPD struct {
	Name     string            `json:"name,omitempty"`     // Identifier String (tag 0x82)
	Keywords map[string]string `json:"keywords,omitempty"` // VPD-R keywords: PN, SN, EC, V3, ...
}

func (v *VPD) PN() string { return v.kw("PN") }
func (v *VPD) SN() string { return v.kw("SN") }
func (v *VPD) V3() string { return v.kw("V3") }

func (v *VPD) kw(k string) string {
	if v == nil {
		return ""
	}
	return v.Keywords[k]
}

// VPD resource tags.
const (
	vpdTagID    = 0x82 // large: Identifier String
	vpdTagRO    = 0x90 // large: VPD-R
	vpdTagRW    = 0x91 // large: VPD-W
	vpdTagEnd   = 0x78 // small: End (0x0f << 3)
	vpdMaxBytes = 32768
)

// ParseVPD decodes VPD resources. It stops at the End tag; reading past the data, a
// resource whose length runs past the data, and an unknown large resource are errors
// that keep what was parsed before them.
func ParseVPD(b []byte) (*VPD, error) {
	v := &VPD{Keywords: map[string]string{}}
	if len(b) > vpdMaxBytes {
		b = b[:vpdMaxBytes]
	}
	for i := 0; i < len(b); {
		tag := b[i]
		if tag&0x80 == 0 { // small resource: tag in bits 6:3, length in 2:0
			n := int(tag & 7)
			if tag&0x78 == vpdTagEnd {
				return v, nil
			}
			i += 1 + n
			continue
		}
		if i+3 > len(b) {
			return v, fmt.Errorf("vpd: resource header at %d truncated", i)
		}
		n := int(b[i+1]) | int(b[i+2])<<8
		start, end := i+3, i+3+n
		if end > len(b) {
			return v, fmt.Errorf("vpd: resource 0x%02x at %d: length %d runs past %d bytes", tag, i, n, len(b))
		}
		switch tag {
		case vpdTagID:
			v.Name = printable(b[start:end])
		case vpdTagRO, vpdTagRW:
			if err := parseVPDKeywords(b[start:end], v.Keywords); err != nil {
				return v, fmt.Errorf("vpd: resource 0x%02x at %d: %w", tag, i, err)
			}
		}
		i = end
	}
	return v, nil
}

func parseVPDKeywords(b []byte, into map[string]string) error {
	for i := 0; i < len(b); {
		if i+3 > len(b) {
			return fmt.Errorf("keyword header at %d truncated", i)
		}
		key := string(b[i : i+2])
		n := int(b[i+2])
		if i+3+n > len(b) {
			return fmt.Errorf("keyword %q at %d: length %d runs past the resource", key, i, n)
		}
		// RV (checksum) and RW (free space) carry binary data, not text.
		if key != "RV" && key != "RW" {
			into[key] = printable(b[i+3 : i+3+n])
		}
		i += 3 + n
	}
	return nil
}

func printable(b []byte) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c >= 0x20 && c < 0x7f {
			out = append(out, c)
		}
	}
	// Trailing blanks and NULs pad fixed-size fields.
	for len(out) > 0 && out[len(out)-1] == ' ' {
		out = out[:len(out)-1]
	}
	return string(out)
}
