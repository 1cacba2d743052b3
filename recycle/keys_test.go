package recycle_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/recycle"
)

// TestOpenRecorderWithoutKeyFile: a node that signs with its TPM has no key file; the
// recorder then signs with the TPM alone and checks the previous generation with the
// TPM's key. Without the file and without a TPM (or with the TPM turned off) it is
// refused, naming the file.
func TestOpenRecorderWithoutKeyFile(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"run/passage", "dev", "etc/passage"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	keys := recycle.Keys{SigningKey: "/etc/passage/key", Dir: "/run/passage"}
	for _, tpm := range []string{"off", "auto", "on"} {
		k := keys
		k.TPM = tpm
		if r, err := recycle.OpenRecorder(root, k); err == nil || !strings.Contains(err.Error(), filepath.Join(root, "etc/passage/key")) {
			if r != nil {
				r.Close()
			}
			t.Fatalf("no key file, no TPM, --tpm %s: %v, want refused naming the key file", tpm, err)
		}
	}

	sock := attesttest.StartSocket(t, attesttest.NewCA(t))
	if err := os.Symlink(sock, filepath.Join(root, "dev/tpmrm0")); err != nil {
		t.Fatal(err)
	}
	k := keys
	k.TPM = "auto"
	r, err := recycle.OpenRecorder(root, k)
	if err != nil {
		t.Fatalf("no key file, a TPM: %v", err)
	}
	defer r.Close()
	if r.TPM == nil || len(r.Signers) != 1 || r.Verifier == nil || r.Measurer == nil || len(r.Counters) != 1 {
		t.Fatalf("recorder %+v: want the TPM signing, measuring and counting alone, and its key verifying", r)
	}
	id, err := r.Signers[0].KeyID()
	if err != nil {
		t.Fatal(err)
	}
	tid, err := manifest.KeyID(r.TPM.Public())
	if err != nil || id != tid {
		t.Fatalf("signer %s, TPM key %s (%v)", id, tid, err)
	}
	if vid, err := manifest.KeyID(r.Verifier.(*manifest.PublicKeyVerifier).Public()); err != nil || vid != tid {
		t.Fatalf("verifier %s, TPM key %s (%v)", vid, tid, err)
	}
}
