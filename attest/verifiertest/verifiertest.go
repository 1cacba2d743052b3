// Package verifiertest plays the verifier's side of attestation for tests: the enrolment
// round a fleet's verifier runs once per node. It is apart from attesttest, which attest's
// own tests use, because it calls attest.
package verifiertest

import (
	"crypto/x509"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
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

// ControlPlane is a control plane on loopback as passage.url sees it: a GET is answered
// with a nonce from the verifier's store at path (attest.NonceHandler), and what a boot
// POSTs is kept by its content type. It stops when the test ends.
type ControlPlane struct {
	*httptest.Server
	mu     sync.Mutex
	posted map[string][]byte
}

// NewControlPlane starts the control plane, its nonce store at path.
func NewControlPlane(t testing.TB, path string) *ControlPlane {
	t.Helper()
	cp := &ControlPlane{posted: map[string][]byte{}}
	nonces := attest.NonceHandler(&attest.NonceStore{Path: path})
	cp.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			nonces.ServeHTTP(w, r)
			return
		}
		b, _ := io.ReadAll(io.LimitReader(r.Body, 64<<20))
		cp.mu.Lock()
		cp.posted[r.Header.Get("Content-Type")] = b
		cp.mu.Unlock()
	}))
	t.Cleanup(cp.Close)
	return cp
}

// Posted is the last body POSTed with the content type (nil for none).
func (cp *ControlPlane) Posted(contentType string) []byte {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.posted[contentType]
}
