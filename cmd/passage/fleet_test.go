package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

func verifyArgs(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	rc := cmdVerify(args, &out, &errb)
	return rc, out.String(), errb.String()
}

func TestVerifyMany(t *testing.T) {
	dir := t.TempDir()
	mdir, kdir, err := manifesttest.Fleet(dir, 40, 3)
	if err != nil {
		t.Fatal(err)
	}
	// A directory of manifests, each node's own key found in a key directory.
	rc, out, errs := verifyArgs("--pub", kdir, mdir)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if rc != 0 || errs != "" || len(lines) != 41 {
		t.Fatalf("rc %d stderr %q, %d lines:\n%s", rc, errs, len(lines), out)
	}
	for i, l := range lines[:40] {
		want := fmt.Sprintf("OK       %s: b300-%04d gen %d (file) boot %s signed by node-key-%04d.pub units 8 ready 0 degraded 0 failed build %s %s",
			filepath.Join(mdir, fmt.Sprintf("node-%04d.dsse.json", i)), i, i+1, manifesttest.BootID, i%3, manifesttest.Build.Version, manifesttest.Build.Revision)
		if l != want {
			t.Errorf("line %d: %q, want %q", i, l, want)
		}
	}
	if want := "40 manifests: 40 verified, 0 refused, 0 unreadable; units 320 ready, 0 degraded, 0 failed"; lines[40] != want {
		t.Errorf("summary %q, want %q", lines[40], want)
	}

	// One key for every manifest: the nodes signed by other keys are refused, by name.
	rc, out, _ = verifyArgs("--pub", filepath.Join(kdir, "node-key-0000.pub"), mdir)
	if rc != 1 || !strings.Contains(out, "40 manifests: 14 verified, 26 refused, 0 unreadable") ||
		!strings.Contains(out, "REFUSED  "+filepath.Join(mdir, "node-0001.dsse.json")+": manifest: signed by another key") {
		t.Errorf("one key: rc %d\n%s", rc, out)
	}

	// An edited manifest, a replay under --min-generation, and files named one by one.
	edited := filepath.Join(mdir, "node-0005.dsse.json")
	var env manifest.Envelope
	b, _ := os.ReadFile(edited)
	if err := json.Unmarshal(b, &env); err != nil {
		t.Fatal(err)
	}
	payload, _ := base64.StdEncoding.DecodeString(env.Payload)
	env.Payload = base64.StdEncoding.EncodeToString(bytes.Replace(payload, []byte("b300-0005"), []byte("b300-9999"), 1))
	b, _ = json.Marshal(env)
	os.WriteFile(edited, b, 0o644)
	rc, out, _ = verifyArgs("--pub", kdir, "--min-generation", "3", filepath.Join(mdir, "node-0000.dsse.json"), edited, filepath.Join(mdir, "node-0007.dsse.json"))
	lines = strings.Split(strings.TrimSpace(out), "\n")
	if rc != 1 || len(lines) != 4 || !strings.HasPrefix(lines[0], "REFUSED") || !strings.Contains(lines[0], "generation 1") ||
		!strings.HasPrefix(lines[1], "REFUSED") || !strings.Contains(lines[1], "payload edited") || !strings.HasPrefix(lines[2], "OK") ||
		lines[3] != "3 manifests: 1 verified, 2 refused, 0 unreadable; units 8 ready, 0 degraded, 0 failed" {
		t.Errorf("rc %d\n%s", rc, out)
	}

	// Bad input: a missing file, an empty directory, a key directory with a non-key.
	empty := t.TempDir()
	junkKeys := t.TempDir()
	os.WriteFile(filepath.Join(junkKeys, "README"), []byte("not a key"), 0o644)
	for _, args := range [][]string{
		{"--pub", kdir, mdir, filepath.Join(dir, "none.dsse.json")},
		{"--pub", kdir, empty},
		{"--pub", junkKeys, mdir},
		{"--pub", kdir, "--json", mdir},
	} {
		rc, out, errs := verifyArgs(args...)
		if rc != 2 || out != "" || strings.Count(errs, "\n") != 1 {
			t.Errorf("%v: rc %d stdout %q stderr %q", args, rc, out, errs)
		}
	}
}
