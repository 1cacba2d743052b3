package manifesttest

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"os"
	"path/filepath"

	"github.com/passage-boot/passage/manifest"
)

// Fleet writes n signed B300 manifests into dir/manifests, node i as
// node-NNNN.dsse.json with hostname b300-NNNN and generation i+1, signed by one of
// keys ed25519 keys (node i by key i%keys, derived from a fixed seed so runs repeat),
// and the public keys into dir/keys, each enrolled (node-key-NNNN.enrol.json) for the
// DMI UUID NodeUUID(k): nodes that share a key are boots of one machine. It returns the
// two directories.
func Fleet(dir string, n, keys int) (manifests, pubs string, err error) {
	manifests, pubs = filepath.Join(dir, "manifests"), filepath.Join(dir, "keys")
	for _, d := range []string{manifests, pubs} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", "", err
		}
	}
	signers := make([]*manifest.Ed25519Signer, keys)
	for k := range signers {
		seed := make([]byte, ed25519.SeedSize)
		seed[0], seed[1] = byte(k), byte(k>>8)
		priv := ed25519.NewKeyFromSeed(seed)
		if signers[k], err = manifest.NewEd25519Signer(priv); err != nil {
			return "", "", err
		}
		pub, err := manifest.MarshalPublicKey(priv.Public())
		if err != nil {
			return "", "", err
		}
		pubPath := filepath.Join(pubs, fmt.Sprintf("node-key-%04d.pub", k))
		if err := os.WriteFile(pubPath, pub, 0o644); err != nil {
			return "", "", err
		}
		id, _ := signers[k].KeyID()
		e, err := manifest.NewEnrolment(id, manifest.Node{DMIUUID: NodeUUID(k)}, false)
		if err != nil {
			return "", "", err
		}
		if _, err := manifest.WriteEnrolment(pubPath, e); err != nil {
			return "", "", err
		}
	}
	for i := range n {
		m := B300(uint64(i + 1))
		m.Node.Hostname = fmt.Sprintf("b300-%04d", i)
		m.Node.DMIUUID = NodeUUID(i % keys)
		s, err := manifest.Sign(context.Background(), m, signers[i%keys])
		if err != nil {
			return "", "", err
		}
		if err := os.WriteFile(filepath.Join(manifests, fmt.Sprintf("node-%04d.dsse.json", i)), s.Envelope, 0o644); err != nil {
			return "", "", err
		}
	}
	return manifests, pubs, nil
}

// NodeUUID is the DMI UUID of the machine whose key is Fleet's key k.
func NodeUUID(k int) string { return fmt.Sprintf("4c4c4544-0042-3810-8057-%012x", k) }
