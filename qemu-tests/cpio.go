package qemutest

import (
	"bytes"
	"fmt"
	"os"
	"path"
	"sort"
	"strings"
)

// OverlayFile is one file of an initramfs overlay.
type OverlayFile struct {
	Name string      // path inside the initramfs, relative ("bbin/uinit")
	Data []byte      //
	Mode os.FileMode // permission bits; 0 = 0644
}

// writeOverlay writes a newc cpio archive (the format the kernel's initramfs unpacker
// reads: Documentation/driver-api/early-userspace/buffer-format.rst) with the
// files and the directories above them. Times and inodes are fixed so the archive is
// the same bytes every time.
func writeOverlay(dst string, files []OverlayFile) error {
	var b bytes.Buffer
	ino := 1
	hdr := func(name string, mode uint32, size int) {
		fmt.Fprintf(&b, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
			ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name)+1, 0)
		ino++
		b.WriteString(name)
		b.WriteByte(0)
		for b.Len()%4 != 0 {
			b.WriteByte(0)
		}
	}
	dirs := map[string]bool{}
	var dirList []string
	for _, f := range files {
		if f.Name == "" || path.IsAbs(f.Name) || strings.Contains(f.Name, "..") {
			return fmt.Errorf("overlay %q: want a relative path inside the initramfs", f.Name)
		}
		for d := path.Dir(path.Clean(f.Name)); d != "." && !dirs[d]; d = path.Dir(d) {
			dirs[d] = true
			dirList = append(dirList, d)
		}
	}
	sort.Strings(dirList)
	for _, d := range dirList {
		hdr(d, 0o040755, 0)
	}
	for _, f := range files {
		mode := uint32(f.Mode.Perm())
		if mode == 0 {
			mode = 0o644
		}
		hdr(path.Clean(f.Name), 0o100000|mode, len(f.Data))
		b.Write(f.Data)
		for b.Len()%4 != 0 {
			b.WriteByte(0)
		}
	}
	hdr("TRAILER!!!", 0, 0)
	if err := os.WriteFile(dst, b.Bytes(), 0o644); err != nil {
		return fmt.Errorf("overlay %s: %w", dst, err)
	}
	return nil
}
