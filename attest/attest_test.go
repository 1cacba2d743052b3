package attest

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// node is a swtpm-backed node that has booted: passage's key signed manifests of the
// given generations, each measured into PCR 13 and logged.
type node struct {
	tpm    transport.TPM
	key    *tpmkey.TPM
	dir    string
	signed []*manifest.Signed
}

const manifestName = "manifest.dsse.json"

func bootNode(t *testing.T, ca *attesttest.CA, gens ...uint64) *node {
	t.Helper()
	tpm := attesttest.Start(t, ca)
	k, err := tpmkey.New(tpm)
	if err != nil {
		t.Fatal(err)
	}
	n := &node{tpm: tpm, key: k, dir: t.TempDir()}
	for _, g := range gens {
		s, err := manifest.WriteSigned(context.Background(), manifesttest.B300(g), n.dir, manifestName, k, k)
		if err != nil {
			t.Fatal(err)
		}
		n.signed = append(n.signed, s)
	}
	return n
}

func (n *node) passageLog(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(n.dir, manifestName+manifest.EventLogSuffix))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// attest collects an attestation with nonce (nil: the last manifest's payload digest,
// as the boot does offline).
func (n *node) attest(t *testing.T, nonce []byte) *Attestation {
	t.Helper()
	if nonce == nil {
		sum := sha256.Sum256(n.signed[len(n.signed)-1].Payload)
		nonce = sum[:]
	}
	a, err := Collect(n.tpm, tpmkey.Template(), nonce, Evidence{PassageLog: n.passageLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	// What the verifier reads is the file: round-trip it.
	b, err := a.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "a"+Suffix)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := ReadAttestation(path)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func (n *node) manifest(i int) Manifest {
	s := n.signed[i]
	var m manifest.Manifest
	if err := json.Unmarshal(s.Payload, &m); err != nil {
		panic(err)
	}
	return Manifest{Payload: s.Payload, Generation: m.Generation, Signer: n.key.Public()}
}

// enrol runs the whole enrolment round: the verifier's challenge, the node's answer.
func enrol(t *testing.T, a *Attestation, ca *attesttest.CA, on transport.TPM) *NodeRecord {
	t.Helper()
	ch, p, err := Enrol(a, pool(t, ca))
	if err != nil {
		t.Fatal(err)
	}
	ans, err := Activate(on, ch)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := Complete(p, ans)
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

func wantRefused(t *testing.T, what string, err error, check, words string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: accepted, want refused by %s", what, check)
	}
	if got := CheckOf(err); got != check {
		t.Fatalf("%s: refused by %q (%v), want %q", what, got, err, check)
	}
	if !strings.Contains(err.Error(), words) {
		t.Fatalf("%s: %v, want it to say %q", what, err, words)
	}
}

// TestEnrolAttestVerify is the whole round on swtpm with an EK certificate: enrolment
// (EK certificate chain, credential activation), an attestation of the manifest, its
// verification, and each refusal with its reason.
func TestEnrolAttestVerify(t *testing.T) {
	ca := attesttest.NewCA(t)
	a := bootNode(t, ca, 1, 2)
	att := a.attest(t, nil)
	rec := enrol(t, att, ca, a.tpm)
	if pemBytes, err := rec.SigningKeyPEM(); err != nil {
		t.Fatal(err)
	} else if want, _ := a.key.PublicKeyPEM(); string(pemBytes) != string(want) {
		t.Fatalf("enrolled signing key\n%s\nis not passage's key\n%s", pemBytes, want)
	}
	pol := Policy{EKCA: pool(t, ca)}
	res, err := VerifyTPM(rec, att, a.manifest(1), pol)
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	if res.Seen.Generation != 2 || res.Seen.ResetCount != rec.Seen.ResetCount {
		t.Errorf("seen %+v after enrolment at %+v", res.Seen, rec.Seen)
	}
	// The same TPM-side checks with a verifier's own nonce.
	nonce := []byte("control-plane-nonce-0001")
	if _, err := VerifyTPM(rec, a.attest(t, nonce), a.manifest(1), Policy{EKCA: pol.EKCA, Nonce: nonce}); err != nil {
		t.Fatalf("verify with the verifier's nonce: %v", err)
	}

	b := bootNode(t, ca, 1)
	other := attesttest.NewCA(t)
	c := bootNode(t, other, 1)

	t.Run("EKFromAnotherCA", func(t *testing.T) {
		_, _, err := Enrol(c.attest(t, nil), pool(t, ca))
		wantRefused(t, "enrol", err, "EK certificate", "not the operator's EK CA")
		// A record made with the other CA's trust is refused by this operator's.
		recC := enrol(t, c.attest(t, nil), other, c.tpm)
		_, err = VerifyTPM(recC, c.attest(t, nil), c.manifest(0), pol)
		wantRefused(t, "verify", err, "EK certificate", "not the operator's EK CA")
	})

	t.Run("AKFromAnotherTPM", func(t *testing.T) {
		// B's AK (and its genuine certification of B's key) presented with A's EK.
		mixed := *b.attest(t, nil)
		mixed.EKCert, mixed.EKPublic = att.EKCert, att.EKPublic
		ch, p, err := Enrol(&mixed, pool(t, ca))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Activate(a.tpm, ch); err == nil {
			t.Error("A's TPM activated a credential for B's AK")
		}
		if _, err := Activate(b.tpm, ch); err == nil {
			t.Error("B's TPM activated a credential sealed to A's EK")
		}
		_, err = Complete(p, make([]byte, 32))
		wantRefused(t, "complete", err, "AK", "not the credential sealed")
		// An attestation by another AK than the enrolled one.
		_, err = VerifyTPM(rec, &mixed, b.manifest(0), pol)
		wantRefused(t, "verify", err, "AK", "not the AK activated")
	})

	t.Run("SigningKeyNotCertified", func(t *testing.T) {
		// A's AK, but B's signing key in place of the one A's AK certified.
		forged := *att
		forged.SigningKeyPublic = b.attest(t, nil).SigningKeyPublic
		_, _, err := Enrol(&forged, pool(t, ca))
		wantRefused(t, "enrol", err, "signing key", "not certified by the AK")
		// A certification signed by B's AK.
		forged = *att
		forged.Certify = b.attest(t, nil).Certify
		_, err = VerifyTPM(rec, &forged, a.manifest(1), pol)
		wantRefused(t, "verify", err, "signing key", "not certified by the AK")
		// A manifest signed by another key than the certified one.
		m := a.manifest(1)
		m.Signer = b.key.Public()
		_, err = VerifyTPM(rec, att, m, pol)
		wantRefused(t, "verify", err, "signing key", "signed by another key")
	})

	t.Run("QuoteWithAnotherNonce", func(t *testing.T) {
		stale := a.attest(t, []byte("an-older-nonce"))
		_, err := VerifyTPM(rec, stale, a.manifest(1), pol)
		wantRefused(t, "attestation for another nonce", err, "quote", "made for nonce")
		// The right nonce claimed, the certification made for it, but a quote made for
		// another.
		forged := *att
		forged.Quote = stale.Quote
		forged.PCRs = stale.PCRs
		_, err = VerifyTPM(rec, &forged, a.manifest(1), pol)
		wantRefused(t, "quote of another nonce", err, "quote", "quoted nonce")
	})

	t.Run("PCR13LogDoesNotReplay", func(t *testing.T) {
		l, err := manifest.ParseEventLog(att.PassageLog)
		if err != nil {
			t.Fatal(err)
		}
		// The first manifest's measurement left out: the log another boot would have.
		other := bootNode(t, ca, 2)
		if l2, err := manifest.ParseEventLog(other.passageLog(t)); err != nil || len(l2.Events) != 1 || len(l.Events) != 2 {
			t.Fatalf("logs of %v and %v events: %v", len(l.Events), len(l2.Events), err)
		}
		forged := *att
		forged.PassageLog = other.passageLog(t)
		_, err = VerifyTPM(rec, &forged, a.manifest(1), pol)
		wantRefused(t, "verify", err, "PCR 13", "does not replay")
		// PCR values that are not the quoted ones.
		forged = *att
		forged.PCRs = map[int]HexBytes{}
		for k, v := range att.PCRs {
			forged.PCRs[k] = v
		}
		forged.PCRs[ManifestPCR] = make([]byte, 32)
		_, err = VerifyTPM(rec, &forged, a.manifest(1), pol)
		wantRefused(t, "verify", err, "quote", "not the ones quoted")
	})

	t.Run("ManifestNotLastEvent", func(t *testing.T) {
		// Generation 1's payload as nonce, so only PCR 13's last event (generation 2)
		// tells the manifest is not the last one measured.
		sum := sha256.Sum256(a.signed[0].Payload)
		old := a.attest(t, sum[:])
		_, err := VerifyTPM(rec, old, a.manifest(0), pol)
		wantRefused(t, "verify", err, "PCR 13", "last event measured")
	})

	t.Run("ResetCount", func(t *testing.T) {
		later := *rec
		later.Seen = Seen{ResetCount: rec.Seen.ResetCount + 1, Generation: 1}
		_, err := VerifyTPM(&later, att, a.manifest(1), pol)
		wantRefused(t, "verify", err, "reset count", "lower than")
		seen := *rec
		seen.Seen = Seen{ResetCount: rec.Seen.ResetCount, Generation: 3}
		_, err = VerifyTPM(&seen, att, a.manifest(1), pol)
		wantRefused(t, "verify", err, "reset count", "older than")
	})

	t.Run("EmptyFirmwareLog", func(t *testing.T) {
		ap := &Approved{Format: ApprovedFormat, Authenticode: []HexBytes{make([]byte, 32)},
			PCR11: []HexBytes{make([]byte, 32)}, DBCertificates: []string{caPEM(t, ca)}}
		if err := ap.Parse(); err != nil {
			t.Fatal(err)
		}
		_, err := Verify(rec, att, a.manifest(1), Policy{EKCA: pol.EKCA, Approved: ap})
		wantRefused(t, "verify", err, "firmware event log", "empty")
		// Not a TCG event log at all.
		_, err = VerifyFirmware([]byte("not an event log"), att.PCRs, ap)
		wantRefused(t, "garbage log", err, "firmware event log", "")
	})
}

func caPEM(t *testing.T, ca *attesttest.CA) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ca.Dir, "issuercert.pem"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestCheckSeen(t *testing.T) {
	prev := Seen{ResetCount: 5, Generation: 10}
	for _, c := range []struct {
		reset uint32
		gen   uint64
		ok    bool
	}{
		{5, 10, true},  // the same manifest again
		{5, 11, true},  // a new generation in the same boot (recycle)
		{6, 11, true},  // a new boot, a new generation
		{6, 10, false}, // a later boot re-measuring an old manifest
		{4, 11, false}, // the reset count went back
		{5, 9, false},  // an older generation
	} {
		_, err := checkSeen(prev, c.reset, c.gen)
		if (err == nil) != c.ok {
			t.Errorf("reset %d generation %d after %+v: %v, want ok=%v", c.reset, c.gen, prev, err, c.ok)
		}
	}
}

func pool(t *testing.T, ca *attesttest.CA) *x509.CertPool {
	t.Helper()
	p, err := CAPool(ca.PEM(t))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// BenchmarkCollect is the attestation's cost in the boot's manifest stage, on swtpm:
// the persisted EK's public area, the AK and signing key re-derived, Certify, Quote and
// eleven PCR reads.
func BenchmarkCollect(b *testing.B) {
	ca := attesttest.NewCA(b)
	tpm := attesttest.Start(b, ca)
	nonce := make([]byte, 32)
	for b.Loop() {
		if _, err := Collect(tpm, tpmkey.Template(), nonce, Evidence{}); err != nil {
			b.Fatal(err)
		}
	}
}
