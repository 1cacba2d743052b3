package boot

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/entropy/entropytest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// TestKubeletKey: a boot that hands off to a root (switch_root) and signs with its TPM
// makes the kubelet's client key, with every random source of the process blocked (the
// seed is the TPM's): at /run/passage/kubelet/kubelet-client.key.tmp, mode 0600 in a
// directory of mode 0700, PEM "EC PRIVATE KEY" of a P-256 key whose digest is the
// signed manifest's node.kubelet_key. A boot that does not hand off to a root, or signs
// without a TPM, makes none and its manifest has no kubelet_key.
func TestKubeletKey(t *testing.T) {
	const cmdline = "passage.profile=b300 passage.key=/etc/passage/passage.key passage.net=off passage.erase=off"
	for _, tc := range []struct {
		name, cmdline string
		tpm, want     bool
	}{
		{"switch_root with a TPM", cmdline + " passage.tpm=on passage.handoff=switch_root passage.root=/dev/vda2", true, true},
		{"hold with a TPM", cmdline + " passage.tpm=on passage.handoff=hold", true, false},
		{"switch_root without a TPM", cmdline + " passage.tpm=off passage.handoff=switch_root passage.root=/dev/vda2", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim, err := simulator.Get() // seeds itself from crypto/rand: before Block
			if err != nil {
				t.Fatal(err)
			}
			defer sim.Close()
			root, edv := signingNode(t)
			open := func(string) (manifest.Signer, manifest.Measurer, error) {
				k, err := tpmkey.New(transport.FromReadWriteCloser(keepOpen{sim}))
				if err != nil {
					return nil, nil, err
				}
				return k, k, nil
			}
			kern, err := vfiotest.New(root)
			if err != nil {
				t.Fatal(err)
			}
			if err := kern.Load(vfiobind.Modules...); err != nil {
				t.Fatal(err)
			}
			blk := entropytest.Block(t)
			b := &Boot{Root: root, OpenTPM: open, Sysfs: kern, Config: initramfs.ParseCmdline(tc.cmdline)}
			var list []stages.Stage
			for _, s := range b.Stages() {
				if !slices.Contains([]string{"modules", "host", "network", "publish", "push"}, s.Name) {
					list = append(list, s)
				}
			}
			rs, err := (&stages.Runner{Stages: list, Timeout: 20 * time.Second}).Run(context.Background(), &stages.State{})
			if err != nil {
				t.Fatal(err)
			}
			if n := blk.Calls(); n != 0 {
				t.Errorf("%d reads from a blocked random source", n)
			}
			var mr stages.Result
			for _, r := range rs {
				if r.Name == "manifest" {
					mr = r
				}
			}
			if mr.Status != stages.OK {
				t.Fatalf("manifest stage %s: %v %q", mr.Status, mr.Err, mr.Findings)
			}
			env, err := os.ReadFile(filepath.Join(root, "run/passage", EnvelopeName))
			if err != nil {
				t.Fatal(err)
			}
			v, err := manifest.Verify(env, edv, manifest.VerifyOptions{})
			if err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(root, kubelet.CertDir)
			path := filepath.Join(dir, kubelet.KeyFile)
			if !tc.want {
				if v.Manifest.Node.KubeletKey != "" {
					t.Errorf("node.kubelet_key %q, want none", v.Manifest.Node.KubeletKey)
				}
				if _, err := os.Stat(path); !os.IsNotExist(err) {
					t.Errorf("%s: %v, want no key", path, err)
				}
				if !tc.tpm && !slices.ContainsFunc(mr.Findings, func(f string) bool { return strings.Contains(f, "kubelet key: none made") }) {
					t.Errorf("findings %q: want the kubelet key's absence named", mr.Findings)
				}
				return
			}
			for p, want := range map[string]os.FileMode{dir: 0o700 | os.ModeDir, path: 0o600} {
				if fi, err := os.Stat(p); err != nil || fi.Mode() != want {
					t.Errorf("%s: %v %v, want mode %v", p, fi.Mode(), err, want)
				}
			}
			b64, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			blk2, rest := pem.Decode(b64)
			if blk2 == nil || blk2.Type != "EC PRIVATE KEY" || len(rest) != 0 {
				t.Fatalf("%s: not one PEM EC PRIVATE KEY block:\n%s", path, b64)
			}
			key, err := x509.ParseECPrivateKey(blk2.Bytes)
			if err != nil || key.Curve.Params().Name != "P-256" {
				t.Fatalf("%s: %v (curve %v)", path, err, key)
			}
			digest, err := kubelet.Digest(key.Public())
			if err != nil {
				t.Fatal(err)
			}
			if got := v.Manifest.Node.KubeletKey; got != digest {
				t.Errorf("signed node.kubelet_key %q, the key file's digest %q", got, digest)
			}
			if !slices.ContainsFunc(mr.Changes, func(c string) bool { return strings.Contains(c, digest) }) {
				t.Errorf("changes %q: want the key named", mr.Changes)
			}
			// passage.out's copy takes the boot's files, not the key: it is in a
			// directory of its own, which copyFiles does not descend into.
			out := t.TempDir()
			if err := copyFiles(filepath.Join(root, "run/passage"), out); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(out, kubelet.KeyFile)); !os.IsNotExist(err) {
				t.Errorf("the key was copied out of /run: %v", err)
			}
		})
	}
}
