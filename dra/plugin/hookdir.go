package plugin

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/passage-boot/passage/manifest"
)

// The files the plugin writes into Config.HookDir for passage-hook, KubeVirt's sidecar,
// which cannot read the node's own: a sidecar mounts a PVC (a hostPath PV over HookDir)
// and runs as virt-launcher's user, to whom /sys/class/dmi/id/product_uuid is closed.
// The hook reads them as --manifest, --pub and --node-uuid-file and verifies on its own:
// what it trusts is the key, not the plugin's word.
const (
	HookManifest  = "manifest.dsse.json"
	HookKey       = "node.pub" // the one key that verified the manifest
	HookEnrolment = "node" + manifest.EnrolmentSuffix
	HookNodeUUID  = "product_uuid"
)

// exportHook writes into HookDir the envelope that verified as v, byte for byte, the
// public key (and its enrolment) it verified with, and this node's DMI product UUID.
// The envelope is read once, verified from those bytes and written from them: a manifest
// replaced between load's read and this one is not exported but refused, and the next
// reload exports the new one. The manifest is written last, so that the hook, reading
// while a new key lands, sees the old manifest with the new key (refused, fail closed)
// and never a manifest the plugin did not verify. Unchanged files are not rewritten.
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
	w, k, err := kr.Verify(env, manifest.VerifyOptions{MinGeneration: src.MinGeneration, BootID: src.BootID})
	if err != nil {
		return fmt.Errorf("hook dir %s: manifest %s: %w", dir, d.cfg.Manifest, err)
	}
	if w.Digest != v.Digest {
		return fmt.Errorf("hook dir %s: manifest %s changed while it was read (payload %s, verified %s): not exported", dir, d.cfg.Manifest, w.Digest, v.Digest)
	}
	key, err := manifest.ReadRegular(k.File, manifest.MaxKeyFileSize)
	if err != nil {
		return fmt.Errorf("hook dir %s: public key %s: %w", dir, k.File, err)
	}
	// The file is read again here: it must still be the key that verified.
	if p, err := manifest.ParsePublicKey(key); err != nil {
		return fmt.Errorf("hook dir %s: public key %s: %w", dir, k.File, err)
	} else if id, err := p.KeyID(); err != nil || id != k.ID {
		return fmt.Errorf("hook dir %s: public key %s changed while it was read: not exported", dir, k.File)
	}
	var enrol []byte
	if k.Enrol != nil {
		if enrol, err = manifest.ReadRegular(manifest.EnrolmentPath(k.File), manifest.MaxKeyFileSize); err != nil {
			return fmt.Errorf("hook dir %s: %w", dir, err)
		}
		if _, err := manifest.ParseEnrolment(enrol, k.ID); err != nil {
			return fmt.Errorf("hook dir %s: enrolment of %s: %w", dir, k.File, err)
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("hook dir %s: %w", dir, err)
	}
	if enrol == nil {
		// A key file named alone is checked against an enrolment beside it when there
		// is one: a stale one would bind the new key to nothing.
		if err := os.Remove(filepath.Join(dir, HookEnrolment)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("hook dir %s: %w", dir, err)
		}
	}
	for _, f := range []struct {
		name string
		data []byte
	}{
		{HookKey, key},
		{HookEnrolment, enrol},
		{HookNodeUUID, []byte(src.NodeUUID + "\n")},
		{HookManifest, env},
	} {
		if f.data == nil {
			continue
		}
		if old, err := manifest.ReadRegular(filepath.Join(dir, f.name), int64(len(f.data))); err == nil && bytes.Equal(old, f.data) {
			continue
		}
		if err := manifest.WriteAtomic(dir, f.name, f.data); err != nil {
			return fmt.Errorf("hook dir: %w", err)
		}
	}
	return nil
}
