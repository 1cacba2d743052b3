package erase

import (
	"encoding/binary"
	"testing"
)

// FuzzParse feeds controller bytes (Identify Controller, Identify Namespace, the active
// namespace list, the Sanitize Status log) to the decoders: none panics, and what they
// accept stays within what the data can say.
func FuzzParse(f *testing.F) {
	id := make([]byte, IdentifySize)
	binary.LittleEndian.PutUint32(id[328:], SANICAPCES|SANICAPBES)
	id[524] = FNACrypto
	f.Add(id)
	ns := make([]byte, IdentifySize)
	binary.LittleEndian.PutUint64(ns[0:], 1<<20)
	ns[26], ns[128+2] = 0x1, 12
	f.Add(ns)
	f.Add([]byte{1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{0, 0x40, 2, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		if c, err := ParseIDController(b); err == nil && len(c.Serial) > 20*4+2 {
			t.Fatalf("serial %q longer than its field", c.Serial)
		}
		if n, err := ParseIDNamespace(b); err == nil {
			if bs := n.BlockSize(); bs != 0 && (bs < 512 || bs > 1<<24) {
				t.Fatalf("block size %d", bs)
			}
			if d := n.Deallocated(); d != 0 && d != 0xff {
				t.Fatalf("deallocated pattern 0x%02x", d)
			}
			if c := n.FormatCDW10(SESCrypto); c>>14 != 0 {
				t.Fatalf("format CDW10 0x%08x sets reserved bits", c)
			}
		}
		if ids := ParseNSList(b); len(ids) > IdentifySize/4 {
			t.Fatalf("%d namespace IDs", len(ids))
		}
		if s, err := ParseSanitizeStatus(b); err == nil {
			_ = s.State().String()
		}
		for _, l := range sampleLBAs(uint64(len(b)), 7) {
			if l >= uint64(len(b)) {
				t.Fatalf("sampled lba %d beyond %d blocks", l, len(b))
			}
		}
	})
}
