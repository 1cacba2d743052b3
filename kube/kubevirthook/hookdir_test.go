package kubevirthook

import (
	"bytes"
	"crypto/ed25519"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
)

// hookDir holds what passage-dra plugin --hook-dir wrote in kube/dra/plugin's
// TestHookDirExport (manifest.dsse.json, the DaemonSet's side of the hook's PV) beside
// the key that signed it with its enrolment and the node's UUID (node.pub,
// node.enrol.json, product_uuid: the hook's trust root, in its image in a deployment);
// that test holds these bytes to the plugin's export and its rig.
const hookDir = "testdata/hookdir"

// dirConfig is the hook's Config over a hook dir as passage-hook's flags in
// kube/deploy/kubevirt-hook.yaml name it.
func dirConfig(t *testing.T, dir string) Config {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "product_uuid"))
	if err != nil {
		t.Fatal(err)
	}
	return Config{Manifest: filepath.Join(dir, "manifest.dsse.json"), Keys: filepath.Join(dir, "node.pub"), NodeUUID: strings.TrimSpace(string(b))}
}

// TestHookDirFromPlugin: the hook verifies exactly the plugin's export with the key that
// signed it, the key's enrolment and the node UUID (kube/dra/plugin's TestHookDirExport holds
// all four to the plugin's rig) and lays out a unit; any of them edited (payload, key,
// enrolment or UUID) is refused, naming the hostdev.
func TestHookDirFromPlugin(t *testing.T) {
	good := dirConfig(t, hookDir)
	m, err := good.verify()
	if err != nil {
		t.Fatalf("the plugin's export does not verify in the hook: %v", err)
	}
	dom := kubevirtDomain(t, m, []string{"gpu0"}, false)
	r, err := good.DefineDomain(dom)
	if err != nil {
		t.Fatal(err)
	}
	if r.Guest == nil || len(r.Guest.Units) != 1 || r.Guest.Units[0].Unit.String() != "gpu0" {
		t.Fatalf("the export's gpu0 not laid out: %+v", r.Guest)
	}

	gpu := m.Units[0].Functions[0].BDF
	other := otherKey(t)
	for _, tc := range []struct {
		name string
		edit func(dir string)
		want string
	}{
		{"payload", func(dir string) {
			p := filepath.Join(dir, "manifest.dsse.json")
			b, _ := os.ReadFile(p)
			i := bytes.Index(b, []byte(`"payload": "`)) + len(`"payload": "`) + 40
			b[i] ^= 1
			os.WriteFile(p, b, 0o644)
		}, "does not verify"},
		{"another key", func(dir string) { os.WriteFile(filepath.Join(dir, "node.pub"), other, 0o644) }, "does not verify"},
		{"no key", func(dir string) { os.Remove(filepath.Join(dir, "node.pub")) }, "does not verify"},
		{"enrolment of another node", func(dir string) {
			p := filepath.Join(dir, "node.enrol.json")
			b, _ := os.ReadFile(p)
			os.WriteFile(p, bytes.Replace(b, []byte(m.Node.DMIUUID), []byte("4c4c4544-0042-3810-8057-000000000001"), 1), 0o644)
		}, "does not verify"},
		{"another node's uuid", func(dir string) {
			os.WriteFile(filepath.Join(dir, "product_uuid"), []byte("4c4c4544-0042-3810-8057-000000000001\n"), 0o644)
		}, "this node is dmi_uuid"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, n := range []string{"manifest.dsse.json", "node.pub", "node.enrol.json", "product_uuid"} {
				b, err := os.ReadFile(filepath.Join(hookDir, n))
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, n), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			tc.edit(dir)
			_, err := dirConfig(t, dir).DefineDomain(dom)
			if err == nil || !strings.Contains(err.Error(), gpu) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v: want %s refused, %q", err, gpu, tc.want)
			}
		})
	}
}

// otherKey is another node's public key (PEM).
func otherKey(t *testing.T) []byte {
	t.Helper()
	seed := make([]byte, ed25519.SeedSize)
	seed[0] = 9
	b, err := manifest.MarshalPublicKey(ed25519.NewKeyFromSeed(seed).Public())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestNCCLImage: whole sectors, the file first, at least one newline after it (a file
// of whole sectors is not left unterminated), and a file over the bound refused.
func TestNCCLImage(t *testing.T) {
	for _, n := range []int{1, NCCLDiskSector - 1, NCCLDiskSector, 3*NCCLDiskSector + 5} {
		f := bytes.Repeat([]byte{'x'}, n)
		img, err := NCCLImage(f)
		if err != nil {
			t.Fatal(err)
		}
		if len(img)%NCCLDiskSector != 0 || len(img) <= n || !bytes.HasPrefix(img, f) || len(bytes.TrimRight(img[n:], "\n")) != 0 {
			t.Errorf("%d bytes: image of %d bytes", n, len(img))
		}
	}
	if _, err := NCCLImage(make([]byte, MaxNCCLDisk)); err == nil || !strings.Contains(err.Error(), "nccl topology file") {
		t.Errorf("an oversized file: %v", err)
	}
}
