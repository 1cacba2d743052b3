package recycle

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"

	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/manifest"
)

// ErrNoBootManifest is returned by Renew when the manifest in Dir does not verify or is
// another boot's: a renewal carries this boot's units as its last signed word says
// them, and without that word it would have to judge them anew.
var ErrNoBootManifest = errors.New("no verified manifest of this boot to carry the units from")

// Renewal is the generation a renewal of the kubelet's key wrote.
type Renewal struct {
	// Key is the new kubelet key, in memory only: its certificate is requested with it,
	// and it reaches a disk only beside that certificate (kube/dra/plugin, KubeletCert).
	Key    *ecdsa.PrivateKey
	Digest string // kubelet.Digest of Key, the generation's node.kubelet_key
	// Previous is the digest the generation before carried ("" when it carried none).
	Previous   string
	Manifest   *manifest.Manifest
	Signed     *manifest.Signed
	Unattested error // as Result.Unattested
}

// Renew writes a generation of the same boot that changes nothing but the kubelet's
// key: a new ECDSA P-256 key (kubelet.New, from random: the TPM's generator on a node,
// crypto/rand when nil), and a signed generation, measured into PCR 13 and attested as
// every generation is (Options.Attest), whose node.kubelet_key is its digest and whose
// units, NVLink layout, profile, guest plan and stages are the previous generation's,
// exactly. Nothing is decided and no unit is touched: the node's PCI tree is not read.
// The previous manifest must verify (Options.Verifier) and be of this boot
// (ErrNoBootManifest); then the control plane, verifying the new generation, records
// the new key as the record's (passage-control's status.kubeletKey) and approves a
// certificate request for it alone: the previous key's is approved no more.
func Renew(ctx context.Context, o Options, random func(n int) ([]byte, error)) (*Renewal, error) {
	if len(o.Counters) == 0 {
		return nil, ErrNoCounter
	}
	if o.Root == "" {
		o.Root = "/"
	}
	if random == nil {
		random = func(n int) ([]byte, error) {
			b := make([]byte, n)
			_, err := rand.Read(b)
			return b, err
		}
	}
	key, digest, err := kubelet.New(random)
	if err != nil {
		return nil, err
	}
	r := &Renewal{Key: key, Digest: digest}
	m, signed, unattested, err := o.write(ctx, func(m, prev *manifest.Manifest) error {
		switch {
		case prev == nil:
			return fmt.Errorf("kubelet key renewal: %w (%s)", ErrNoBootManifest, EnvelopeName)
		case prev.BootID != m.BootID:
			return fmt.Errorf("kubelet key renewal: %w: generation %d is of boot %s, this is boot %s", ErrNoBootManifest,
				prev.Generation, manifest.Printable(prev.BootID), manifest.Printable(m.BootID))
		}
		r.Previous = prev.Node.KubeletKey
		m.Units = slices.Clone(prev.Units)
		m.NVLink = prev.NVLink
		m.Node.KubeletKey = digest
		return nil
	})
	if err != nil {
		return nil, err
	}
	r.Manifest, r.Signed, r.Unattested = m, signed, unattested
	o.logf("generation %d: kubelet key %s (was %s), %d units carried unchanged", m.Generation, digest, manifest.Printable(r.Previous), len(m.Units))
	return r, nil
}
