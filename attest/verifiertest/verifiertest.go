// Package verifiertest plays the verifier's side of attestation for tests: the enrolment
// round a fleet's verifier runs once per node. It is apart from attesttest, which attest's
// own tests use, because it calls attest.
package verifiertest

import (
	"crypto/x509"
	"testing"

	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
)

// Enrol runs the verifier's enrolment round for the node whose attestation is a, against
// tpm (the node's TPM, which answers the challenge) and ca: the node record a fleet
// keeps, and the CA pool the verifier checks EK certificates with.
func Enrol(t testing.TB, tpm transport.TPM, ca *attesttest.CA, a *attest.Attestation) (*attest.NodeRecord, *x509.CertPool) {
	t.Helper()
	pool, err := attest.CAPool(ca.PEM(t))
	if err != nil {
		t.Fatal(err)
	}
	ch, pending, err := attest.Enrol(a, pool)
	if err != nil {
		t.Fatalf("enrol: %v", err)
	}
	ans, err := attest.Activate(tpm, ch)
	if err != nil {
		t.Fatalf("activate: %v", err)
	}
	rec, err := attest.Complete(pending, ans)
	if err != nil {
		t.Fatalf("complete: %v", err)
	}
	return rec, pool
}
