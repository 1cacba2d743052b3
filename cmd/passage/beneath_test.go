package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
)

// boot --root T obeys T's command line and links only beneath T: a passage.log= that
// climbs out, a key file that is a link out of T, a run directory that is a link out
// of T: nothing is written outside T and no key outside T signs.
func TestBootStaysBeneathRoot(t *testing.T) {
	outside := t.TempDir()
	priv, pub, err := manifest.GenerateKey(outside)
	if err != nil {
		t.Fatal(err)
	}
	outV, err := manifest.LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	const base = "console=ttyS0 passage.profile=b300 passage.tpm=off passage.handoff=poweroff passage.key=/etc/passage/passage.key"
	climb := strings.Repeat("/..", 12) + outside

	for _, tc := range []struct {
		name    string
		cmdline string
		setup   func(root string)
	}{
		{"log climbs out", base + " passage.log=" + climb + "/escape.log", nil},
		{"key given outside", strings.Replace(base, "passage.key=/etc/passage/passage.key", "passage.key="+climb+"/passage.key", 1), nil},
		{"key is a link out", base, func(root string) {
			k := filepath.Join(root, "etc/passage/passage.key")
			os.Remove(k)
			if err := os.Symlink(priv, k); err != nil {
				t.Fatal(err)
			}
		}},
		{"run dir is a link out", base, func(root string) {
			os.RemoveAll(filepath.Join(root, "run/passage"))
			os.MkdirAll(filepath.Join(root, "run"), 0o755)
			if err := os.Symlink(outside, filepath.Join(root, "run/passage")); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := bootTree(t, tc.cmdline)
			if tc.setup != nil {
				tc.setup(root)
			}
			var out, errb bytes.Buffer
			cmdBoot([]string{"--root", root, "--dry-run", "--no-handoff"}, &out, &errb)
			ents, _ := os.ReadDir(outside)
			for _, e := range ents {
				if e.Name() != "passage.key" && e.Name() != "passage.pub" {
					t.Errorf("%s written outside the root", e.Name())
				}
			}
			env, err := os.ReadFile(filepath.Join(root, "run/passage/manifest.dsse.json"))
			if err != nil {
				return // unsigned (no key beneath the root) or not written: nothing outside signed
			}
			// A contradiction is checked after the signature: it too means the key outside signed.
			if _, err := manifest.Verify(env, outV, manifest.VerifyOptions{}); err == nil || errors.Is(err, manifest.ErrContradiction) {
				t.Errorf("the key outside the root signed: %v", err)
			}
		})
	}
}
