package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/kube/images"
	"github.com/passage-boot/passage/kube/images/debtest"
)

// TestCommand: the three layouts, their digest files (the digests the layouts hold),
// the lock file and the table; a second run into the same directory gives the same
// digests; another -revision, others.
func TestCommand(t *testing.T) {
	bin := t.TempDir()
	for _, r := range images.Passage() {
		if err := os.WriteFile(filepath.Join(bin, r.Name), []byte("program "+r.Name), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	deb := filepath.Join(t.TempDir(), "libc6_2.36_amd64.deb")
	if err := os.WriteFile(deb, debtest.Deb("libc6", "2.36", "amd64", map[string]string{"lib/libc.so.6": "libc"}), 0o644); err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	build := func(revision string) map[string]string {
		t.Helper()
		var stdout, stderr bytes.Buffer
		if code := run([]string{"-bin", bin, "-out", out, "-arch", "amd64", "-created", "1765000000", "-revision", revision, deb}, &stdout, &stderr); code != 0 {
			t.Fatalf("exit %d: %s", code, stderr.String())
		}
		digests := map[string]string{}
		for _, r := range images.Passage() {
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
		{[]string{"-bin", t.TempDir(), "-out", out, deb}, 1, "passage-dra: open"},
		{[]string{"-bin", bin, "-out", out, bin}, 1, "passage-images: read " + bin},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(c.args, &stdout, &stderr); code != c.code || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%q: exit %d, want %d; %s", c.args, code, c.code, stderr.String())
		}
	}
}
