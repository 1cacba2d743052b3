// Package signedtest signs manifests for the driver's tests the way a node does: an
// ed25519 key derived from a fixed seed, its public key enrolled for the manifest's node
// (DMI UUID), the envelope written as the boot stage writes it.
package signedtest

import (
	"context"
	"crypto/ed25519"
	"os"
	"path/filepath"
	"testing"

	"github.com/passage-boot/passage/manifest"
)

// Key is one node's signing key and its enrolled public key file.
type Key struct {
	Signer *manifest.Ed25519Signer
	Pub    string // NAME.pub, with NAME.enrol.json beside it
}

// NewKey writes the public key NAME.pub of a key made from seed into dir, enrolled for
// the node with DMI UUID uuid.
func NewKey(t testing.TB, dir, name string, seed byte, uuid string) *Key {
	t.Helper()
	s := make([]byte, ed25519.SeedSize)
	s[0] = seed
	priv := ed25519.NewKeyFromSeed(s)
	signer, err := manifest.NewEd25519Signer(priv)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := manifest.MarshalPublicKey(priv.Public())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name+".pub")
	if err := os.WriteFile(path, pub, 0o644); err != nil {
		t.Fatal(err)
	}
	id, _ := signer.KeyID()
	e, err := manifest.NewEnrolment(id, manifest.Node{DMIUUID: uuid}, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := manifest.WriteEnrolment(path, e); err != nil {
		t.Fatal(err)
	}
	return &Key{Signer: signer, Pub: path}
}

// Sign writes m signed by k to path.
func (k *Key) Sign(t testing.TB, m *manifest.Manifest, path string) string {
	t.Helper()
	s, err := manifest.Sign(context.Background(), m, k.Signer)
	if err != nil {
		t.Fatal(err)
	}
	if err := manifest.WriteAtomic(filepath.Dir(path), filepath.Base(path), s.Envelope); err != nil {
		t.Fatal(err)
	}
	return path
}
