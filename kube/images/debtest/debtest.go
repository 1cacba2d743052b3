// Package debtest writes small Debian packages for tests: deb(5)'s ar archive of
// debian-binary, control.tar.gz and data.tar.gz, as dpkg-deb --build lays them out.
package debtest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// When is every entry's modification time.
var When = time.Date(2026, 4, 27, 20, 14, 0, 0, time.UTC)

// Deb is a package named pkg at version, for arch, whose data.tar holds files (path:
// contents, paths relative without "./"; a path ending in / is a directory, a value
// starting with "->" a symbolic link to the rest), each file's parent directories
// before it.
func Deb(pkg, version, arch string, files map[string]string) []byte {
	control := fmt.Sprintf("Package: %s\nVersion: %s\nArchitecture: %s\nMaintainer: passage <passage@example.org>\nDescription: a test package\n multi-line\n", pkg, version, arch)
	var md5 strings.Builder
	for _, p := range slices.Sorted(maps.Keys(files)) {
		fmt.Fprintf(&md5, "00000000000000000000000000000000  %s\n", p)
	}
	ctl := tarGz(map[string]string{"control": control, "md5sums": md5.String()}, false)
	data := tarGz(files, true)
	var b bytes.Buffer
	b.WriteString("!<arch>\n")
	member(&b, "debian-binary", []byte("2.0\n"))
	member(&b, "control.tar.gz", ctl)
	member(&b, "data.tar.gz", data)
	return b.Bytes()
}

func member(b *bytes.Buffer, name string, data []byte) {
	fmt.Fprintf(b, "%-16s%-12d%-6d%-6d%-8s%-10d`\n", name, When.Unix(), 0, 0, "100644", len(data))
	b.Write(data)
	if len(data)%2 == 1 {
		b.WriteByte('\n')
	}
}

// tarGz is files as a gzip tar; rooted: names start with "./", after a "./" entry,
// each file's parent directories before it, as dpkg-deb writes data.tar.
func tarGz(files map[string]string, rooted bool) []byte {
	var buf bytes.Buffer
	z := gzip.NewWriter(&buf)
	tw := tar.NewWriter(z)
	prefix := ""
	if rooted {
		prefix = "./"
		must(tw.WriteHeader(&tar.Header{Name: "./", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: When, Uname: "root", Gname: "root"}))
	}
	written := map[string]bool{}
	for _, p := range slices.Sorted(maps.Keys(files)) {
		parts := strings.Split(strings.TrimSuffix(p, "/"), "/")
		for i := 1; i < len(parts) && rooted; i++ {
			d := strings.Join(parts[:i], "/") + "/"
			if !written[d] {
				written[d] = true
				must(tw.WriteHeader(&tar.Header{Name: prefix + d, Typeflag: tar.TypeDir, Mode: 0o755, ModTime: When, Uname: "root", Gname: "root"}))
			}
		}
		v := files[p]
		h := &tar.Header{Name: prefix + p, Typeflag: tar.TypeReg, Mode: 0o644, ModTime: When, Size: int64(len(v)), Uname: "root", Gname: "root"}
		switch {
		case strings.HasSuffix(p, "/"):
			if written[p] {
				continue
			}
			written[p] = true
			h.Typeflag, h.Mode, h.Size = tar.TypeDir, 0o755, 0
		case strings.HasPrefix(v, "->"):
			h.Typeflag, h.Mode, h.Size, h.Linkname = tar.TypeSymlink, 0o777, 0, v[2:]
		}
		must(tw.WriteHeader(h))
		if h.Typeflag == tar.TypeReg {
			_, err := tw.Write([]byte(v))
			must(err)
		}
	}
	must(tw.Close())
	must(z.Close())
	return buf.Bytes()
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}
