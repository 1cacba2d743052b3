// Package attest proves to a verifier that never saw the node that a manifest was signed
// by a key inside a genuine TPM on that node, in a boot of an image the operator
// approved. The node side (Collect, Activate) talks to the TPM; the verifier side
// (Enrol, Complete, Verify) holds the operator's EK CA and approved image, and checks:
//
//   - the EK certificate chains to the operator's CA (the TPM is genuine);
//   - the attestation key (AK) is the one enrolment activated against that EK
//     (TPM2_MakeCredential / TPM2_ActivateCredential: the AK lives in that TPM);
//   - passage's signing key is certified by the AK (TPM2_Certify: it lives there too);
//   - a quote by the AK over PCRs 0-5, 7, 9, 11, 12, 13 with the nonce, whose PCR 13
//     replays passage's event log ending in this manifest's payload digest, and whose
//     firmware PCRs replay the firmware's event log with Secure Boot on, the operator's
//     db certificate as PCR 7 authority, an approved image's Authenticode hash in PCR
//     4's log and an approved PCR 11 (the boot ran the approved image).
//
// TPM 2.0 Part 1 section 24 (credential protection) and Part 3 sections 12.5 (MakeCredential),
// 12.6 (ActivateCredential), 18.2 (Certify), 18.4 (Quote) describe the primitives.
package attest

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"

	"github.com/passage-boot/passage/manifest"
)

// Format names the attestation file's shape.
const Format = "passage-attestation/1"

// Suffix is appended to the manifest's file name to name its attestation.
const Suffix = ".attest.json"

// FirmwareLogPath is where Linux exposes the firmware's TCG event log (securityfs).
const FirmwareLogPath = "/sys/kernel/security/tpm0/binary_bios_measurements"

// QuotedPCRs are the PCRs every quote covers (sha256 bank): 0-5 and 7 the firmware's
// (code, configuration, boot manager and Secure Boot policy), 9 the kernel stub's
// initrd and load options, 11 the UKI's sections (systemd-stub), 12 its command line
// overrides and credentials (zero when none), 13 passage's manifests.
var QuotedPCRs = []int{0, 1, 2, 3, 4, 5, 7, 9, 11, 12, 13}

// ManifestPCR is the PCR passage extends with each manifest's payload digest
// (manifest/tpmkey.PCR; repeated here so a verifier does not link TPM device code).
const ManifestPCR = 13

// Attestation is what the node writes beside the manifest and publishes with it. Byte
// fields are TPM wire structures (TPM 2.0 Part 2) or DER, base64 in JSON.
type Attestation struct {
	Format string `json:"format"`
	// EKCert is the endorsement key's certificate (DER), read from the TPM's NV.
	EKCert []byte `json:"ek_cert"`
	// EKPublic is the EK's TPMT_PUBLIC: the verifier encrypts the credential to it.
	EKPublic []byte `json:"ek_public"`
	// AKPublic is the attestation key's TPMT_PUBLIC.
	AKPublic []byte `json:"ak_public"`
	// SigningKeyPublic is passage's manifest signing key's TPMT_PUBLIC.
	SigningKeyPublic []byte `json:"signing_key_public"`
	// Nonce is the qualifying data of Certify and Quote: the verifier's, or the
	// manifest's payload digest when the node attests offline.
	Nonce []byte `json:"nonce"`
	// NonceSource says where the node took Nonce from: NonceControlPlane (fetched from
	// passage.url just before the quote) or NoncePayloadDigest (offline). It is the node's
	// word, signed by nothing: a verifier that issues nonces checks the nonce itself.
	NonceSource string `json:"nonce_source,omitempty"`
	// Certify is TPM2_Certify of the signing key by the AK.
	Certify Signed `json:"certify"`
	// Quote is TPM2_Quote by the AK over QuotedPCRs.
	Quote Signed `json:"quote"`
	// PCRs are the sha256 values of QuotedPCRs read right after the quote, keyed by
	// index; the quote's digest binds them.
	PCRs map[int]HexBytes `json:"pcrs"`
	// FirmwareLog is the firmware's TCG PC Client event log as securityfs gives it.
	FirmwareLog []byte `json:"firmware_log"`
	// PassageLog is passage's own event log of PCR 13 (the manifest's event log file,
	// a TCG PC Client crypto-agile log like the firmware's).
	PassageLog []byte `json:"passage_log"`
	// Envelope is the DSSE envelope of the manifest this attestation is for, when the
	// attestation is delivered to a control plane: it is taken with the quote that names
	// it (passage's event log ends in its payload's digest) or not at all.
	Envelope json.RawMessage `json:"envelope,omitempty"`
}

// WithEnvelope is the attestation body b carrying envelope: what a node delivers to a
// control plane, which takes a manifest only with the quote that names it.
func WithEnvelope(b, envelope []byte) ([]byte, error) {
	a, err := ParseAttestation(b)
	if err != nil {
		return nil, err
	}
	a.Envelope = envelope
	return a.Marshal()
}

// Where a node's nonce came from (Attestation.NonceSource).
const (
	NonceControlPlane  = "control-plane"
	NoncePayloadDigest = "payload-digest"
)

// Signed is a TPMS_ATTEST and the TPMT_SIGNATURE over it.
type Signed struct {
	Attest    []byte `json:"attest"`
	Signature []byte `json:"signature"`
}

// HexBytes is a byte string written as hex.
type HexBytes []byte

// MarshalJSON writes hex.
func (h HexBytes) MarshalJSON() ([]byte, error) { return json.Marshal(hex.EncodeToString(h)) }

// UnmarshalJSON reads hex.
func (h *HexBytes) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	d, err := hex.DecodeString(s)
	if err != nil {
		return err
	}
	*h = d
	return nil
}

// MaxFile bounds what is read as an attestation: it carries a firmware log of tens of
// kilobytes (at most MaxFirmwareLog); anything far larger is not one.
const MaxFile = 8 << 20

// ReadAttestation reads an attestation file.
func ReadAttestation(path string) (*Attestation, error) {
	b, err := manifest.ReadRegular(path, MaxFile)
	if err != nil {
		return nil, fmt.Errorf("attestation %s: %w", path, err)
	}
	a, err := ParseAttestation(b)
	if err != nil {
		return nil, fmt.Errorf("attestation %s: %w", path, err)
	}
	return a, nil
}

// ParseAttestation reads an attestation document (a file's bytes, a POST's body).
func ParseAttestation(b []byte) (*Attestation, error) {
	var a Attestation
	if err := json.Unmarshal(b, &a); err != nil {
		return nil, err
	}
	if a.Format != Format {
		return nil, fmt.Errorf("format %q, want %q", a.Format, Format)
	}
	return &a, nil
}

// Marshal is the attestation file's content.
func (a *Attestation) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(a, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// pcrDigest is TPMS_QUOTE_INFO's pcrDigest: the hash of the selected PCR values
// concatenated in index order (TPM 2.0 Part 3 section 18.4.1).
func pcrDigest(pcrs map[int]HexBytes, sel []int) ([]byte, error) {
	idx := append([]int(nil), sel...)
	sort.Ints(idx)
	h := sha256.New()
	for _, i := range idx {
		v, ok := pcrs[i]
		if !ok {
			return nil, fmt.Errorf("PCR %d: no value given", i)
		}
		if len(v) != sha256.Size {
			return nil, fmt.Errorf("PCR %d: %d bytes, want %d", i, len(v), sha256.Size)
		}
		h.Write(v)
	}
	return h.Sum(nil), nil
}

// Refusal is why a verification refuses: the check that failed (named as the operator
// reads it: "EK certificate", "AK", "signing key", "quote", "PCR 13", "PCR 7", ...).
type Refusal struct {
	Check string
	Err   error
	// Evidence says the refusal rests on what the node's TPM vouched for: a quote that
	// verified, over event logs that replay into it, showing a boot that is not approved
	// or a rollback. Any other refusal (a log that does not replay, an event whose data
	// is not what its digest says, a forged or stale quote) anyone on the way could
	// have caused, and it says nothing about the node.
	Evidence bool
}

func (r *Refusal) Error() string { return r.Check + ": " + r.Err.Error() }
func (r *Refusal) Unwrap() error { return r.Err }

func refuse(check, format string, a ...any) error {
	return &Refusal{Check: check, Err: fmt.Errorf(format, a...)}
}

// evidence is a refusal that is evidence against the node (Refusal.Evidence).
func evidence(check, format string, a ...any) error {
	return &Refusal{Check: check, Err: fmt.Errorf(format, a...), Evidence: true}
}

// IsEvidence says whether err is a refusal that is evidence against the node.
func IsEvidence(err error) bool {
	var r *Refusal
	return errors.As(err, &r) && r.Evidence
}

// CheckOf names the check err refused on ("" when err is not a refusal).
func CheckOf(err error) string {
	var r *Refusal
	if errors.As(err, &r) {
		return r.Check
	}
	return ""
}
