package recycle_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/attest/verifiertest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/stages/boot"
)

// keepOpen lets the key be closed without closing the swtpm connection the test goes on
// using as the node's TPM.
type keepOpen struct{ transport.TPM }

func (keepOpen) Close() error { return nil }

// TestRecycleAttests: recycle on a node with a TPM (swtpm with an EK certificate) writes
// the attestation of the generation it signs last, replacing the boot's: a verifier
// that enrolled the node accepts it for the newest manifest (its quote covers PCR 13
// ending in that generation), with nobody running attest quote. Without a TPM the stale
// attestation is removed rather than left beside a manifest it is not of.
func TestRecycleAttests(t *testing.T) {
	n := newNode(t)
	ca := attesttest.NewCA(t)
	tpm := attesttest.Start(t, ca)
	k, err := tpmkey.New(keepOpen{tpm})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	attPath := filepath.Join(n.dir, recycle.EnvelopeName+attest.Suffix)
	if err := os.WriteFile(attPath, []byte(`{"format":"passage-attestation/1"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	o := n.opts(3)
	o.Signers = append([]manifest.Signer{k}, o.Signers...)
	o.Measurer = k
	attested := 0
	o.Attest = func(dir string, signed *manifest.Signed) error {
		attested++
		return boot.WriteAttestation(n.root, k, dir, signed.Payload, nil)
	}
	var log strings.Builder
	o.Log = &log
	res, err := recycle.Run(context.Background(), o)
	if err != nil || !res.Completed {
		t.Fatalf("recycle: %v", err)
	}
	if attested != 2 {
		t.Errorf("%d generations attested, want 2 (the in-flight one and the final one)", attested)
	}
	a, err := attest.ReadAttestation(attPath)
	if err != nil {
		t.Fatal(err)
	}
	if a.NonceSource != attest.NoncePayloadDigest {
		t.Errorf("nonce source %q", a.NonceSource)
	}
	rec, pool := verifiertest.Enrol(t, tpm, ca, a)
	env, err := manifest.ReadEnvelope(filepath.Join(n.dir, recycle.EnvelopeName))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := manifest.NewVerifier(k.Public())
	if err != nil {
		t.Fatal(err)
	}
	v, err := manifest.Verify(env, kv, manifest.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v.Manifest.Generation != res.Final {
		t.Fatalf("manifest generation %d, recycle's final %d", v.Manifest.Generation, res.Final)
	}
	res2, err := attest.VerifyTPM(rec, a, attest.Manifest{Payload: v.Payload, Generation: v.Manifest.Generation, Signer: k.Public()}, attest.Policy{EKCA: pool})
	if err != nil {
		t.Fatalf("the newest generation's attestation: %v\n%s", err, log.String())
	}
	if res2.Seen.Generation != res.Final {
		t.Errorf("accepted generation %d, want %d", res2.Seen.Generation, res.Final)
	}

	// A recycle without a TPM: the attestation of the earlier generation goes.
	o = n.opts(3)
	if _, err := recycle.Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(attPath); !os.IsNotExist(err) {
		t.Errorf("an attestation of generation %d stays beside generation %d: %v", res.Final, n.latest(t).Generation, err)
	}
}
