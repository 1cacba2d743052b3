package plugin_test

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/manifest"
)

var updateHook = flag.Bool("update-hook", false, "rewrite ../../kubevirthook/testdata/hookdir from the plugin's export")

// hookFixture is the hook module's copy of this test's export (its own module cannot
// import the plugin's) beside the key that signed it with its enrolment and the node's
// DMI UUID (what the hook's tests take for the keys built into its image and a
// --node-uuid-file): dra/hook's TestHookDirFromPlugin verifies from exactly these
// bytes, and this test holds them to what the plugin writes and the rig signs with.
const hookFixture = "../../kubevirthook/testdata/hookdir"

// TestHookDirExport: the plugin, verifying the node's manifest, writes into --hook-dir
// the envelope byte for byte and nothing else (the hook reads no key or UUID from the
// node's directory); a manifest that stops verifying leaves the last verified export
// in place (and the plugin refuses); a newer generation replaces it.
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
	ents, err := os.ReadDir(hookDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != plugin.HookManifest {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("hook dir holds %s, want %s alone", strings.Join(names, " "), plugin.HookManifest)
	}
	if got := read(filepath.Join(hookDir, plugin.HookManifest)); !bytes.Equal(got, read(r.Path)) {
		t.Errorf("%s: exported\n%s\nwant the envelope\n%s", plugin.HookManifest, got, read(r.Path))
	}
	fixture := map[string][]byte{
		plugin.HookManifest: read(filepath.Join(hookDir, plugin.HookManifest)),
		"node.pub":          read(r.Key.Pub),
		"node.enrol.json":   read(manifest.EnrolmentPath(r.Key.Pub)),
		"product_uuid":      []byte(uuid + "\n"),
	}
	for name, w := range fixture {
		p := filepath.Join(hookFixture, name)
		if *updateHook {
			if err := os.MkdirAll(hookFixture, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, w, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if got := read(p); !bytes.Equal(got, w) {
			t.Errorf("%s: the hook's fixture is not the plugin's export or the rig's key (go test -run TestHookDirExport -update-hook)", p)
		}
	}
	// What the hook will do with them: the one key file, its enrolment beside it.
	kr, err := manifest.LoadKeyring(filepath.Join(hookFixture, "node.pub"), false)
	if err != nil {
		t.Fatal(err)
	}
	if _, k, err := kr.VerifyFile(filepath.Join(hookDir, plugin.HookManifest), manifest.VerifyOptions{}); err != nil || k.Enrol == nil {
		t.Fatalf("the export does not verify with the fixture's key, enrolled: %v", err)
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
