package plugin_test

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/dra/plugin"
	"github.com/passage-boot/passage/dra/resources"
	"github.com/passage-boot/passage/manifest"
)

var updateHook = flag.Bool("update-hook", false, "rewrite ../hook/testdata/hookdir from the plugin's export")

// hookFixture is the hook module's copy of this test's export (its own module cannot
// import the plugin's): dra/hook's TestHookDirFromPlugin verifies from exactly these
// bytes, and this test holds them to what the plugin writes.
const hookFixture = "../hook/testdata/hookdir"

// TestHookDirExport: the plugin, verifying the node's manifest, writes into --hook-dir
// the envelope byte for byte, the key that verified it with its enrolment, and the
// node's DMI UUID; a manifest that stops verifying leaves the last verified export in
// place (and the plugin refuses); a newer generation replaces it.
func TestHookDirExport(t *testing.T) {
	r := newRig(t)
	hookDir := filepath.Join(t.TempDir(), "hook")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: filepath.Dir(r.Key.Pub)}, Root: r.Root,
		CDIDir: t.TempDir(), StateDir: t.TempDir(), HookDir: hookDir}
	if _, err := plugin.New(cfg); err != nil {
		t.Fatal(err)
	}
	read := func(p string) []byte {
		t.Helper()
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	want := map[string][]byte{
		plugin.HookManifest:  read(r.Path),
		plugin.HookKey:       read(r.Key.Pub),
		plugin.HookEnrolment: read(manifest.EnrolmentPath(r.Key.Pub)),
		plugin.HookNodeUUID:  []byte(uuid + "\n"),
	}
	ents, err := os.ReadDir(hookDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != len(want) {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("hook dir holds %s, want the %d files", strings.Join(names, " "), len(want))
	}
	for name, w := range want {
		if got := read(filepath.Join(hookDir, name)); !bytes.Equal(got, w) {
			t.Errorf("%s: exported\n%s\nwant\n%s", name, got, w)
		}
		fixture := filepath.Join(hookFixture, name)
		if *updateHook {
			if err := os.MkdirAll(hookFixture, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(fixture, w, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if got := read(fixture); !bytes.Equal(got, w) {
			t.Errorf("%s: the hook's fixture is not the plugin's export (go test -run TestHookDirExport -update-hook)", fixture)
		}
	}
	// What the hook will do with them: the one key file, its enrolment beside it.
	kr, err := manifest.LoadKeyring(filepath.Join(hookDir, plugin.HookKey), false)
	if err != nil {
		t.Fatal(err)
	}
	if _, k, err := kr.VerifyFile(filepath.Join(hookDir, plugin.HookManifest), manifest.VerifyOptions{}); err != nil || k.Enrol == nil {
		t.Fatalf("the export does not verify on its own, enrolled: %v", err)
	}

	// A tampered manifest on the node: the plugin refuses and exports nothing of it.
	env := read(r.Path)
	tampered := bytes.Clone(env)
	i := bytes.Index(tampered, []byte(`"sig": "`))
	if i < 0 {
		t.Fatal("no signature in the envelope")
	}
	tampered[i+len(`"sig": "`)] ^= 1
	if err := os.WriteFile(r.Path, tampered, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := plugin.New(cfg); err == nil {
		t.Fatal("a tampered manifest accepted")
	}
	if got := read(filepath.Join(hookDir, plugin.HookManifest)); !bytes.Equal(got, env) {
		t.Fatalf("a refused manifest reached the hook dir:\n%s", got)
	}

	// A newer generation replaces the export.
	r.M.Generation++
	r.Key.Sign(t, r.M, r.Path)
	if _, err := plugin.New(cfg); err != nil {
		t.Fatal(err)
	}
	if got := read(filepath.Join(hookDir, plugin.HookManifest)); !bytes.Equal(got, read(r.Path)) || bytes.Equal(got, env) {
		t.Fatal("the newer generation was not exported")
	}
}
