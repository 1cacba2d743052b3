package softtpm_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/softtpm"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

const testdata = "../testdata/"

// ekOnce: RSA-2048 keys take tens of milliseconds each; the tests share three.
var (
	ekOnce sync.Once
	eks    [3]*rsa.PrivateKey
	ekErr  error
)

func ek(t *testing.T, i int) *rsa.PrivateKey {
	t.Helper()
	ekOnce.Do(func() {
		for j := range eks {
			if eks[j], ekErr = softtpm.GenerateEK(); ekErr != nil {
				return
			}
		}
	})
	if ekErr != nil {
		t.Fatal(ekErr)
	}
	return eks[i]
}

// booted is a soft TPM that booted the approved image and signed one manifest.
type booted struct {
	tpm    *softtpm.TPM
	signed *manifest.Signed
	log    []byte
}

func boot(t *testing.T, ca *softtpm.CA, fw *softtpm.Firmware, i int) *booted {
	t.Helper()
	tpm, err := softtpm.New(ca, ek(t, i))
	if err != nil {
		t.Fatal(err)
	}
	tpm.Reboot(fw)
	m := manifesttest.B300(1)
	s, log, err := tpm.SignManifest(context.Background(), m, "manifest.dsse.json")
	if err != nil {
		t.Fatal(err)
	}
	return &booted{tpm: tpm, signed: s, log: log}
}

func firmware(t *testing.T, edit func([]byte) []byte) *softtpm.Firmware {
	t.Helper()
	raw, err := os.ReadFile(testdata + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		raw = edit(raw)
	}
	fw, err := softtpm.NewFirmware(raw)
	if err != nil {
		t.Fatal(err)
	}
	return fw
}

func approved(t *testing.T) *attest.Approved {
	t.Helper()
	ap, err := attest.ReadApproved(testdata + "ovmf-secureboot.approved.json")
	if err != nil {
		t.Fatal(err)
	}
	return ap
}

func nonce(t *testing.T) []byte {
	t.Helper()
	n := make([]byte, attest.NonceSize)
	rand.Read(n)
	return n
}

// enrol runs the verifier's enrolment round against the soft TPM: attest.Enrol's
// challenge, the TPM's activation, attest.Complete.
func enrol(t *testing.T, pool *x509.CertPool, b *booted, a *attest.Attestation) *attest.NodeRecord {
	t.Helper()
	ch, p, err := attest.Enrol(a, pool)
	if err != nil {
		t.Fatalf("enrol: %v", err)
	}
	secret, err := b.tpm.Activate(ch)
	if err != nil {
		t.Fatalf("activate: %v", err)
	}
	rec, err := attest.Complete(p, secret)
	if err != nil {
		t.Fatalf("complete: %v", err)
	}
	return rec
}

// verify is the control plane's whole check of an enrolled node's attestation: the
// envelope by the certified signing key, then attest.Verify (attest.VerifyTPM and
// attest.VerifyFirmware) with the approved image and the nonce it issued.
func verify(rec *attest.NodeRecord, env []byte, a *attest.Attestation, pool *x509.CertPool, ap *attest.Approved, n []byte) error {
	keyPEM, err := rec.SigningKeyPEM()
	if err != nil {
		return err
	}
	v, err := manifest.ParsePublicKey(keyPEM)
	if err != nil {
		return err
	}
	ver, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		return err
	}
	_, err = attest.Verify(rec, a, attest.Manifest{Payload: ver.Payload, Generation: ver.Manifest.Generation, Signer: v.Public()},
		attest.Policy{EKCA: pool, Approved: ap, Nonce: n})
	return err
}

// TestVerifierAcceptsSoftTPM: a soft TPM's attestation passes the real verifier, from
// enrolment (EK certificate, AK and signing key checked, credential activated) to the
// quote of the approved image over the verifier's nonce; and a second boot's, with the
// reset count one up and a newer generation, too.
func TestVerifierAcceptsSoftTPM(t *testing.T) {
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	pool, err := attest.CAPool(ca.PEM())
	if err != nil {
		t.Fatal(err)
	}
	fw, ap := firmware(t, nil), approved(t)
	b := boot(t, ca, fw, 0)
	n := nonce(t)
	a, err := b.tpm.Attest(n, b.log)
	if err != nil {
		t.Fatal(err)
	}
	// What the verifier reads is the JSON a node POSTs: round-trip it.
	body, err := a.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if a, err = attest.ParseAttestation(body); err != nil {
		t.Fatal(err)
	}
	rec := enrol(t, pool, b, a)
	if err := verify(rec, b.signed.Envelope, a, pool, ap, n); err != nil {
		t.Fatalf("the soft TPM's attestation: %v", err)
	}

	b.tpm.Reboot(fw)
	s, log, err := b.tpm.SignManifest(context.Background(), manifesttest.B300(2), "manifest.dsse.json")
	if err != nil {
		t.Fatal(err)
	}
	rec.Seen = attest.Seen{ResetCount: 0, Generation: 1}
	n2 := nonce(t)
	a2, err := b.tpm.Attest(n2, log)
	if err != nil {
		t.Fatal(err)
	}
	if err := verify(rec, s.Envelope, a2, pool, ap, n2); err != nil {
		t.Fatalf("the second boot's attestation: %v", err)
	}
	// The first boot's generation again in the second boot: a rollback.
	b.tpm.Reboot(fw)
	s, log, _ = b.tpm.SignManifest(context.Background(), manifesttest.B300(1), "manifest.dsse.json")
	rec.Seen = attest.Seen{ResetCount: 1, Generation: 2}
	a3, _ := b.tpm.Attest(n2, log)
	if err := verify(rec, s.Envelope, a3, pool, ap, n2); attest.CheckOf(err) != "reset count" {
		t.Fatalf("generation 1 after 2 was seen: %v, want refused on the reset count", err)
	}
}

// TestSoftLogIsWriteSigned: the passage event log SignManifest keeps in memory is,
// byte for byte, the file manifest.WriteSigned writes measuring into a soft TPM, and
// both leave PCR 13 at the same value.
func TestSoftLogIsWriteSigned(t *testing.T) {
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	fw := firmware(t, nil)
	b := boot(t, ca, fw, 0)
	other, err := softtpm.New(ca, ek(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	other.Reboot(fw)
	m := manifesttest.B300(1)
	m.BootID = "soft-boot-1" // the boot id SignManifest gave b's manifest
	dir := t.TempDir()
	if _, err := manifest.WriteSigned(context.Background(), m, dir, "manifest.dsse.json", other, other); err != nil {
		t.Fatal(err)
	}
	onDisk, err := os.ReadFile(filepath.Join(dir, "manifest.dsse.json"+manifest.EventLogSuffix))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(onDisk, b.log) {
		t.Fatalf("SignManifest's log (%d bytes) differs from WriteSigned's file (%d bytes)", len(b.log), len(onDisk))
	}
	n := nonce(t)
	a1, _ := b.tpm.Attest(n, b.log)
	a2, _ := other.Attest(n, onDisk)
	if !bytes.Equal(a1.PCRs[attest.ManifestPCR], a2.PCRs[attest.ManifestPCR]) {
		t.Fatalf("PCR 13: %x after SignManifest, %x after WriteSigned", []byte(a1.PCRs[13]), []byte(a2.PCRs[13]))
	}
}

// TestVerifierRefusesCorruptedSoftTPM: each corruption of a soft TPM's attestation is
// refused by the real verifier, naming the check a real TPM's would fail.
func TestVerifierRefusesCorruptedSoftTPM(t *testing.T) {
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	pool, _ := attest.CAPool(ca.PEM())
	fw, ap := firmware(t, nil), approved(t)
	b := boot(t, ca, fw, 0)
	n := nonce(t)
	good, err := b.tpm.Attest(n, b.log)
	if err != nil {
		t.Fatal(err)
	}
	rec := enrol(t, pool, b, good)
	// Another node's attestation, for the parts taken from it.
	o := boot(t, ca, fw, 1)
	oa, _ := o.tpm.Attest(n, o.log)
	// Its log after measuring a second manifest: replays to another PCR 13.
	_, otherLog, err := o.tpm.SignManifest(context.Background(), manifesttest.B300(2), "manifest.dsse.json")
	if err != nil {
		t.Fatal(err)
	}
	unapproved := firmware(t, func(raw []byte) []byte {
		return bytes.ReplaceAll(raw, ap.Authenticode[0], bytes.Repeat([]byte{0x5a}, 32))
	})

	for _, tc := range []struct {
		name, check string
		edit        func(a *attest.Attestation)
	}{
		{"quote signature flipped", "quote", func(a *attest.Attestation) { a.Quote.Signature[len(a.Quote.Signature)-1] ^= 1 }},
		{"quoted structure flipped", "quote", func(a *attest.Attestation) { a.Quote.Attest[len(a.Quote.Attest)-1] ^= 1 }},
		{"quote of another AK", "quote", func(a *attest.Attestation) { a.Quote = oa.Quote }},
		{"certification of another AK", "signing key", func(a *attest.Attestation) { a.Certify = oa.Certify }},
		{"a PCR not the quoted one", "quote", func(a *attest.Attestation) { a.PCRs[0] = bytes.Repeat([]byte{1}, 32) }},
		{"passage's log of another manifest", "PCR 13", func(a *attest.Attestation) { a.PassageLog = otherLog }},
		{"another TPM's EK", "EK certificate", func(a *attest.Attestation) { a.EKCert, a.EKPublic = oa.EKCert, oa.EKPublic }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := clone(t, good)
			tc.edit(a)
			if err := verify(rec, b.signed.Envelope, a, pool, ap, n); attest.CheckOf(err) != tc.check {
				t.Fatalf("%v, want refused on %q", err, tc.check)
			}
		})
	}
	t.Run("a nonce not the verifier's", func(t *testing.T) {
		a, _ := b.tpm.Attest(nonce(t), b.log)
		if err := verify(rec, b.signed.Envelope, a, pool, ap, n); attest.CheckOf(err) != "quote" {
			t.Fatalf("%v, want refused on the quote", err)
		}
	})
	t.Run("an unapproved image", func(t *testing.T) {
		u := boot(t, ca, unapproved, 2)
		a, _ := u.tpm.Attest(n, u.log)
		urec := enrol(t, pool, u, a)
		err := verify(urec, u.signed.Envelope, a, pool, ap, n)
		if attest.CheckOf(err) != "PCR 4" || !strings.Contains(err.Error(), "not approved") {
			t.Fatalf("%v, want refused on PCR 4: not approved", err)
		}
	})
	t.Run("an EK certificate of another CA", func(t *testing.T) {
		other, _ := softtpm.NewCA()
		tpm, err := softtpm.New(other, ek(t, 2))
		if err != nil {
			t.Fatal(err)
		}
		tpm.Reboot(fw)
		_, log, _ := tpm.SignManifest(context.Background(), manifesttest.B300(1), "m")
		a, _ := tpm.Attest(n, log)
		if _, _, err := attest.Enrol(a, pool); attest.CheckOf(err) != "EK certificate" {
			t.Fatalf("enrol: %v, want refused on the EK certificate", err)
		}
	})
}

// TestActivateRefusesOthersCredentials: the soft TPM recovers a credential only when it
// was sealed to its own EK for its own AK, and the verifier refuses any other answer.
func TestActivateRefusesOthersCredentials(t *testing.T) {
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	pool, _ := attest.CAPool(ca.PEM())
	fw := firmware(t, nil)
	b, o := boot(t, ca, fw, 0), boot(t, ca, fw, 1)
	n := nonce(t)
	a, _ := b.tpm.Attest(n, b.log)
	oa, _ := o.tpm.Attest(n, o.log)
	ch, p, err := attest.Enrol(a, pool)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := o.tpm.Activate(ch); err == nil {
		t.Fatal("another TPM activated a credential sealed to this TPM's EK")
	}
	// This TPM's EK, the other's AK: the credential is sealed for the other AK's name, so
	// this TPM (whose AK has another name) cannot activate it.
	mixed := clone(t, oa)
	mixed.EKCert, mixed.EKPublic = a.EKCert, a.EKPublic
	mch, _, err := attest.Enrol(mixed, pool)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.tpm.Activate(mch); err == nil || !strings.Contains(err.Error(), "integrity") {
		t.Fatalf("activating a credential made for another AK's name: %v, want the integrity check to fail", err)
	}
	bad := *ch
	bad.CredentialBlob = bytes.Clone(ch.CredentialBlob)
	bad.CredentialBlob[len(bad.CredentialBlob)-1] ^= 1
	if _, err := b.tpm.Activate(&bad); err == nil {
		t.Fatal("a corrupted credential blob was activated")
	}
	if _, err := attest.Complete(p, bytes.Repeat([]byte{7}, 32)); attest.CheckOf(err) != "AK" {
		t.Fatalf("complete with a wrong answer: %v, want refused on the AK", err)
	}
	secret, err := b.tpm.Activate(ch)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := attest.Complete(p, secret); err != nil {
		t.Fatalf("complete with this TPM's answer: %v", err)
	}
}

func clone(t *testing.T, a *attest.Attestation) *attest.Attestation {
	t.Helper()
	b, err := a.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	c, err := attest.ParseAttestation(b)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
