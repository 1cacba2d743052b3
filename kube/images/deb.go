package images

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strconv"
	"strings"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// Deb is one Debian binary package, read whole: what a base layer is made of. The
// format is deb(5): an ar(5) archive of debian-binary ("2.0\n"), control.tar[.COMP] and
// data.tar[.COMP], in that order.
type Deb struct {
	Package      string // control: Package
	Version      string // control: Version
	Architecture string // control: Architecture
	SHA256       string // of the .deb file, hex: what Debian's Packages index lists
	Control      []byte // control.tar's ./control, the package's paragraph
	MD5Sums      []byte // control.tar's ./md5sums (absent in some packages)
	// ControlTime is control.tar's ./control entry's modification time (dpkg-deb sets
	// it from the package's build), the time given to the dpkg status files the layer
	// adds: the layer is then a function of the .deb alone.
	ControlTime int64
	data        []byte // data.tar, uncompressed
}

// maxMember bounds one decompressed member of a .deb (Debian's largest packages
// unpack to a few GiB; a base's to megabytes), maxControl a control file (libc6's
// md5sums, its largest, is 21 kB).
const (
	maxMember  = 1 << 30
	maxControl = 1 << 20
)

// OpenDeb reads the .deb at path.
func OpenDeb(path string) (*Deb, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	d, err := ReadDeb(b)
	if err != nil {
		return nil, fmt.Errorf("deb %s: %w", path, err)
	}
	return d, nil
}

// ReadDeb reads a .deb's bytes.
func ReadDeb(b []byte) (*Deb, error) {
	members, err := readAr(b)
	if err != nil {
		return nil, err
	}
	if len(members) == 0 || members[0].name != "debian-binary" {
		return nil, errors.New("not a deb: debian-binary is not the first ar member")
	}
	if v := string(members[0].data); !strings.HasPrefix(v, "2.") {
		return nil, fmt.Errorf("deb format %q, not 2.x", strings.TrimSpace(v))
	}
	sum := sha256.Sum256(b)
	d := &Deb{SHA256: hex.EncodeToString(sum[:])}
	var control []byte
	for _, m := range members[1:] {
		base, comp, _ := strings.Cut(m.name, ".tar")
		if base != "control" && base != "data" {
			continue // deb(5): members after these, or starting with _, are ignored
		}
		raw, err := decompress(comp, m.data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.name, err)
		}
		if base == "control" {
			control = raw
		} else {
			d.data = raw
		}
	}
	if control == nil || d.data == nil {
		return nil, errors.New("not a deb: no control.tar or data.tar member")
	}
	if err := d.readControl(control); err != nil {
		return nil, fmt.Errorf("control.tar: %w", err)
	}
	return d, nil
}

type arMember struct {
	name string
	data []byte
}

// readAr splits a common ar(5) archive: "!<arch>\n", then per member a 60-byte header
// (name 16, mtime 12, uid 6, gid 6, mode 8, size 10, "`\n") and its data, padded to an
// even offset. GNU ar's "/" name suffix is dropped.
func readAr(b []byte) ([]arMember, error) {
	const magic = "!<arch>\n"
	if !bytes.HasPrefix(b, []byte(magic)) {
		return nil, errors.New("not an ar archive")
	}
	var ms []arMember
	for off := len(magic); off < len(b); {
		if len(b)-off < 60 {
			return nil, fmt.Errorf("ar: header at %d truncated", off)
		}
		h := b[off : off+60]
		if string(h[58:60]) != "`\n" {
			return nil, fmt.Errorf("ar: header at %d: bad terminator", off)
		}
		size, err := strconv.ParseInt(strings.TrimSpace(string(h[48:58])), 10, 64)
		if err != nil || size < 0 {
			return nil, fmt.Errorf("ar: header at %d: size %q", off, h[48:58])
		}
		off += 60
		if size > int64(len(b)-off) {
			return nil, fmt.Errorf("ar: member at %d: %d bytes, %d left", off-60, size, len(b)-off)
		}
		name := strings.TrimSuffix(strings.TrimSpace(string(h[:16])), "/")
		ms = append(ms, arMember{name: name, data: b[off : off+int(size)]})
		off += int(size) + int(size)&1
	}
	return ms, nil
}

// decompress undoes a member's compression, named by its suffix after ".tar" (deb(5):
// none, .gz, .xz, .zst, .bz2; .lzma is deprecated and not read).
func decompress(suffix string, b []byte) ([]byte, error) {
	var r io.Reader
	switch suffix {
	case "":
		return b, nil
	case ".gz":
		z, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, err
		}
		r = z
	case ".xz":
		z, err := xz.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, err
		}
		r = z
	case ".zst":
		z, err := zstd.NewReader(bytes.NewReader(b), zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(maxMember))
		if err != nil {
			return nil, err
		}
		defer z.Close()
		r = z
	case ".bz2":
		r = bzip2.NewReader(bytes.NewReader(b))
	default:
		return nil, fmt.Errorf("compression %q not read", suffix)
	}
	out, err := io.ReadAll(io.LimitReader(r, maxMember+1))
	if err != nil {
		return nil, err
	}
	if len(out) > maxMember {
		return nil, fmt.Errorf("more than %d bytes decompressed", maxMember)
	}
	return out, nil
}

// readControl takes ./control and ./md5sums from control.tar and the three fields a
// layer needs from the control paragraph (deb-control(5)).
func (d *Deb) readControl(tarball []byte) error {
	tr := tar.NewReader(bytes.NewReader(tarball))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		var dst *[]byte
		if h.Typeflag != tar.TypeReg {
			continue
		}
		switch path.Clean(h.Name) {
		case "control":
			dst = &d.Control
			d.ControlTime = h.ModTime.Unix()
		case "md5sums":
			dst = &d.MD5Sums
		default:
			continue
		}
		if *dst, err = io.ReadAll(io.LimitReader(tr, maxControl+1)); err != nil {
			return err
		}
		if len(*dst) > maxControl {
			return fmt.Errorf("./%s: more than %d bytes", path.Clean(h.Name), maxControl)
		}
	}
	if d.Control == nil {
		return errors.New("no ./control")
	}
	f := controlFields(d.Control)
	d.Package, d.Version, d.Architecture = f["Package"], f["Version"], f["Architecture"]
	if d.Package == "" || d.Version == "" || d.Architecture == "" {
		return fmt.Errorf("control lacks Package, Version or Architecture (%q %q %q)", d.Package, d.Version, d.Architecture)
	}
	if strings.ContainsAny(d.Package, "/ \t") || d.Package == "." || d.Package == ".." {
		return fmt.Errorf("package name %q", d.Package)
	}
	return nil
}

// controlFields are a control paragraph's single-line fields; continuation lines
// (starting with a space or tab) belong to the field before and are not kept.
func controlFields(b []byte) map[string]string {
	f := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, len(b)+1)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			break // one paragraph
		}
		if line[0] == ' ' || line[0] == '\t' {
			continue
		}
		if k, v, ok := strings.Cut(line, ":"); ok {
			f[k] = strings.TrimSpace(v)
		}
	}
	return f
}

// String is the package as a lock file line names it.
func (d *Deb) String() string {
	return fmt.Sprintf("%s %s %s sha256:%s", d.Package, d.Version, d.Architecture, d.SHA256)
}
