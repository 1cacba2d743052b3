package main

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/passage-boot/passage/kube/images"
	"github.com/passage-boot/passage/kube/images/debtest"
)

// TestCommand: the five layouts (passage's three, the node test's two), their tars
// (the same digests, named -registry/NAME:-tag), their digest files (the digests the
// layouts hold), the lock file and the table; a second run into the same directory gives
// the same digests; another -revision, others.
func TestCommand(t *testing.T) {
	bin := t.TempDir()
	all := append(images.Passage(), images.Node()...)
	for _, r := range all {
		if err := os.WriteFile(filepath.Join(bin, r.Name), []byte("program "+r.Name), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	deb := filepath.Join(t.TempDir(), "libc6_2.36_amd64.deb")
	if err := os.WriteFile(deb, debtest.Deb("libc6", "2.36", "amd64", map[string]string{"lib/libc.so.6": "libc"}), 0o644); err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	build := func(revision string, flags ...string) map[string]string {
		t.Helper()
		var stdout, stderr bytes.Buffer
		args := append([]string{"-bin", bin, "-out", out, "-arch", "amd64", "-created", "1765000000", "-revision", revision}, flags...)
		if code := run(append(args, deb), &stdout, &stderr); code != 0 {
			t.Fatalf("exit %d: %s", code, stderr.String())
		}
		registry, tag := "passage.test", "latest"
		if len(flags) > 0 {
			registry, tag = flags[1], flags[3]
		}
		digests := map[string]string{}
		for _, r := range all {
			b, err := os.ReadFile(filepath.Join(out, r.Name+".digest"))
			if err != nil {
				t.Fatal(err)
			}
			d := strings.TrimSpace(string(b))
			img, err := images.Read(filepath.Join(out, r.Name))
			if err != nil {
				t.Fatal(err)
			}
			if h, err := img.Digest(); err != nil || h.String() != d {
				t.Fatalf("%s: the layout holds %s, %s.digest says %s (%v)", r.Name, h, r.Name, d, err)
			}
			if !strings.Contains(stdout.String(), r.Name+"  ") || !strings.Contains(stdout.String(), d) {
				t.Errorf("the table lacks %s %s:\n%s", r.Name, d, stdout.String())
			}
			ref := registry + "/" + r.Name + ":" + tag
			if !strings.Contains(stdout.String(), ref+"@"+d+"\t"+filepath.Join(out, r.Name+".oci.tar")+"\n") {
				t.Errorf("the references lack %s@%s:\n%s", ref, d, stdout.String())
			}
			if h, got := tarIndex(t, filepath.Join(out, r.Name+".oci.tar")); h != d || got != ref {
				t.Errorf("%s.oci.tar: %s named %q, want %s named %q", r.Name, h, got, d, ref)
			}
			digests[r.Name] = d
		}
		lock, err := os.ReadFile(filepath.Join(out, "debs.lock"))
		if err != nil || !strings.HasPrefix(string(lock), "libc6 2.36 amd64 sha256:") || !strings.Contains(stdout.String(), string(lock)) {
			t.Errorf("debs.lock %q (%v); printed:\n%s", lock, err, stdout.String())
		}
		return digests
	}
	first := build("3faec1f")
	again := build("3faec1f")
	other := build("3faec1e")
	if moved := build("3faec1f", "-registry", "registry.example:5000", "-tag", "v1"); moved["pause"] != first["pause"] {
		t.Errorf("another reference changed pause's image: %s, %s", first["pause"], moved["pause"])
	}
	for name, d := range first {
		if again[name] != d {
			t.Errorf("%s: %s, then %s from the same inputs", name, d, again[name])
		}
		if other[name] == d {
			t.Errorf("%s: another revision, the same digest %s", name, d)
		}
	}

	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"-bin", bin, "-out", out}, 2, "usage: passage-images"},
		{[]string{"-bin", bin, "-out", out, "-created", "yesterday", deb}, 2, `-created "yesterday": not Unix seconds`},
		{[]string{"-bin", bin, "-out", out, "-registry", "Passage.Test/x/", deb}, 2, `-registry "Passage.Test/x/": registries must be`},
		{[]string{"-bin", bin, "-out", out, "-tag", "v1:2", deb}, 2, `-registry "passage.test" -tag "v1:2"`},
		{[]string{"-bin", t.TempDir(), "-out", out, deb}, 1, "passage-dra: open"},
		{[]string{"-bin", bin, "-out", out, bin}, 1, "passage-images: read " + bin},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(c.args, &stdout, &stderr); code != c.code || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%q: exit %d, want %d; %s", c.args, code, c.code, stderr.String())
		}
	}
}

// tarIndex is the digest and the containerd name of the one image in an OCI layout tar's
// index.json.
func tarIndex(t *testing.T, path string) (string, string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s: no index.json (%v)", path, err)
		}
		if h.Name != "index.json" {
			continue
		}
		var idx v1.IndexManifest
		if err := json.NewDecoder(tr).Decode(&idx); err != nil {
			t.Fatal(err)
		}
		if len(idx.Manifests) != 1 {
			t.Fatalf("%s: %d manifests", path, len(idx.Manifests))
		}
		return idx.Manifests[0].Digest.String(), idx.Manifests[0].Annotations[images.ContainerdName]
	}
}
