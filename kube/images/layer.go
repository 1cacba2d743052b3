package images

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// epoch is the modification time of every file passage-images makes itself (the
// accounts, the binary): a layer's bytes then depend on its contents alone, so a layer
// that did not change between two commits is the same blob in both.
var epoch = time.Unix(0, 0).UTC()

// file is one entry of a layer passage-images makes.
type file struct {
	name     string // relative, no leading slash; a directory's ends in /
	mode     int64
	uid, gid int
	data     []byte
}

func dir(name string, mode int64, uid int) file {
	return file{name: strings.TrimSuffix(name, "/") + "/", mode: mode, uid: uid, gid: uid}
}

// layerOf writes files, in their order, as one tar layer.
func layerOf(files []file) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := &tar.Header{Name: f.name, Mode: f.mode, Uid: f.uid, Gid: f.gid, ModTime: epoch, Typeflag: tar.TypeReg, Size: int64(len(f.data))}
		if strings.HasSuffix(f.name, "/") {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", f.name, err)
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", f.name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return layerFromBytes(buf.Bytes())
}

// layerFromBytes is an OCI gzip layer of an uncompressed tar. go-containerregistry
// compresses it with compress/gzip, whose output is a function of its input (the
// gzip header carries no name or time): the layer's digest is the tar's.
func layerFromBytes(b []byte) (v1.Layer, error) {
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
}

// accounts is the layer every image has, the users and directories distroless's bases
// have: root (0), nobody (65534) and nonroot (65532) with their groups, nonroot's home,
// /root, and a /tmp anyone can write (Go's os.TempDir). No shell: every account's is
// /sbin/nologin, which the image does not have either.
func accounts() (v1.Layer, error) {
	passwd := "root:x:0:0:root:/root:/sbin/nologin\n" +
		"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n" +
		"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
	group := "root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n"
	return layerOf([]file{
		dir("etc", 0o755, 0),
		{name: "etc/group", mode: 0o644, data: []byte(group)},
		{name: "etc/passwd", mode: 0o644, data: []byte(passwd)},
		dir("home", 0o755, 0),
		dir("home/nonroot", 0o700, 65532),
		dir("root", 0o700, 0),
		dir("tmp", 0o1777, 0),
	})
}

// binaryLayer is the program at p (absolute), its parent directories before it.
func binaryLayer(p string, bin []byte) (v1.Layer, error) {
	rel := strings.TrimPrefix(path.Clean(p), "/")
	var files []file
	for d := path.Dir(rel); d != "."; d = path.Dir(d) {
		files = append(files, dir(d, 0o755, 0))
	}
	slices.Reverse(files)
	return layerOf(append(files, file{name: rel, mode: 0o755, data: bin}))
}

// statusDir is where a package's control paragraph goes in an image without dpkg's
// database, as distroless writes it: vulnerability scanners (Trivy, Syft, Grype) read
// the packages, their versions and files from there.
const statusDir = "var/lib/dpkg/status.d"

// Layer is the package's data.tar as an image layer, and its control paragraph and
// md5sums under var/lib/dpkg/status.d. Names lose data.tar's leading "./"; ownership is
// numeric; modes, times and contents are the package's, and the status files take
// ./control's time: the layer is a function of the .deb alone. Maintainer scripts are
// not run (nothing in a base needs them: libc6's only restart services or migrate an
// installed system), as distroless does not.
func (d *Deb) Layer() (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	seen := map[string]bool{}
	tr := tar.NewReader(bytes.NewReader(d.data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("deb %s: data.tar: %w", d.Package, err)
		}
		name := clean(h.Name)
		if name == "" {
			continue // ./, the root itself
		}
		for k := range h.PAXRecords {
			// A GNU sparse file's holes read as zeros: a few bytes could claim
			// gigabytes. dpkg-deb never writes one.
			if strings.HasPrefix(k, "GNU.sparse.") {
				return nil, fmt.Errorf("deb %s: data.tar: %s: a sparse file", d.Package, h.Name)
			}
		}
		n := &tar.Header{Typeflag: h.Typeflag, Name: name, Mode: h.Mode & 0o7777, Uid: h.Uid, Gid: h.Gid, ModTime: h.ModTime}
		switch h.Typeflag {
		case tar.TypeReg:
			n.Size = h.Size
		case tar.TypeDir:
			n.Name += "/"
		case tar.TypeSymlink:
			n.Linkname = h.Linkname
		case tar.TypeLink:
			if n.Linkname = clean(h.Linkname); n.Linkname == "" {
				return nil, fmt.Errorf("deb %s: data.tar: %s: hard link to the root", d.Package, h.Name)
			}
		default:
			return nil, fmt.Errorf("deb %s: data.tar: %s: type %q not taken into an image", d.Package, h.Name, h.Typeflag)
		}
		seen[n.Name] = true
		if err := tw.WriteHeader(n); err != nil {
			return nil, fmt.Errorf("deb %s: %s: %w", d.Package, name, err)
		}
		if n.Size > 0 {
			if _, err := io.CopyN(tw, tr, n.Size); err != nil {
				return nil, fmt.Errorf("deb %s: %s: %w", d.Package, name, err)
			}
		}
	}
	t := time.Unix(d.ControlTime, 0).UTC()
	status := []file{}
	for p := statusDir; p != "."; p = path.Dir(p) {
		if !seen[p+"/"] {
			status = append(status, dir(p, 0o755, 0))
		}
	}
	slices.Reverse(status)
	status = append(status, file{name: statusDir + "/" + d.Package, mode: 0o644, data: d.Control})
	if d.MD5Sums != nil {
		status = append(status, file{name: statusDir + "/" + d.Package + ".md5sums", mode: 0o644, data: d.MD5Sums})
	}
	for _, f := range status {
		h := &tar.Header{Name: f.name, Mode: f.mode, ModTime: t, Typeflag: tar.TypeReg, Size: int64(len(f.data))}
		if strings.HasSuffix(f.name, "/") {
			h.Typeflag = tar.TypeDir
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("deb %s: %s: %w", d.Package, f.name, err)
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return layerFromBytes(buf.Bytes())
}

// clean is a data.tar name relative to the image's root: "./lib64/" is "lib64", "./"
// is "". Cleaning it below a root keeps ".." from leaving it.
func clean(name string) string {
	return strings.TrimPrefix(path.Clean("/"+name), "/")
}
