package attest

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// EKCertIndex is the NV index of the RSA-2048 EK certificate (TCG EK Credential Profile
// 2.0 section 2.2.1.4, low range).
const EKCertIndex tpm2.TPMHandle = 0x01C00002

// akUnique seeds the AK's derivation: with the endorsement seed and AKTemplate it fixes
// the key, so every boot of the TPM recreates the AK enrolment activated, and nothing
// is persisted.
var akUnique = []byte("passage attestation key v1")

// AKTemplate is the attestation key: ECC P-256, ECDSA SHA-256, restricted signing (it
// signs only TPM-generated structures: quotes and certifications, never an outside
// digest that starts with TPM_GENERATED), fixedTPM and fixedParent (it never leaves
// this TPM), created in the endorsement hierarchy so quotes carry the real reset and
// restart counts (Part 1 section 36.7: other hierarchies' are obfuscated).
func AKTemplate() tpm2.TPMTPublic {
	return tpm2.TPMTPublic{
		Type:    tpm2.TPMAlgECC,
		NameAlg: tpm2.TPMAlgSHA256,
		ObjectAttributes: tpm2.TPMAObject{
			FixedTPM:            true,
			FixedParent:         true,
			SensitiveDataOrigin: true,
			UserWithAuth:        true,
			NoDA:                true,
			Restricted:          true,
			SignEncrypt:         true,
		},
		Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
			Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
			Scheme: tpm2.TPMTECCScheme{
				Scheme:  tpm2.TPMAlgECDSA,
				Details: tpm2.NewTPMUAsymScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSigSchemeECDSA{HashAlg: tpm2.TPMAlgSHA256}),
			},
			CurveID: tpm2.TPMECCNistP256,
			KDF:     tpm2.TPMTKDFScheme{Scheme: tpm2.TPMAlgNull},
		}),
		Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
			X: tpm2.TPM2BECCParameter{Buffer: akUnique},
		}),
	}
}

// key is a transient object and its public area.
type key struct {
	h   tpm2.NamedHandle
	pub tpm2.TPMTPublic
}

func createPrimary(t transport.TPM, hier tpm2.TPMHandle, tmpl tpm2.TPMTPublic, what string) (*key, error) {
	rsp, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.AuthHandle{Handle: hier, Auth: tpm2.PasswordAuth(nil)},
		InPublic:      tpm2.New2B(tmpl),
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", what, err)
	}
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		flush(t, rsp.ObjectHandle)
		return nil, fmt.Errorf("create %s: %w", what, err)
	}
	return &key{h: tpm2.NamedHandle{Handle: rsp.ObjectHandle, Name: rsp.Name}, pub: *pub}, nil
}

func flush(t transport.TPM, h tpm2.TPMHandle) {
	tpm2.FlushContext{FlushHandle: h}.Execute(t)
}

// readEKCert reads the EK certificate from NV in chunks the TPM accepts.
func readEKCert(t transport.TPM) ([]byte, error) {
	rp, err := tpm2.NVReadPublic{NVIndex: EKCertIndex}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("EK certificate (NV %#x): %w", uint32(EKCertIndex), err)
	}
	pub, err := rp.NVPublic.Contents()
	if err != nil {
		return nil, fmt.Errorf("EK certificate (NV %#x): %w", uint32(EKCertIndex), err)
	}
	h := tpm2.NamedHandle{Handle: EKCertIndex, Name: rp.NVName}
	var out []byte
	for off := uint16(0); off < pub.DataSize; {
		n := min(pub.DataSize-off, 512)
		rsp, err := tpm2.NVRead{
			AuthHandle: tpm2.AuthHandle{Handle: EKCertIndex, Name: rp.NVName, Auth: tpm2.PasswordAuth(nil)},
			NVIndex:    h, Size: n, Offset: off,
		}.Execute(t)
		if err != nil {
			return nil, fmt.Errorf("EK certificate (NV %#x) at %d: %w", uint32(EKCertIndex), off, err)
		}
		out = append(out, rsp.Data.Buffer...)
		off += n
	}
	return out, nil
}

// EKHandle is where manufacturing persists the RSA EK (TCG TPM v2.0 Provisioning
// Guidance section 7.8); swtpm_setup puts it there too.
const EKHandle tpm2.TPMHandle = 0x81010001

// loadEK uses the persisted EK when it is the TCG template's key, and otherwise creates
// it from the template (the same key: the endorsement seed and the template fix it);
// creating an RSA-2048 primary takes seconds on some discrete TPMs. done flushes what
// loadEK created.
func loadEK(t transport.TPM) (ek *key, done func(), err error) {
	if rp, err := (tpm2.ReadPublic{ObjectHandle: EKHandle}).Execute(t); err == nil {
		if pub, err := rp.OutPublic.Contents(); err == nil {
			got, want := *pub, tpm2.RSAEKTemplate
			got.Unique = want.Unique
			if bytes.Equal(tpm2.Marshal(got), tpm2.Marshal(want)) {
				return &key{h: tpm2.NamedHandle{Handle: EKHandle, Name: rp.Name}, pub: *pub}, func() {}, nil
			}
		}
	}
	ek, err = createPrimary(t, tpm2.TPMRHEndorsement, tpm2.RSAEKTemplate, "EK")
	if err != nil {
		return nil, nil, err
	}
	return ek, func() { flush(t, ek.h.Handle) }, nil
}

// Challenge is the verifier's TPM2_MakeCredential output for the node: only the TPM
// holding the EK can decrypt it, and only for an object named AKName.
type Challenge struct {
	Format         string   `json:"format"` // ChallengeFormat
	AKName         HexBytes `json:"ak_name"`
	CredentialBlob []byte   `json:"credential_blob"`
	Secret         []byte   `json:"secret"`
}

// ChallengeFormat names the challenge file's shape.
const ChallengeFormat = "passage-attest-challenge/1"

// Answer is Activate for a challenge as the control plane sends it (its JSON, the
// enrolment exchange's netboot.Activator): the AK name it was sealed for and the
// credential the TPM recovered. A challenge of another format is refused unanswered.
func Answer(t transport.TPM, challenge []byte) (akName, secret []byte, err error) {
	c, err := ParseChallenge(challenge)
	if err != nil {
		return nil, nil, err
	}
	secret, err = Activate(t, c)
	return c.AKName, secret, err
}

// ParseChallenge reads a challenge (its JSON, as the control plane's 428 carries it) of
// ChallengeFormat.
func ParseChallenge(b []byte) (*Challenge, error) {
	var c Challenge
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("challenge: %w", err)
	}
	if c.Format != ChallengeFormat {
		return nil, fmt.Errorf("challenge format %q, want %q", c.Format, ChallengeFormat)
	}
	return &c, nil
}

// Activate answers a challenge: TPM2_ActivateCredential with the AK as the activated
// object and the EK as the decrypting key, authorised by the EK's policy
// (PolicySecret(TPM_RH_ENDORSEMENT), EK Credential Profile section 2.1.5.1). It returns
// the credential the verifier sealed: proof the AK and the EK are in the same TPM.
func Activate(t transport.TPM, c *Challenge) ([]byte, error) {
	ek, done, err := loadEK(t)
	if err != nil {
		return nil, err
	}
	defer done()
	ak, err := createPrimary(t, tpm2.TPMRHEndorsement, AKTemplate(), "AK")
	if err != nil {
		return nil, err
	}
	defer flush(t, ak.h.Handle)
	policy := func(t transport.TPM, handle tpm2.TPMISHPolicy, nonceTPM tpm2.TPM2BNonce) error {
		_, err := tpm2.PolicySecret{
			AuthHandle:    tpm2.AuthHandle{Handle: tpm2.TPMRHEndorsement, Auth: tpm2.PasswordAuth(nil)},
			PolicySession: handle,
			NonceTPM:      nonceTPM,
		}.Execute(t)
		return err
	}
	rsp, err := tpm2.ActivateCredential{
		ActivateHandle: tpm2.AuthHandle{Handle: ak.h.Handle, Name: ak.h.Name, Auth: tpm2.PasswordAuth(nil)},
		KeyHandle: tpm2.AuthHandle{Handle: ek.h.Handle, Name: ek.h.Name,
			Auth: tpm2.Policy(tpm2.TPMAlgSHA256, 16, policy)},
		CredentialBlob: tpm2.TPM2BIDObject{Buffer: c.CredentialBlob},
		Secret:         tpm2.TPM2BEncryptedSecret{Buffer: c.Secret},
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("activate credential: %w", err)
	}
	return rsp.CertInfo.Buffer, nil
}

// Evidence is what Collect reads besides the TPM: the firmware's event log and
// passage's own.
type Evidence struct {
	// FirmwareLog is the raw TCG event log (FirmwareLogPath), nil when there is none.
	FirmwareLog []byte
	// PassageLog is the manifest's event log file (manifest.EventLogSuffix).
	PassageLog []byte
}

// MaxFirmwareLog bounds the firmware event log read: a PC Client log is tens of
// kilobytes (OVMF's about 30 KiB), a server's with many option ROMs a few hundred.
const MaxFirmwareLog = 4 << 20

// Collect makes the attestation: recreates the EK and AK, reads the EK certificate,
// certifies the signing key (recreated from signingTemplate in the owner hierarchy,
// manifest/tpmkey's key) with the AK, quotes QuotedPCRs with nonce and reads their
// values. Every object it creates is transient and flushed before it returns.
func Collect(t transport.TPM, signingTemplate tpm2.TPMTPublic, nonce []byte, ev Evidence) (*Attestation, error) {
	if len(nonce) == 0 || len(nonce) > 64 {
		return nil, fmt.Errorf("nonce of %d bytes: want 1 to 64", len(nonce))
	}
	cert, err := readEKCert(t)
	if err != nil {
		return nil, err
	}
	ek, done, err := loadEK(t)
	if err != nil {
		return nil, err
	}
	done() // only its public area is needed
	ak, err := createPrimary(t, tpm2.TPMRHEndorsement, AKTemplate(), "AK")
	if err != nil {
		return nil, err
	}
	defer flush(t, ak.h.Handle)
	sk, err := createPrimary(t, tpm2.TPMRHOwner, signingTemplate, "signing key")
	if err != nil {
		return nil, err
	}
	defer flush(t, sk.h.Handle)

	akAuth := tpm2.AuthHandle{Handle: ak.h.Handle, Name: ak.h.Name, Auth: tpm2.PasswordAuth(nil)}
	scheme := tpm2.TPMTSigScheme{
		Scheme:  tpm2.TPMAlgECDSA,
		Details: tpm2.NewTPMUSigScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSchemeHash{HashAlg: tpm2.TPMAlgSHA256}),
	}
	crt, err := tpm2.Certify{
		ObjectHandle:   tpm2.AuthHandle{Handle: sk.h.Handle, Name: sk.h.Name, Auth: tpm2.PasswordAuth(nil)},
		SignHandle:     akAuth,
		QualifyingData: tpm2.TPM2BData{Buffer: nonce},
		InScheme:       scheme,
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("certify signing key: %w", err)
	}
	q, err := tpm2.Quote{
		SignHandle:     akAuth,
		QualifyingData: tpm2.TPM2BData{Buffer: nonce},
		InScheme:       scheme,
		PCRSelect:      selection(),
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("quote: %w", err)
	}
	pcrs, err := readPCRs(t)
	if err != nil {
		return nil, err
	}
	a := &Attestation{
		Format:           Format,
		EKCert:           cert,
		EKPublic:         tpm2.Marshal(ek.pub),
		AKPublic:         tpm2.Marshal(ak.pub),
		SigningKeyPublic: tpm2.Marshal(sk.pub),
		Nonce:            nonce,
		Certify:          Signed{Attest: crt.CertifyInfo.Bytes(), Signature: tpm2.Marshal(crt.Signature)},
		Quote:            Signed{Attest: q.Quoted.Bytes(), Signature: tpm2.Marshal(q.Signature)},
		PCRs:             pcrs,
		FirmwareLog:      ev.FirmwareLog,
		PassageLog:       ev.PassageLog,
	}
	return a, nil
}

func selection() tpm2.TPMLPCRSelection {
	pcrs := make([]uint, len(QuotedPCRs))
	for i, p := range QuotedPCRs {
		pcrs[i] = uint(p)
	}
	return tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{
		{Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(pcrs...)},
	}}
}

// readPCRs reads QuotedPCRs' sha256 values; a TPM returns at most eight digests per
// TPM2_PCR_Read (Part 3 section 22.4), so one PCR at a time.
func readPCRs(t transport.TPM) (map[int]HexBytes, error) {
	out := map[int]HexBytes{}
	for _, p := range QuotedPCRs {
		rsp, err := tpm2.PCRRead{PCRSelectionIn: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{
			{Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(uint(p))},
		}}}.Execute(t)
		if err != nil {
			return nil, fmt.Errorf("read PCR %d: %w", p, err)
		}
		if len(rsp.PCRValues.Digests) != 1 {
			return nil, fmt.Errorf("read PCR %d: %d values returned (is the sha256 bank allocated?)", p, len(rsp.PCRValues.Digests))
		}
		out[p] = rsp.PCRValues.Digests[0].Buffer
	}
	return out, nil
}
