package rootdev

import (
	"bytes"
	"testing"
)

// The superblock and partition-table readers take a disk's bytes, which anyone who
// wrote to the disk chose: they must never panic, and what they report must be what the
// bytes hold (a UUID is 36 characters, a label at most 16 bytes).
func FuzzDiskBytes(f *testing.F) {
	f.Add(ext4(rootUUID, "root"), 1)
	f.Add(gptDisk(2, partGUID), 2)
	f.Add(mbrDisk(0xdeadbeef), 1)
	f.Add([]byte("XFSB"+string(make([]byte, 2044))), 1)
	f.Fuzz(func(t *testing.T, b []byte, n int) {
		r := bytes.NewReader(b)
		fstype, uuid, label := superblock(r)
		if fstype == "" && (uuid != "" || label != "") {
			t.Fatalf("identities %q %q without a filesystem", uuid, label)
		}
		if uuid != "" && len(uuid) != 36 || len(label) > 16 {
			t.Fatalf("uuid %q label %q", uuid, label)
		}
		for _, sector := range []int64{512, 4096} {
			if p := gptPartUUID(r, sector, n); p != "" && len(p) != 36 && len(p) != 11 {
				t.Fatalf("partuuid %q", p)
			}
		}
		if s, err := Parse(string(b)); err == nil && s.String() == "" {
			t.Fatalf("Parse(%q) accepted an empty spec", b)
		}
	})
}
