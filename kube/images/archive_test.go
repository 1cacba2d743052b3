package images

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// TestWriteTar: the tar is an OCI image layout (read back by go-containerregistry's
// layout reader, unpacked) holding the image Write holds, its index naming the full
// reference as both RefName and ContainerdName; two writes give the same bytes; another
// reference, other bytes and the same image; a reference without a registry or with a
// bad tag is refused, and nothing is left behind.
func TestWriteTar(t *testing.T) {
	img, err := Build(draSpec(t))
	if err != nil {
		t.Fatal(err)
	}
	want, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "passage-dra.oci.tar")
	const ref = "passage.test/passage-dra:v1"
	got, err := WriteTar(p, img, ref)
	if err != nil || got != want {
		t.Fatalf("WriteTar: %s (%v), the image is %s", got, err, want)
	}
	first, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}

	layout := untar(t, first)
	back, err := Read(layout)
	if err != nil {
		t.Fatal(err)
	}
	if h, err := back.Digest(); err != nil || h != want {
		t.Errorf("read back: %s (%v), want %s", h, err, want)
	}
	if files := extract(t, back); string(files["usr/bin/passage-dra"].data) != "\x7fELF passage-dra" {
		t.Errorf("read back: no /usr/bin/passage-dra")
	}
	var idx v1.IndexManifest
	b, err := os.ReadFile(filepath.Join(layout, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatal(err)
	}
	if len(idx.Manifests) != 1 || idx.Manifests[0].Annotations[RefName] != ref || idx.Manifests[0].Annotations[ContainerdName] != ref ||
		idx.Manifests[0].Platform == nil || idx.Manifests[0].Platform.Architecture != "amd64" {
		t.Errorf("index.json: %s", b)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	blobs, err := os.ReadDir(filepath.Join(layout, "blobs", "sha256"))
	if err != nil || len(blobs) != len(m.Layers)+2 {
		t.Errorf("%d blobs (%v), want %d layers, the config and the manifest", len(blobs), err, len(m.Layers))
	}

	if _, err := WriteTar(p, img, ref); err != nil {
		t.Fatal(err)
	}
	if again, err := os.ReadFile(p); err != nil || !bytes.Equal(again, first) {
		t.Errorf("a second write: other bytes (%v)", err)
	}
	other := filepath.Join(dir, "other.oci.tar")
	if h, err := WriteTar(other, img, "passage.test/passage-dra:v2"); err != nil || h != want {
		t.Errorf("another reference: %s (%v)", h, err)
	}
	if b, _ := os.ReadFile(other); bytes.Equal(b, first) {
		t.Errorf("another reference, the same tar")
	}

	for _, bad := range []string{"passage-dra", "passage.test/passage-dra", "passage.test/Passage-DRA:v1", "passage.test/passage-dra:v1@sha256:" + strings.Repeat("0", 64)} {
		if _, err := WriteTar(filepath.Join(dir, "bad.oci.tar"), img, bad); err == nil || !strings.Contains(err.Error(), bad) {
			t.Errorf("reference %q: %v", bad, err)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "*bad*")); len(left) != 0 {
		t.Errorf("left behind: %q", left)
	}
}

// untar writes the tar's regular files and directories below a temporary directory.
func untar(t *testing.T, b []byte) string {
	t.Helper()
	dir := t.TempDir()
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return dir
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, 0o755)
		case tar.TypeReg:
			var data []byte
			if data, err = io.ReadAll(tr); err == nil {
				err = os.WriteFile(p, data, 0o644)
			}
		default:
			t.Fatalf("%s: type %q", h.Name, h.Typeflag)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}
