package attest

import (
	"bytes"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/asn1"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"

	"github.com/passage-boot/passage/manifest"
)

// NodeFormat names the node record's shape.
const NodeFormat = "passage-attest-node/1"

// PendingFormat names a pending enrolment's shape.
const PendingFormat = "passage-attest-pending/1"

// NodeRecord is what the fleet keeps of a node after enrolment: the EK certificate and
// public area, the AK activated against it, passage's signing key certified by that AK,
// and the last (reset count, generation) an attestation showed.
type NodeRecord struct {
	Format           string `json:"format"`
	EKCert           []byte `json:"ek_cert"`
	EKPublic         []byte `json:"ek_public"`
	AKPublic         []byte `json:"ak_public"`
	SigningKeyPublic []byte `json:"signing_key_public"`
	Seen             Seen   `json:"seen"`
}

// Seen is the newest (TPM reset count, manifest generation) accepted for a node.
type Seen struct {
	ResetCount uint32 `json:"reset_count"`
	Generation uint64 `json:"generation"`
}

// Pending is the verifier's half of an enrolment between the challenge and the node's
// answer: the record it will keep, and the digest of the credential it sealed (the
// credential itself is not kept, so the pending file is no secret).
type Pending struct {
	Format       string     `json:"format"`
	Record       NodeRecord `json:"record"`
	SecretSHA256 HexBytes   `json:"secret_sha256"`
}

// CAPool reads the operator's EK CA certificates (PEM). Every certificate in the file is
// a trust anchor: a vendor's root, or a manufacturing intermediate the operator trusts.
func CAPool(pemBytes []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	n := 0
	for rest := pemBytes; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("EK CA certificate %d: %w", n+1, err)
		}
		pool.AddCert(c)
		n++
	}
	if n == 0 {
		return nil, errors.New("no PEM CERTIFICATE in the EK CA file")
	}
	return pool, nil
}

var oidSAN = asn1.ObjectIdentifier{2, 5, 29, 17}

// verifyEKCert checks the EK certificate chains to the operator's CA and certifies the
// EK public area given. TCG EK certificates carry the TPM's manufacturer, model and
// version in a critical subjectAltName of directoryName form (EK Credential Profile
// section 3.2.9), which Go's x509 leaves in UnhandledCriticalExtensions and then refuses
// the chain for; it is the one critical extension cleared before verifying.
func verifyEKCert(der, ekPublic []byte, ca *x509.CertPool) (*tpm2.TPMTPublic, error) {
	if len(der) == 0 {
		return nil, refuse("EK certificate", "none in the attestation (the TPM has none at NV %#x)", uint32(EKCertIndex))
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, refuse("EK certificate", "%v", err)
	}
	kept := cert.UnhandledCriticalExtensions[:0]
	for _, oid := range cert.UnhandledCriticalExtensions {
		if !oid.Equal(oidSAN) {
			kept = append(kept, oid)
		}
	}
	cert.UnhandledCriticalExtensions = kept
	if _, err := cert.Verify(x509.VerifyOptions{Roots: ca, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, refuse("EK certificate", "issued by %q: not the operator's EK CA: %v", cert.Issuer.String(), err)
	}
	pub, err := tpm2.Unmarshal[tpm2.TPMTPublic](ekPublic)
	if err != nil {
		return nil, refuse("EK certificate", "EK public area: %v", err)
	}
	// The EK's template is the TCG's, but for its modulus: the credential is encrypted
	// with these parameters, and the attributes say it is a restricted decryption key
	// that never leaves the TPM.
	want := tpm2.RSAEKTemplate
	got := *pub
	got.Unique = want.Unique
	if !bytes.Equal(tpm2.Marshal(got), tpm2.Marshal(want)) {
		return nil, refuse("EK certificate", "EK public area is not the TCG RSA-2048 EK template")
	}
	k, err := tpm2.Pub(*pub)
	if err != nil {
		return nil, refuse("EK certificate", "EK public area: %v", err)
	}
	certKey, ok := cert.PublicKey.(*rsa.PublicKey)
	if !ok || !certKey.Equal(k) {
		return nil, refuse("EK certificate", "certifies another key than the EK the attestation names")
	}
	return pub, nil
}

// checkAKPublic parses the AK's public area and checks it is AKTemplate's kind of key:
// restricted signing, fixedTPM, in which case it signs only TPM-made structures.
func checkAKPublic(b []byte) (*tpm2.TPMTPublic, error) {
	pub, err := tpm2.Unmarshal[tpm2.TPMTPublic](b)
	if err != nil {
		return nil, refuse("AK", "public area: %v", err)
	}
	want := AKTemplate()
	got := *pub
	got.Unique = want.Unique
	if !bytes.Equal(tpm2.Marshal(got), tpm2.Marshal(want)) {
		return nil, refuse("AK", "not a restricted fixedTPM ECC P-256 signing key of passage's AK template")
	}
	return pub, nil
}

// checkSigningPublic parses the signing key's public area: a fixedTPM key created by
// the TPM (sensitiveDataOrigin), so a certification of it proves it never left the TPM.
func checkSigningPublic(b []byte) (*tpm2.TPMTPublic, error) {
	pub, err := tpm2.Unmarshal[tpm2.TPMTPublic](b)
	if err != nil {
		return nil, refuse("signing key", "public area: %v", err)
	}
	a := pub.ObjectAttributes
	if !a.FixedTPM || !a.FixedParent || !a.SensitiveDataOrigin || !a.SignEncrypt || pub.Type != tpm2.TPMAlgECC {
		return nil, refuse("signing key", "not a fixedTPM ECC signing key generated in the TPM")
	}
	return pub, nil
}

// Enrol starts enrolment from the node's attestation: it checks the EK certificate
// against ca, the AK's and signing key's public areas and the signing key's
// certification by the AK, then seals a fresh credential to the EK for the AK's name
// (TPM2_MakeCredential done in software, tpm2.CreateCredential). The node answers with
// Activate; Complete checks the answer.
func Enrol(a *Attestation, ca *x509.CertPool) (*Challenge, *Pending, error) {
	ekPub, err := verifyEKCert(a.EKCert, a.EKPublic, ca)
	if err != nil {
		return nil, nil, err
	}
	akPub, err := checkAKPublic(a.AKPublic)
	if err != nil {
		return nil, nil, err
	}
	if _, err := checkCertify(akPub, a); err != nil {
		return nil, nil, err
	}
	q, _, err := checkSigned(akPub, a.Quote, tpm2.TPMSTAttestQuote, "quote")
	if err != nil {
		return nil, nil, err
	}
	akName, err := tpm2.ObjectName(akPub)
	if err != nil {
		return nil, nil, refuse("AK", "name: %v", err)
	}
	encKey, err := tpm2.ImportEncapsulationKey(ekPub)
	if err != nil {
		return nil, nil, refuse("EK certificate", "EK public area: %v", err)
	}
	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return nil, nil, err
	}
	blob, encSecret, err := tpm2.CreateCredential(rand.Reader, encKey, akName.Buffer, secret)
	if err != nil {
		return nil, nil, fmt.Errorf("make credential: %w", err)
	}
	sum := sha256.Sum256(secret)
	p := &Pending{
		Format: PendingFormat,
		Record: NodeRecord{
			Format: NodeFormat, EKCert: a.EKCert, EKPublic: a.EKPublic, AKPublic: a.AKPublic,
			SigningKeyPublic: a.SigningKeyPublic,
			Seen:             Seen{ResetCount: q.ClockInfo.ResetCount},
		},
		SecretSHA256: sum[:],
	}
	c := &Challenge{Format: ChallengeFormat, AKName: akName.Buffer, CredentialBlob: blob, Secret: encSecret}
	return c, p, nil
}

// Complete finishes enrolment: the node's answer must be the credential sealed in the
// challenge, which only a TPM holding both the EK and an object of the AK's name could
// have recovered.
func Complete(p *Pending, answer []byte) (*NodeRecord, error) {
	if p.Format != PendingFormat {
		return nil, fmt.Errorf("pending enrolment: format %q, want %q", p.Format, PendingFormat)
	}
	sum := sha256.Sum256(answer)
	if len(p.SecretSHA256) != len(sum) || subtle.ConstantTimeCompare(sum[:], p.SecretSHA256) != 1 {
		return nil, refuse("AK", "the node's answer is not the credential sealed to its EK: the AK is not in that TPM")
	}
	r := p.Record
	return &r, nil
}

// SigningKeyPEM is the enrolled signing key as a PEM "PUBLIC KEY", the file
// `passage verify --tpm-pub` reads: enrolment certifies it, instead of trusting the key
// `passage tpm-pubkey` first showed.
func (r *NodeRecord) SigningKeyPEM() ([]byte, error) {
	pub, err := checkSigningPublic(r.SigningKeyPublic)
	if err != nil {
		return nil, err
	}
	k, err := tpm2.Pub(*pub)
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKIXPublicKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), nil
}

// ReadJSON reads a bounded JSON file of the given format (the format field checked).
func ReadJSON(path, format string, v any) error {
	b, err := manifest.ReadRegular(path, MaxFile)
	if err != nil {
		return err
	}
	var head struct {
		Format string `json:"format"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if head.Format != format {
		return fmt.Errorf("%s: format %q, want %q", path, head.Format, format)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
