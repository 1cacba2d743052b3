package attest

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
	"math/big"

	goattest "github.com/google/go-attestation/attest"
	"github.com/google/go-tpm/tpm2"

	"github.com/passage-boot/passage/manifest"
)

// checkSigned parses a TPMS_ATTEST of type typ and verifies its signature by the AK:
// ECDSA over its SHA-256, and the TPM_GENERATED magic that a restricted key puts only
// on structures the TPM made (Part 1 section 36.5).
func checkSigned(ak *tpm2.TPMTPublic, s Signed, typ tpm2.TPMST, check string) (*tpm2.TPMSAttest, []byte, error) {
	att, err := tpm2.Unmarshal[tpm2.TPMSAttest](s.Attest)
	if err != nil {
		return nil, nil, refuse(check, "TPMS_ATTEST: %v", err)
	}
	if att.Magic != tpm2.TPMGeneratedValue {
		return nil, nil, refuse(check, "not TPM-generated (magic %#x)", uint32(att.Magic))
	}
	if att.Type != typ {
		return nil, nil, refuse(check, "attestation of type %#x, want %#x", uint16(att.Type), uint16(typ))
	}
	sig, err := tpm2.Unmarshal[tpm2.TPMTSignature](s.Signature)
	if err != nil {
		return nil, nil, refuse(check, "signature: %v", err)
	}
	ec, err := sig.Signature.ECDSA()
	if err != nil || sig.SigAlg != tpm2.TPMAlgECDSA || ec.Hash != tpm2.TPMAlgSHA256 {
		return nil, nil, refuse(check, "signature is not ECDSA SHA-256")
	}
	k, err := tpm2.Pub(*ak)
	if err != nil {
		return nil, nil, refuse("AK", "public key: %v", err)
	}
	akKey, ok := k.(*ecdsa.PublicKey)
	if !ok {
		return nil, nil, refuse("AK", "public key is %T, want ECDSA", k)
	}
	sum := sha256.Sum256(s.Attest)
	r := new(big.Int).SetBytes(ec.SignatureR.Buffer)
	sv := new(big.Int).SetBytes(ec.SignatureS.Buffer)
	if !ecdsa.Verify(akKey, sum[:], r, sv) {
		return nil, nil, refuse(check, "signature does not verify with the AK")
	}
	return att, sum[:], nil
}

// checkCertify verifies the signing key's certification by the AK and returns its
// public key.
func checkCertify(ak *tpm2.TPMTPublic, a *Attestation) (crypto.PublicKey, error) {
	sk, err := checkSigningPublic(a.SigningKeyPublic)
	if err != nil {
		return nil, err
	}
	att, _, err := checkSigned(ak, a.Certify, tpm2.TPMSTAttestCertify, "signing key")
	if err != nil {
		var r *Refusal
		if asRefusal(err, &r) && r.Check == "signing key" {
			return nil, refuse("signing key", "not certified by the AK: %v", r.Err)
		}
		return nil, err
	}
	if !bytes.Equal(att.ExtraData.Buffer, a.Nonce) {
		return nil, refuse("signing key", "certification made for another nonce")
	}
	info, err := att.Attested.Certify()
	if err != nil {
		return nil, refuse("signing key", "certify info: %v", err)
	}
	name, err := tpm2.ObjectName(sk)
	if err != nil {
		return nil, refuse("signing key", "name: %v", err)
	}
	if !bytes.Equal(info.Name.Buffer, name.Buffer) {
		return nil, refuse("signing key", "not certified by the AK: the AK certified %x, the signing key's name is %x", info.Name.Buffer, name.Buffer)
	}
	return tpm2.Pub(*sk)
}

func asRefusal(err error, r **Refusal) bool {
	x, ok := err.(*Refusal)
	if ok {
		*r = x
	}
	return ok
}

// Policy is what a verification holds an attestation to.
type Policy struct {
	// EKCA are the operator's trusted EK certificate issuers.
	EKCA *x509.CertPool
	// Approved is the approved image (nil: the firmware checks are not made, VerifyTPM).
	Approved *Approved
	// Nonce is the nonce the verifier gave; empty: the manifest's payload digest (the
	// node attested offline, right after writing the manifest).
	Nonce []byte
	// Nonces, when set, is the verifier's store of the nonces it issued (NonceStore):
	// the attestation's nonce must be one of them, unused, and is then used up. Nonce
	// must be empty with it.
	Nonces *NonceStore
}

// Manifest is the verified manifest the attestation is to vouch for.
type Manifest struct {
	// Payload is the signed payload (manifest.Verified.Payload).
	Payload []byte
	// Generation is its generation.
	Generation uint64
	// Signer is the public key that verified its signature.
	Signer crypto.PublicKey
}

// Result is what an accepted attestation showed.
type Result struct {
	ResetCount, RestartCount uint32
	// Seen is the record's new (reset count, generation).
	Seen Seen
	// Firmware is what the firmware log said (nil for VerifyTPM).
	Firmware *FirmwareResult
}

// Verify checks everything: VerifyTPM, then the firmware event log against the quoted
// firmware PCRs and the approved image (VerifyFirmware).
func Verify(rec *NodeRecord, a *Attestation, m Manifest, p Policy) (*Result, error) {
	if p.Approved == nil {
		return nil, fmt.Errorf("no approved image given")
	}
	res, err := VerifyTPM(rec, a, m, p)
	if err != nil {
		return nil, err
	}
	fw, err := VerifyFirmware(a.FirmwareLog, a.PCRs, p.Approved)
	if err != nil {
		return nil, err
	}
	res.Firmware = fw
	return res, nil
}

// VerifyTPM checks what the TPM itself vouches for: the EK certificate, the AK and
// signing key enrolled, the signing key's certification, the quote (signature, nonce,
// PCR digest), PCR 13 against passage's event log and the manifest, and the reset
// count against the generation. It says nothing about what the firmware booted.
func VerifyTPM(rec *NodeRecord, a *Attestation, m Manifest, p Policy) (*Result, error) {
	if rec.Format != NodeFormat {
		return nil, fmt.Errorf("node record: format %q, want %q", rec.Format, NodeFormat)
	}
	if !bytes.Equal(a.EKCert, rec.EKCert) || !bytes.Equal(a.EKPublic, rec.EKPublic) {
		return nil, refuse("EK certificate", "not the EK enrolled for this node")
	}
	if _, err := verifyEKCert(a.EKCert, a.EKPublic, p.EKCA); err != nil {
		return nil, err
	}
	if !bytes.Equal(a.AKPublic, rec.AKPublic) {
		return nil, refuse("AK", "not the AK activated at enrolment")
	}
	ak, err := checkAKPublic(a.AKPublic)
	if err != nil {
		return nil, err
	}
	nonce := p.Nonce
	switch {
	case p.Nonces != nil && len(nonce) != 0:
		return nil, errors.New("policy: a nonce and a nonce store: give one")
	case p.Nonces != nil:
		// Checked against the store once the quote is the AK's (below): only the node's
		// TPM can spend an issued nonce.
		nonce = a.Nonce
	case len(nonce) == 0:
		sum := sha256.Sum256(m.Payload)
		nonce = sum[:]
	}
	if !bytes.Equal(a.Nonce, nonce) {
		return nil, refuse("quote", "made for nonce %x, want %x", a.Nonce, nonce)
	}
	if !bytes.Equal(a.SigningKeyPublic, rec.SigningKeyPublic) {
		return nil, refuse("signing key", "not the signing key certified at enrolment")
	}
	sk, err := checkCertify(ak, a)
	if err != nil {
		return nil, err
	}
	if m.Signer != nil {
		if eq, ok := m.Signer.(interface{ Equal(crypto.PublicKey) bool }); !ok || !eq.Equal(sk) {
			return nil, refuse("signing key", "the manifest was signed by another key than the one the AK certified")
		}
	}
	att, _, err := checkSigned(ak, a.Quote, tpm2.TPMSTAttestQuote, "quote")
	if err != nil {
		return nil, err
	}
	if !bytes.Equal(att.ExtraData.Buffer, nonce) {
		return nil, refuse("quote", "quoted nonce %x, want %x", att.ExtraData.Buffer, nonce)
	}
	if p.Nonces != nil {
		if err := p.Nonces.Use(nonce); err != nil {
			return nil, err
		}
	}
	q, err := att.Attested.Quote()
	if err != nil {
		return nil, refuse("quote", "quote info: %v", err)
	}
	if !bytes.Equal(tpm2.Marshal(q.PCRSelect), tpm2.Marshal(selection())) {
		return nil, refuse("quote", "does not select the sha256 bank of PCRs %v", QuotedPCRs)
	}
	d, err := pcrDigest(a.PCRs, QuotedPCRs)
	if err != nil {
		return nil, refuse("quote", "%v", err)
	}
	if !bytes.Equal(d, q.PCRDigest.Buffer) {
		return nil, refuse("quote", "the PCR values given are not the ones quoted")
	}
	if err := checkPassageLog(a.PassageLog, a.PCRs[ManifestPCR], m.Payload); err != nil {
		return nil, err
	}
	seen, err := checkSeen(rec.Seen, att.ClockInfo.ResetCount, m.Generation)
	if err != nil {
		return nil, err
	}
	return &Result{ResetCount: att.ClockInfo.ResetCount, RestartCount: att.ClockInfo.RestartCount, Seen: seen}, nil
}

// checkPassageLog replays passage's event log (a TCG PC Client log, manifest.EventLog)
// into the quoted PCR 13 with go-attestation, as the firmware's log is replayed, and
// checks its last event measured this manifest: the quote then covers this manifest,
// written in the quoted boot (PCRs reset only with the TPM).
func checkPassageLog(raw []byte, pcr13, payload []byte) error {
	const check = "PCR 13"
	if len(raw) == 0 {
		return refuse(check, "no passage event log")
	}
	l, err := manifest.ParseEventLog(raw)
	if err != nil {
		return refuse(check, "%v", err)
	}
	if len(l.Events) == 0 {
		return refuse(check, "passage's event log has no events")
	}
	if l.PCR != ManifestPCR {
		return refuse(check, "passage's event log is of PCR %d", l.PCR)
	}
	el, err := goattest.ParseEventLog(raw)
	if err != nil {
		return refuse(check, "passage's event log: %v", err)
	}
	events, err := el.Verify([]goattest.PCR{{Index: ManifestPCR, Digest: pcr13, DigestAlg: crypto.SHA256}})
	if err != nil {
		return refuse(check, "passage's event log does not replay to the quoted %x: %v", pcr13, err)
	}
	if len(events) != len(l.Events) {
		return refuse(check, "passage's event log replays %d events of %d", len(events), len(l.Events))
	}
	sum := sha256.Sum256(payload)
	last, ev := events[len(events)-1], l.Events[len(l.Events)-1]
	if !bytes.Equal(last.Digest, sum[:]) {
		return refuse(check, "last event measured %x (generation %d), not this manifest's payload sha256:%x", last.Digest, ev.Generation, sum)
	}
	return nil
}

// checkSeen holds the quote's TPM reset count and the manifest's generation to the
// newest pair accepted for the node: a generation never goes back; a later boot (a
// higher reset count) must carry a new generation, so a manifest re-measured into a
// later boot's PCR 13 is refused; a new generation in the same boot (recycle) is fine.
func checkSeen(prev Seen, reset uint32, gen uint64) (Seen, error) {
	const check = "reset count"
	switch {
	case gen < prev.Generation:
		return prev, evidence(check, "generation %d is older than %d already seen", gen, prev.Generation)
	case reset < prev.ResetCount:
		return prev, evidence(check, "TPM reset count %d is lower than %d already seen (TPM cleared or another TPM)", reset, prev.ResetCount)
	case reset > prev.ResetCount && gen <= prev.Generation:
		return prev, evidence(check, "a later boot (reset count %d after %d) with generation %d, not newer than %d", reset, prev.ResetCount, gen, prev.Generation)
	}
	return Seen{ResetCount: reset, Generation: gen}, nil
}
