// Package softtpm is a TPM 2.0 done in software, for tests and the boot-storm load
// generator only. It makes what a node's TPM makes for passage's attestation: an RSA-2048
// EK of the TCG template whose certificate chains to a test CA, the AK of
// attest.AKTemplate, passage's signing key of tpmkey.Template, TPM2_Certify and
// TPM2_Quote by the AK over the sha256 PCRs, and TPM2_ActivateCredential. Its structures
// are go-tpm's tpm2 ones, marshalled as a TPM marshals them, so the verifier (attest.Enrol,
// attest.Complete, attest.VerifyTPM, attest.VerifyFirmware, and passage-control on top of
// them) checks them exactly as it checks a real TPM's: nothing is relaxed for it.
//
// It proves nothing a TPM proves: its keys are in process memory, where anyone can read
// them. It exists because swtpm, a process and a manufacturing round per node, cannot
// play thousands of nodes at once on one machine.
package softtpm

import (
	"bytes"
	"context"
	"crypto"
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"sync/atomic"
	"time"

	goattest "github.com/google/go-attestation/attest"
	"github.com/google/go-tpm/tpm2"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// CA is a test EK CA: it issues the EK certificates of the TPMs made with it, as a TPM
// vendor's CA does; an operator trusting it gives PEM to the verifier (--ek-ca).
type CA struct {
	cert   *x509.Certificate
	key    *ecdsa.PrivateKey
	serial atomic.Int64
}

// NewCA makes a CA with an ECDSA P-256 key (cheap to sign thousands of certificates with).
func NewCA() (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{Organization: []string{"passage"}, CommonName: "passage test EK CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(10 * 365 * 24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("EK CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("EK CA: %w", err)
	}
	ca := &CA{cert: cert, key: key}
	ca.serial.Store(1)
	return ca, nil
}

// PEM is the CA's certificate, the verifier's EK CA file.
func (ca *CA) PEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.cert.Raw})
}

// issue makes an EK certificate for pub. The TCG profile's fields (the critical SAN
// naming the TPM's model, the TPM specification attributes) are left out: the verifier
// reads none of them but the SAN, which it only clears.
func (ca *CA) issue(pub *rsa.PublicKey) ([]byte, error) {
	n := ca.serial.Add(1)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(n), Subject: pkix.Name{},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(10 * 365 * 24 * time.Hour),
		KeyUsage: x509.KeyUsageKeyEncipherment, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, pub, ca.key)
	if err != nil {
		return nil, fmt.Errorf("EK certificate %d: %w", n, err)
	}
	return der, nil
}

// GenerateEK makes an EK's private key: RSA-2048, the TCG template's (attest accepts no
// other). It takes tens of milliseconds of CPU: a load generator makes its EKs before it
// starts the clock.
func GenerateEK() (*rsa.PrivateKey, error) { return rsa.GenerateKey(rand.Reader, 2048) }

// Firmware is what a boot's firmware measured: its TCG event log and the sha256 PCR values
// that replaying it gives (every PCR of attest.QuotedPCRs but 13, zero when unlogged).
type Firmware struct {
	Log  []byte
	pcrs map[int][]byte
}

// NewFirmware replays log as a TPM extends it: each sha256 digest into its PCR, in log
// order, EV_NO_ACTION events logged but never extended (PC Client spec section 10.4.1).
func NewFirmware(log []byte) (*Firmware, error) {
	el, err := goattest.ParseEventLog(log)
	if err != nil {
		return nil, fmt.Errorf("firmware log: %w", err)
	}
	fw := &Firmware{Log: log, pcrs: map[int][]byte{}}
	for _, i := range attest.QuotedPCRs {
		fw.pcrs[i] = make([]byte, sha256.Size)
	}
	for _, e := range el.Events(goattest.HashSHA256) {
		if e.Type == 3 { // EV_NO_ACTION
			continue
		}
		v, ok := fw.pcrs[e.Index]
		if !ok {
			v = make([]byte, sha256.Size)
		}
		fw.pcrs[e.Index] = extend(v, e.Digest)
	}
	return fw, nil
}

func extend(pcr, digest []byte) []byte {
	h := sha256.New()
	h.Write(pcr)
	h.Write(digest)
	return h.Sum(nil)
}

// TPM is one node's TPM. It is not safe for concurrent use (a TPM serves one command at a
// time, too).
type TPM struct {
	ek     *rsa.PrivateKey
	ekCert []byte
	ekPub  tpm2.TPMTPublic
	ak, sk *ecdsa.PrivateKey
	akPub  tpm2.TPMTPublic
	skPub  tpm2.TPMTPublic
	akName tpm2.TPM2BName
	skName tpm2.TPM2BName
	skID   string
	// pcrs is the sha256 bank of attest.QuotedPCRs.
	pcrs     map[int][]byte
	firmware []byte
	// log is passage's event log of PCR 13 in this boot.
	log        *manifest.EventLog
	resetCount uint32
	boots      int
	start      time.Time
}

// New manufactures a TPM around ek (GenerateEK), its EK certificate issued by ca, and
// makes its AK and signing key (fresh P-256 keys; a real TPM derives them from its seeds
// and the templates). It is not booted: Reboot first.
func New(ca *CA, ek *rsa.PrivateKey) (*TPM, error) {
	t := &TPM{ek: ek, start: time.Now()}
	var err error
	if t.ekCert, err = ca.issue(&ek.PublicKey); err != nil {
		return nil, err
	}
	t.ekPub = tpm2.RSAEKTemplate
	t.ekPub.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgRSA, &tpm2.TPM2BPublicKeyRSA{Buffer: ek.PublicKey.N.FillBytes(make([]byte, 256))})
	if t.ak, t.akPub, t.akName, err = eccKey(attest.AKTemplate()); err != nil {
		return nil, fmt.Errorf("AK: %w", err)
	}
	if t.sk, t.skPub, t.skName, err = eccKey(tpmkey.Template()); err != nil {
		return nil, fmt.Errorf("signing key: %w", err)
	}
	if t.skID, err = manifest.KeyID(&t.sk.PublicKey); err != nil {
		return nil, err
	}
	return t, nil
}

// eccKey makes a P-256 key and its public area of tmpl (the point in unique, as
// TPM2_CreatePrimary returns it) and name.
func eccKey(tmpl tpm2.TPMTPublic) (*ecdsa.PrivateKey, tpm2.TPMTPublic, tpm2.TPM2BName, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, tmpl, tpm2.TPM2BName{}, err
	}
	pt, err := k.PublicKey.Bytes() // 0x04 || X || Y
	if err != nil {
		return nil, tmpl, tpm2.TPM2BName{}, err
	}
	tmpl.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
		X: tpm2.TPM2BECCParameter{Buffer: pt[1:33]}, Y: tpm2.TPM2BECCParameter{Buffer: pt[33:]},
	})
	name, err := tpm2.ObjectName(&tmpl)
	if err != nil {
		return nil, tmpl, tpm2.TPM2BName{}, err
	}
	return k, tmpl, *name, nil
}

// Reboot is TPM2_Startup(CLEAR) after a reset, then the firmware's measurements: the
// PCRs hold fw's values (13 reset to zero), the reset count goes one up, passage's event
// log starts afresh.
func (t *TPM) Reboot(fw *Firmware) {
	t.pcrs = map[int][]byte{}
	for i, v := range fw.pcrs {
		t.pcrs[i] = bytes.Clone(v)
	}
	t.pcrs[attest.ManifestPCR] = make([]byte, sha256.Size)
	t.firmware = fw.Log
	if t.boots > 0 {
		t.resetCount++
	}
	t.boots++
	t.log = &manifest.EventLog{Format: manifest.EventLogFormat, BootID: fmt.Sprintf("soft-boot-%d", t.boots), PCR: attest.ManifestPCR}
}

// EKCert is the EK certificate (DER), as the TPM's NV holds it.
func (t *TPM) EKCert() []byte { return t.ekCert }

// Public is passage's signing key (manifest.NewVerifier takes it).
func (t *TPM) Public() crypto.PublicKey { return &t.sk.PublicKey }

// KeyID implements manifest.Signer.
func (t *TPM) KeyID() (string, error) { return t.skID, nil }

// Sign implements manifest.Signer as tpmkey does: ECDSA over the SHA-256 of data, ASN.1
// DER.
func (t *TPM) Sign(_ context.Context, data []byte) ([]byte, error) {
	sum := sha256.Sum256(data)
	return ecdsa.SignASN1(rand.Reader, t.sk, sum[:])
}

// SignManifest signs m with the signing key and measures it into PCR 13 as the boot's
// manifest stage does (manifest.WriteSigned with tpmkey), keeping passage's event log in
// memory: the envelope and the log as they would be on disk.
func (t *TPM) SignManifest(ctx context.Context, m *manifest.Manifest, name string) (*manifest.Signed, []byte, error) {
	if t.log == nil {
		return nil, nil, errors.New("soft TPM: not booted (Reboot first)")
	}
	m.BootID = t.log.BootID
	s, err := manifest.Sign(ctx, m, t)
	if err != nil {
		return nil, nil, err
	}
	sum := sha256.Sum256(s.Payload)
	t.log.Events = append(t.log.Events, manifest.Event{Generation: m.Generation, Manifest: name, PayloadDigest: s.Digest,
		Digests: map[string]string{"sha256": hex.EncodeToString(sum[:])}})
	log, err := t.log.Marshal()
	if err != nil {
		return nil, nil, err
	}
	t.pcrs[attest.ManifestPCR] = extend(t.pcrs[attest.ManifestPCR], sum[:])
	return s, log, nil
}

// selection is attest's PCR selection: the sha256 bank of attest.QuotedPCRs.
func selection() tpm2.TPMLPCRSelection {
	pcrs := make([]uint, len(attest.QuotedPCRs))
	for i, p := range attest.QuotedPCRs {
		pcrs[i] = uint(p)
	}
	return tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{
		{Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(pcrs...)},
	}}
}

// signAttest marshals a TPMS_ATTEST the TPM made (TPM_GENERATED magic, the clock and
// this boot's reset count) and signs it with the AK: ECDSA over its SHA-256, as a
// TPMT_SIGNATURE.
func (t *TPM) signAttest(typ tpm2.TPMST, nonce []byte, info tpm2.TPMUAttest) (attest.Signed, error) {
	a := tpm2.TPMSAttest{
		Magic: tpm2.TPMGeneratedValue, Type: typ, QualifiedSigner: t.akName,
		ExtraData: tpm2.TPM2BData{Buffer: nonce},
		ClockInfo: tpm2.TPMSClockInfo{Clock: uint64(time.Since(t.start).Milliseconds()), ResetCount: t.resetCount, Safe: true},
		Attested:  info,
	}
	b := tpm2.Marshal(a)
	sum := sha256.Sum256(b)
	r, s, err := ecdsa.Sign(rand.Reader, t.ak, sum[:])
	if err != nil {
		return attest.Signed{}, err
	}
	sig := tpm2.TPMTSignature{SigAlg: tpm2.TPMAlgECDSA, Signature: tpm2.NewTPMUSignature(tpm2.TPMAlgECDSA, &tpm2.TPMSSignatureECC{
		Hash:       tpm2.TPMAlgSHA256,
		SignatureR: tpm2.TPM2BECCParameter{Buffer: r.FillBytes(make([]byte, 32))},
		SignatureS: tpm2.TPM2BECCParameter{Buffer: s.FillBytes(make([]byte, 32))},
	})}
	return attest.Signed{Attest: b, Signature: tpm2.Marshal(sig)}, nil
}

// Attest is attest.Collect in software: the signing key certified by the AK
// (TPM2_Certify) and attest.QuotedPCRs quoted (TPM2_Quote), both over nonce, with the
// PCR values, the firmware's log and passage's (log, from SignManifest).
func (t *TPM) Attest(nonce, log []byte) (*attest.Attestation, error) {
	if len(nonce) == 0 || len(nonce) > 64 {
		return nil, fmt.Errorf("nonce of %d bytes: want 1 to 64", len(nonce))
	}
	if t.log == nil {
		return nil, errors.New("soft TPM: not booted (Reboot first)")
	}
	crt, err := t.signAttest(tpm2.TPMSTAttestCertify, nonce, tpm2.NewTPMUAttest(tpm2.TPMSTAttestCertify,
		&tpm2.TPMSCertifyInfo{Name: t.skName, QualifiedName: t.skName}))
	if err != nil {
		return nil, fmt.Errorf("certify signing key: %w", err)
	}
	pcrs := map[int]attest.HexBytes{}
	h := sha256.New()
	for _, i := range attest.QuotedPCRs { // in index order: QuotedPCRs is sorted
		pcrs[i] = bytes.Clone(t.pcrs[i])
		h.Write(t.pcrs[i])
	}
	q, err := t.signAttest(tpm2.TPMSTAttestQuote, nonce, tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote,
		&tpm2.TPMSQuoteInfo{PCRSelect: selection(), PCRDigest: tpm2.TPM2BDigest{Buffer: h.Sum(nil)}}))
	if err != nil {
		return nil, fmt.Errorf("quote: %w", err)
	}
	return &attest.Attestation{
		Format: attest.Format, EKCert: t.ekCert, EKPublic: tpm2.Marshal(t.ekPub), AKPublic: tpm2.Marshal(t.akPub),
		SigningKeyPublic: tpm2.Marshal(t.skPub), Nonce: nonce, NonceSource: attest.NonceControlPlane,
		Certify: crt, Quote: q, PCRs: pcrs, FirmwareLog: t.firmware, PassageLog: log,
	}, nil
}

// labelIdentity is the OAEP label and KDF use of credential protection (TPM 2.0 Part 1
// section 24.4, "IDENTITY" with its terminating NUL).
const labelIdentity = "IDENTITY\x00"

// Activate is TPM2_ActivateCredential with the AK as the activated object and the EK as
// the decrypting key (Part 1 section 24, Part 3 section 12.5): the seed is decrypted with
// the EK (RSA-OAEP, SHA-256, label IDENTITY); the integrity HMAC over the encrypted
// credential and the AK's name is checked with KDFa(seed, "INTEGRITY"); the credential is
// decrypted with AES-128-CFB under KDFa(seed, "STORAGE", AK name), zero IV. A challenge
// made for another TPM's EK, or for an object of another name, fails the integrity
// check, as the TPM's TPM_RC_INTEGRITY.
func (t *TPM) Activate(c *attest.Challenge) ([]byte, error) {
	seed, err := rsa.DecryptOAEP(sha256.New(), nil, t.ek, c.Secret, []byte(labelIdentity))
	if err != nil {
		return nil, fmt.Errorf("activate credential: secret: %w", err)
	}
	integrity, err := tpm2.Unmarshal[tpm2.TPM2BDigest](c.CredentialBlob)
	if err != nil {
		return nil, fmt.Errorf("activate credential: credential blob: %w", err)
	}
	encIdentity := c.CredentialBlob[2+len(integrity.Buffer):]
	name := t.akName.Buffer
	mac := hmac.New(sha256.New, tpm2.KDFa(crypto.SHA256, seed, "INTEGRITY", nil, nil, 256))
	mac.Write(encIdentity)
	mac.Write(name)
	if !hmac.Equal(mac.Sum(nil), integrity.Buffer) {
		return nil, errors.New("activate credential: integrity check failed (not sealed to this EK for this AK)")
	}
	block, err := aes.NewCipher(tpm2.KDFa(crypto.SHA256, seed, "STORAGE", name, nil, 128))
	if err != nil {
		return nil, err
	}
	plain := make([]byte, len(encIdentity))
	//lint:ignore SA1019 credential protection is AES-CFB (TPM 2.0 Part 1 section 24.4), as a TPM decrypts it
	cipher.NewCFBDecrypter(block, make([]byte, aes.BlockSize)).XORKeyStream(plain, encIdentity)
	cred, err := tpm2.Unmarshal[tpm2.TPM2BDigest](plain)
	if err != nil {
		return nil, fmt.Errorf("activate credential: credential: %w", err)
	}
	return cred.Buffer, nil
}

// PCR implements manifest.Measurer: passage's PCR.
func (t *TPM) PCR() int { return attest.ManifestPCR }

// Banks implements manifest.Measurer: the sha256 bank, the one attest quotes.
func (t *TPM) Banks() []string { return []string{"sha256"} }

// Extend implements manifest.Measurer (manifest.WriteSigned, to a file).
func (t *TPM) Extend(d map[string][]byte) error {
	if t.log == nil {
		return errors.New("soft TPM: not booted (Reboot first)")
	}
	if len(d["sha256"]) != sha256.Size {
		return fmt.Errorf("extend PCR %d: no sha256 digest", attest.ManifestPCR)
	}
	t.pcrs[attest.ManifestPCR] = extend(t.pcrs[attest.ManifestPCR], d["sha256"])
	return nil
}
