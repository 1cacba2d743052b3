package images

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/passage-boot/passage/kube/images/debtest"
)

// testDebs are a small glibc-like base: a loader, a libc and a symbolic link to it.
func testDebs(t *testing.T) []*Deb {
	t.Helper()
	var debs []*Deb
	for _, b := range [][]byte{
		debtest.Deb("libc6", "2.36-9+deb12u14", "amd64", map[string]string{
			"lib/x86_64-linux-gnu/libc.so.6":            "libc contents",
			"lib/x86_64-linux-gnu/ld-linux-x86-64.so.2": "ld.so",
			"lib64/ld-linux-x86-64.so.2":                "->/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
		}),
		debtest.Deb("base-files", "12.4+deb12u15", "amd64", map[string]string{
			"usr/lib/os-release": "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n",
			"etc/os-release":     "->../usr/lib/os-release",
			"tmp/":               "",
		}),
	} {
		d, err := ReadDeb(b)
		if err != nil {
			t.Fatal(err)
		}
		debs = append(debs, d)
	}
	return debs
}

func draSpec(t *testing.T) Spec {
	return Spec{
		Recipe:  Passage()[0],
		Binary:  []byte("\x7fELF passage-dra"),
		Debs:    testDebs(t),
		Arch:    "amd64",
		Created: time.Unix(1765000000, 0),
		Labels:  map[string]string{LabelRevision: "3faec1f", LabelSource: "https://github.com/passage-boot/passage"},
	}
}

func digest(t *testing.T, s Spec) v1.Hash {
	t.Helper()
	img, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	h, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestReproducible: the same inputs give the same digest, also written to a layout
// twice (the same index.json, the same digest read back); the base's order does not
// matter; each input changed gives another.
func TestReproducible(t *testing.T) {
	want := digest(t, draSpec(t))
	if got := digest(t, draSpec(t)); got != want {
		t.Fatalf("two builds: %s, %s", want, got)
	}
	s := draSpec(t)
	slices.Reverse(s.Debs)
	if got := digest(t, s); got != want {
		t.Errorf("the base's packages in another order: %s, not %s", got, want)
	}
	var index []byte
	for i := range 2 {
		img, err := Build(draSpec(t))
		if err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(t.TempDir(), "passage-dra")
		h, err := Write(dir, img, "latest")
		if err != nil {
			t.Fatal(err)
		}
		back, err := Read(dir)
		if err != nil {
			t.Fatal(err)
		}
		bh, err := back.Digest()
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(dir, "index.json"))
		if err != nil {
			t.Fatal(err)
		}
		if h != want || bh != want || i == 1 && !bytes.Equal(b, index) {
			t.Fatalf("layout %d: written %s, read back %s, built %s; index.json\n%s\nbefore\n%s", i, h, bh, want, b, index)
		}
		index = b
	}

	for _, c := range []struct {
		name   string
		change func(*Spec)
	}{
		{"a byte of the binary", func(s *Spec) { s.Binary[len(s.Binary)-1] ^= 1 }},
		{"the binary's path", func(s *Spec) { s.Path = "/usr/local/bin/passage-dra" }},
		{"the user", func(s *Spec) { s.User = "65532:65532" }},
		{"the creation time", func(s *Spec) { s.Created = s.Created.Add(time.Second) }},
		{"a label", func(s *Spec) { s.Labels[LabelRevision] = "3faec1e" }},
		{"a package's version", func(s *Spec) {
			s.Debs[0] = testDebs(t)[0]
			s.Debs[0].Version = "2.36-9+deb12u15"
		}},
		{"a byte of a package's data", func(s *Spec) {
			d := *s.Debs[0]
			d.data = bytes.Replace(d.data, []byte("libc contents"), []byte("libC contents"), 1)
			s.Debs[0] = &d
		}},
		{"a package left out", func(s *Spec) { s.Debs = s.Debs[1:] }},
	} {
		s := draSpec(t)
		c.change(&s)
		if got := digest(t, s); got == want {
			t.Errorf("%s changed: the digest stayed %s", c.name, got)
		}
	}
}

// TestConfig: each of passage's images and the node test's (Node), written and read
// back, names its entrypoint, user, PATH, working directory, labels and creation time;
// its files are where the entrypoint says, with fixed owners, modes and times.
func TestConfig(t *testing.T) {
	for _, r := range append(Passage(), Node()...) {
		t.Run(r.Name, func(t *testing.T) {
			s := draSpec(t)
			s.Recipe, s.Binary = r, []byte("program "+r.Name)
			if !r.Glibc {
				s.Debs = nil
			}
			img, err := Build(s)
			if err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(t.TempDir(), r.Name)
			if _, err := Write(dir, img, "v1"); err != nil {
				t.Fatal(err)
			}
			if img, err = Read(dir); err != nil {
				t.Fatal(err)
			}
			cf, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			c := cf.Config
			if !slices.Equal(c.Entrypoint, []string{r.Path}) || c.User != r.User || c.WorkingDir != "/" || !slices.Equal(c.Env, []string{PATH}) {
				t.Errorf("config: entrypoint %q user %q workdir %q env %q", c.Entrypoint, c.User, c.WorkingDir, c.Env)
			}
			if c.Labels[LabelRevision] != "3faec1f" || c.Labels[LabelSource] == "" || c.Labels[LabelVersion] != "" {
				t.Errorf("labels %v", c.Labels)
			}
			if cf.Architecture != "amd64" || cf.OS != "linux" || !cf.Created.Equal(s.Created) || len(cf.History) != len(cf.RootFS.DiffIDs) {
				t.Errorf("config: %s/%s created %v, %d history entries for %d layers", cf.OS, cf.Architecture, cf.Created, len(cf.History), len(cf.RootFS.DiffIDs))
			}
			files := extract(t, img)
			bin, ok := files[strings.TrimPrefix(r.Path, "/")]
			if !ok || string(bin.data) != "program "+r.Name || bin.Mode != 0o755 || bin.Uid != 0 || !bin.ModTime.Equal(epoch) {
				t.Errorf("%s: %+v", r.Path, bin.Header)
			}
			if p := files["etc/passwd"]; !strings.Contains(string(p.data), "nonroot:x:65532:65532:") {
				t.Errorf("/etc/passwd: %q", p.data)
			}
			if tmp := files["tmp"]; tmp.Mode != 0o1777 {
				t.Errorf("/tmp mode %o", tmp.Mode)
			}
			libc, ok := files["lib/x86_64-linux-gnu/libc.so.6"]
			status := files["var/lib/dpkg/status.d/libc6"]
			if r.Glibc != ok || r.Glibc && (string(libc.data) != "libc contents" || !libc.ModTime.Equal(debtest.When) ||
				!strings.HasPrefix(string(status.data), "Package: libc6\nVersion: 2.36-9+deb12u14\n") ||
				c.Labels[LabelDeb+"libc6"] != "2.36-9+deb12u14 sha256:"+s.Debs[0].SHA256 ||
				files["lib64/ld-linux-x86-64.so.2"].Linkname != "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2") {
				t.Errorf("glibc base %v: libc.so.6 %+v, status %q, labels %v", r.Glibc, libc.Header, status.data, c.Labels)
			}
		})
	}
}

type entry struct {
	tar.Header
	data []byte
}

// extract is the image's flattened file system (mutate.Extract), by name.
func extract(t *testing.T, img v1.Image) map[string]entry {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	files := map[string]entry{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = entry{*h, b}
	}
}

// TestBuildRefuses: what Build and ReadDeb refuse, each named.
func TestBuildRefuses(t *testing.T) {
	for _, c := range []struct {
		name   string
		change func(*Spec)
		want   string
	}{
		{"a relative path", func(s *Spec) { s.Path = "usr/bin/passage-dra" }, "not a clean absolute file path"},
		{"no binary", func(s *Spec) { s.Binary = nil }, "no user, architecture or program"},
		{"no base for glibc", func(s *Spec) { s.Debs = nil }, "glibc base true, 0 packages given"},
		{"a base for a static image", func(s *Spec) { s.Glibc = false }, "glibc base false, 2 packages given"},
		{"another architecture", func(s *Spec) { s.Arch = "arm64" }, "package base-files is amd64, the image arm64"},
		{"a package twice", func(s *Spec) { s.Debs = append(s.Debs, testDebs(t)[0]) }, "package libc6 given twice"},
	} {
		s := draSpec(t)
		c.change(&s)
		if _, err := Build(s); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	deb := debtest.Deb("libc6", "2.36", "amd64", map[string]string{"lib/libc.so.6": "libc"})
	for _, c := range []struct {
		name string
		b    []byte
		want string
	}{
		{"not ar", []byte("PK\x03\x04"), "not an ar archive"},
		{"truncated", deb[:len(deb)-100], "bytes,"},
		{"no data.tar", deb[:bytes.Index(deb, []byte("data.tar.gz"))], "no control.tar or data.tar member"},
		{"unknown compression", bytes.Replace(deb, []byte("data.tar.gz "), []byte("data.tar.lz4"), 1), `compression ".lz4" not read`},
	} {
		if _, err := ReadDeb(c.b); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	dir := t.TempDir()
	img, err := Build(draSpec(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Write(dir, img, ""); err == nil || !strings.Contains(err.Error(), "not an OCI image layout") {
		t.Errorf("a directory that is not a layout replaced: %v", err)
	}
}

// FuzzReadDeb: no .deb, however broken, panics the reader or its layer.
func FuzzReadDeb(f *testing.F) {
	f.Add(debtest.Deb("libc6", "2.36", "amd64", map[string]string{"lib/libc.so.6": "libc", "lib64/ld.so": "->/lib/ld.so", "tmp/": ""}))
	f.Add([]byte("!<arch>\ndebian-binary   0           0     0     100644  4         `\n2.0\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := ReadDeb(b)
		if err != nil {
			return
		}
		if d.Package == "" || d.Version == "" || d.Architecture == "" {
			t.Fatalf("read without its names: %+v", d)
		}
		_, _ = d.Layer()
	})
}
