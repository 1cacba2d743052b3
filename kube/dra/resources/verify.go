package resources

import (
	"fmt"
	"strings"

	"github.com/passage-boot/passage/manifest"
)

// Source says which manifest to trust: the keys (a node's public key file, or a fleet's
// key directory of enrolled keys), the lowest generation still accepted, the boot, and
// the node the reader is on.
type Source struct {
	Keys          string // public key file or directory (passage verify --pub)
	TPM           bool   // the keys are TPM keys (passage verify --tpm-pub)
	MinGeneration uint64
	BootID        string
	// NodeUUID is the DMI product UUID of the node the slices are for: a manifest of
	// another node is refused even when a fleet key directory verifies it. "": not held
	// (a key file enrolled for one node binds the node already).
	NodeUUID string
}

// Verify reads and verifies the manifest at path through manifest.Keyring.VerifyFile,
// the path passage verify, render and metrics share, and then holds it to s.NodeUUID.
func Verify(path string, s Source) (*manifest.Verified, error) {
	kr, err := manifest.LoadKeyring(s.Keys, s.TPM)
	if err != nil {
		return nil, err
	}
	v, _, err := kr.VerifyFile(path, manifest.VerifyOptions{MinGeneration: s.MinGeneration, BootID: s.BootID})
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w", path, err)
	}
	if s.NodeUUID != "" && !strings.EqualFold(v.Manifest.Node.DMIUUID, s.NodeUUID) {
		return nil, fmt.Errorf("manifest %s: %w: this node is dmi_uuid %q, the manifest says %q", path, manifest.ErrWrongNode,
			manifest.Printable(s.NodeUUID), manifest.Printable(v.Manifest.Node.DMIUUID))
	}
	return v, nil
}
