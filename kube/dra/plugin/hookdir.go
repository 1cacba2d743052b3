package plugin

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"

	"github.com/passage-boot/passage/manifest"
)

// HookManifest is the file the plugin writes into Config.HookDir for passage-hook,
// KubeVirt's sidecar, which reaches it through a PVC over a hostPath PV: the envelope it
// verified, byte for byte. Only the manifest: the hook's keys are built into its image
// and its node identity is the kernel's boot ID (kube/kubevirthook/README.md "Where the hook's trust
// comes from"), since any pod of the namespace may write that PVC; the hook verifies
// the manifest on its own.
const HookManifest = "manifest.dsse.json"

// exportHook writes into HookDir the envelope that verified as v, byte for byte. The
// envelope is read once, verified from those bytes and written from them: a manifest
// replaced between load's read and this one is not exported but refused, and the next
// reload exports the new one. An unchanged file is not rewritten.
func (d *Driver) exportHook(v *manifest.Verified) error {
	dir := d.cfg.HookDir
	if dir == "" {
		return nil
	}
	src := d.cfg.Source
	env, err := manifest.ReadEnvelope(d.cfg.Manifest)
	if err != nil {
		return fmt.Errorf("hook dir %s: manifest %s: %w", dir, d.cfg.Manifest, err)
	}
	kr, err := manifest.LoadKeyring(src.Keys, src.TPM)
	if err != nil {
		return fmt.Errorf("hook dir %s: %w", dir, err)
	}
	w, _, err := kr.Verify(env, manifest.VerifyOptions{MinGeneration: src.MinGeneration, BootID: src.BootID})
	if err != nil {
		return fmt.Errorf("hook dir %s: manifest %s: %w", dir, d.cfg.Manifest, err)
	}
	if w.Digest != v.Digest {
		return fmt.Errorf("hook dir %s: manifest %s changed while it was read (payload %s, verified %s): not exported", dir, d.cfg.Manifest, w.Digest, v.Digest)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("hook dir %s: %w", dir, err)
	}
	if old, err := manifest.ReadRegular(filepath.Join(dir, HookManifest), int64(len(env))); err == nil && bytes.Equal(old, env) {
		return nil
	}
	if err := manifest.WriteAtomic(dir, HookManifest, env); err != nil {
		return fmt.Errorf("hook dir: %w", err)
	}
	return nil
}
