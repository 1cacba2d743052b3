// Package tpmkey signs and measures passage manifests with a TPM 2.0: an ECC P-256
// signing key derived in the owner hierarchy from a fixed template, a PCR the payload
// digest is extended into, and an NV counter index for the generation. *TPM implements
// manifest.Signer, manifest.Measurer and manifest.Counter.
//
// It talks to the TPM through go-tpm's tpm2 ("direct") API; tests drive the same code
// against go-tpm-tools' simulator, the boot path against /dev/tpmrm0 (swtpm under QEMU).
package tpmkey

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/sha256"
	"encoding/asn1"
	"encoding/binary"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"github.com/google/go-tpm/tpm2/transport/linuxtpm"
	"github.com/google/go-tpm/tpm2/transport/linuxudstpm"

	"github.com/passage-boot/passage/manifest"
)

// DefaultDevice is the kernel's resource-managed TPM device: the in-kernel resource
// manager flushes our transient key if we die, and lets other users share the TPM.
const DefaultDevice = "/dev/tpmrm0"

// PCR is the index manifest digests are extended into. The PC Client Platform Firmware
// Profile lets software reset only PCR 16 (debug) and 23 (application) at locality 0, so
// those cannot prove anything; 0-7 belong to firmware. Of 8-15, on passage's boot path
// (iPXE loads the kernel, u-root runs passage, passage switch_roots) the Linux TPM PCR
// Registry assigns: 8 and 9 to GRUB and the kernel's EFI stub (initrd, load options),
// 10 to IMA, 11 to systemd-stub and systemd-pcrphase (which run later, in the real
// root, and predict their own values), 12 and 13 to systemd-stub only when booting a
// unified kernel image (cmdline/credentials and system extensions), 14 to shim's MOK
// lists, 15 to systemd's machine-id and volume keys. PCR 13 is therefore untouched by
// anyone else on this path, and unlike 12 it holds nothing an operator would read as
// the kernel command line.
const PCR = 13

// NVIndex holds the generation counter (TPM_NT_COUNTER). It lies in the range the TCG
// "Registry of Reserved TPM 2.0 Handles and Localities" leaves to the owner
// (0x01000000-0x013FFFFF); the low half is ASCII "PS".
const NVIndex tpm2.TPMHandle = 0x01385053

// keyUnique seeds the primary key derivation: together with the owner seed and the
// template it fixes the key, so the same TPM yields the same key on every boot without
// storing anything, until the owner hierarchy is cleared (TPM2_Clear).
var keyUnique = []byte("passage manifest signing key v1")

// Template is the public template of the signing key: ECDSA P-256 with SHA-256, never
// leaves the TPM (fixedTPM, fixedParent, sensitiveDataOrigin), empty authValue (the
// key only signs what the boot stage hands it; an attacker with the TPM and root can
// sign anyway), noDA so a wrong auth attempt cannot lock out the boot.
func Template() tpm2.TPMTPublic {
	return tpm2.TPMTPublic{
		Type:    tpm2.TPMAlgECC,
		NameAlg: tpm2.TPMAlgSHA256,
		ObjectAttributes: tpm2.TPMAObject{
			FixedTPM:            true,
			FixedParent:         true,
			SensitiveDataOrigin: true,
			UserWithAuth:        true,
			NoDA:                true,
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
			X: tpm2.TPM2BECCParameter{Buffer: keyUnique},
		}),
	}
}

// TPM is an open TPM with the signing key loaded.
type TPM struct {
	t     transport.TPMCloser
	key   tpm2.NamedHandle
	pub   *ecdsa.PublicKey
	id    string
	banks []string
}

// Open opens the TPM at path and loads the signing key: a character device
// (DefaultDevice on a node) or, for an operator testing against swtpm on a workstation,
// the Unix socket of `swtpm socket --server type=unixio,path=...`.
func Open(path string) (*TPM, error) {
	open := linuxtpm.Open
	if fi, err := os.Stat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		open = linuxudstpm.Open
	}
	t, err := open(path)
	if err != nil {
		return nil, fmt.Errorf("tpm %s: %w", path, err)
	}
	k, err := New(t)
	if err != nil {
		t.Close()
		return nil, fmt.Errorf("tpm %s: %w", path, err)
	}
	return k, nil
}

// ForBoot opens root's dev/tpmrm0 for the boot stage: the signer and the measurer are
// the same open TPM, kept open for the rest of the boot.
func ForBoot(root string) (manifest.Signer, manifest.Measurer, error) {
	k, err := Open(filepath.Join(root, DefaultDevice))
	if err != nil {
		return nil, nil, err
	}
	return k, k, nil
}

// New loads the signing key on an already open transport (a simulator in tests). Close
// flushes the key and closes t.
func New(t transport.TPMCloser) (*TPM, error) {
	rsp, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.TPMRHOwner,
		InPublic:      tpm2.New2B(Template()),
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("create primary signing key: %w", err)
	}
	k := &TPM{t: t, key: tpm2.NamedHandle{Handle: rsp.ObjectHandle, Name: rsp.Name}}
	if err := k.init(rsp); err != nil {
		tpm2.FlushContext{FlushHandle: rsp.ObjectHandle}.Execute(t)
		return nil, err
	}
	return k, nil
}

func (k *TPM) init(rsp *tpm2.CreatePrimaryResponse) error {
	pubArea, err := rsp.OutPublic.Contents()
	if err != nil {
		return fmt.Errorf("signing key public area: %w", err)
	}
	pub, err := tpm2.Pub(*pubArea)
	if err != nil {
		return fmt.Errorf("signing key public area: %w", err)
	}
	ec, ok := pub.(*ecdsa.PublicKey)
	if !ok {
		return fmt.Errorf("signing key is %T, want ECDSA", pub)
	}
	k.pub = ec
	if k.id, err = manifest.KeyID(ec); err != nil {
		return err
	}
	k.banks, err = pcrBanks(k.t, PCR)
	return err
}

// Close flushes the transient key and closes the transport.
func (k *TPM) Close() error {
	_, ferr := tpm2.FlushContext{FlushHandle: k.key.Handle}.Execute(k.t)
	cerr := k.t.Close()
	return errors.Join(ferr, cerr)
}

// Transport is the open TPM, for the attestation made after the manifest (package
// attest) on the same connection.
func (k *TPM) Transport() transport.TPM { return k.t }

// Random returns n bytes from the TPM's random number generator (TPM2_GetRandom, TPM 2.0
// Part 3 section 16.1), asked in as many commands as the TPM's answer size needs: each
// answer holds at most its largest digest's size. It draws nothing from the kernel's
// pool, so it does not wait for it.
func (k *TPM) Random(n int) ([]byte, error) {
	out := make([]byte, 0, n)
	for len(out) < n {
		rsp, err := tpm2.GetRandom{BytesRequested: uint16(min(n-len(out), 64))}.Execute(k.t)
		if err != nil {
			return nil, fmt.Errorf("tpm: get random: %w", err)
		}
		if len(rsp.RandomBytes.Buffer) == 0 {
			return nil, errors.New("tpm: get random: the TPM answered no bytes")
		}
		out = append(out, rsp.RandomBytes.Buffer...)
	}
	return out[:n], nil
}

// Public returns the signing key's public part.
func (k *TPM) Public() crypto.PublicKey { return k.pub }

// PublicKeyPEM is what `passage tpm-pubkey` prints and `passage verify --tpm-pub` reads.
func (k *TPM) PublicKeyPEM() ([]byte, error) { return manifest.MarshalPublicKey(k.pub) }

// KeyID implements dsse.Signer.
func (k *TPM) KeyID() (string, error) { return k.id, nil }

// Sign implements dsse.Signer: data is the DSSE pre-authentication encoding; the TPM
// signs its SHA-256 and the signature is returned ASN.1 DER, as ecdsa.VerifyASN1 reads.
func (k *TPM) Sign(_ context.Context, data []byte) ([]byte, error) {
	sum := sha256.Sum256(data)
	rsp, err := tpm2.Sign{
		KeyHandle: tpm2.AuthHandle{Handle: k.key.Handle, Name: k.key.Name, Auth: tpm2.PasswordAuth(nil)},
		Digest:    tpm2.TPM2BDigest{Buffer: sum[:]},
		InScheme: tpm2.TPMTSigScheme{
			Scheme:  tpm2.TPMAlgECDSA,
			Details: tpm2.NewTPMUSigScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSchemeHash{HashAlg: tpm2.TPMAlgSHA256}),
		},
		// An unrestricted key may sign any digest: the NULL ticket says "not produced by
		// TPM2_Hash", which only restricted keys care about.
		Validation: tpm2.TPMTTKHashCheck{Tag: tpm2.TPMSTHashCheck, Hierarchy: tpm2.TPMRHNull},
	}.Execute(k.t)
	if err != nil {
		return nil, fmt.Errorf("tpm sign: %w", err)
	}
	sig, err := rsp.Signature.Signature.ECDSA()
	if err != nil {
		return nil, fmt.Errorf("tpm sign: %w", err)
	}
	der, err := asn1.Marshal(struct{ R, S *big.Int }{
		new(big.Int).SetBytes(sig.SignatureR.Buffer),
		new(big.Int).SetBytes(sig.SignatureS.Buffer),
	})
	if err != nil {
		return nil, fmt.Errorf("tpm sign: %w", err)
	}
	return der, nil
}

var bankAlgs = map[tpm2.TPMAlgID]string{
	tpm2.TPMAlgSHA1:   "sha1",
	tpm2.TPMAlgSHA256: "sha256",
	tpm2.TPMAlgSHA384: "sha384",
	tpm2.TPMAlgSHA512: "sha512",
}

func algOf(bank string) (tpm2.TPMAlgID, bool) {
	for a, n := range bankAlgs {
		if n == bank {
			return a, true
		}
	}
	return 0, false
}

// pcrBanks lists the allocated banks that include pcr. Every one gets extended: a bank
// left alone could be set later to any value by whoever extends it first.
func pcrBanks(t transport.TPM, pcr int) ([]string, error) {
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapPCRs, PropertyCount: 1}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("pcr banks: %w", err)
	}
	sel, err := rsp.CapabilityData.Data.AssignedPCR()
	if err != nil {
		return nil, fmt.Errorf("pcr banks: %w", err)
	}
	var banks []string
	for _, s := range sel.PCRSelections {
		name, known := bankAlgs[s.Hash]
		if known && pcr/8 < len(s.PCRSelect) && s.PCRSelect[pcr/8]&(1<<(pcr%8)) != 0 {
			banks = append(banks, name)
		}
	}
	if len(banks) == 0 {
		return nil, fmt.Errorf("pcr banks: no allocated bank holds PCR %d", pcr)
	}
	return banks, nil
}

// PCR implements manifest.Measurer.
func (k *TPM) PCR() int { return PCR }

// Banks implements manifest.Measurer.
func (k *TPM) Banks() []string { return append([]string(nil), k.banks...) }

// Extend implements manifest.Measurer: one TPM2_PCR_Extend carrying every bank's digest.
func (k *TPM) Extend(digests map[string][]byte) error {
	var vals tpm2.TPMLDigestValues
	for _, b := range k.banks {
		d, ok := digests[b]
		if !ok {
			return fmt.Errorf("pcr %d: no %s digest", PCR, b)
		}
		alg, _ := algOf(b)
		vals.Digests = append(vals.Digests, tpm2.TPMTHA{HashAlg: alg, Digest: d})
	}
	_, err := tpm2.PCRExtend{
		PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(PCR), Auth: tpm2.PasswordAuth(nil)},
		Digests:   vals,
	}.Execute(k.t)
	if err != nil {
		return fmt.Errorf("pcr %d: extend: %w", PCR, err)
	}
	return nil
}

// ReadPCR returns PCR's value in bank ("sha256"), what a quote would attest.
func (k *TPM) ReadPCR(bank string) ([]byte, error) {
	alg, ok := algOf(bank)
	if !ok {
		return nil, fmt.Errorf("pcr %d: unknown bank %q", PCR, bank)
	}
	rsp, err := tpm2.PCRRead{PCRSelectionIn: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{
		{Hash: alg, PCRSelect: tpm2.PCClientCompatible.PCRs(PCR)},
	}}}.Execute(k.t)
	if err != nil {
		return nil, fmt.Errorf("pcr %d: read %s: %w", PCR, bank, err)
	}
	if len(rsp.PCRValues.Digests) != 1 {
		return nil, fmt.Errorf("pcr %d: read %s: %d values returned", PCR, bank, len(rsp.PCRValues.Digests))
	}
	return rsp.PCRValues.Digests[0].Buffer, nil
}

// Source implements manifest.Counter.
func (k *TPM) Source() manifest.GenerationSource { return manifest.GenerationTPMNV }

// Next implements manifest.Counter with TPM2_NV_Increment on NVIndex, defining the index
// on first use. The TPM guarantees a counter never goes backwards, even across a
// redefinition (a new counter starts at the highest value any counter has held), so a
// replayed old manifest always carries a lower generation.
func (k *TPM) Next() (uint64, error) {
	owner := tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)}
	name, err := k.nvName()
	if err != nil {
		if !errors.Is(err, tpm2.TPMRCHandle) {
			return 0, fmt.Errorf("nv %#x: %w", uint32(NVIndex), err)
		}
		_, err := tpm2.NVDefineSpace{
			AuthHandle: owner,
			PublicInfo: tpm2.New2B(tpm2.TPMSNVPublic{
				NVIndex: NVIndex,
				NameAlg: tpm2.TPMAlgSHA256,
				Attributes: tpm2.TPMANV{
					OwnerWrite: true,
					OwnerRead:  true,
					NT:         tpm2.TPMNTCounter,
					NoDA:       true,
				},
				DataSize: 8,
			}),
		}.Execute(k.t)
		if err != nil {
			return 0, fmt.Errorf("nv %#x: define counter: %w", uint32(NVIndex), err)
		}
		if name, err = k.nvName(); err != nil {
			return 0, fmt.Errorf("nv %#x: %w", uint32(NVIndex), err)
		}
	}
	if _, err := (tpm2.NVIncrement{AuthHandle: owner, NVIndex: tpm2.NamedHandle{Handle: NVIndex, Name: name}}).Execute(k.t); err != nil {
		return 0, fmt.Errorf("nv %#x: increment: %w", uint32(NVIndex), err)
	}
	// Incrementing sets TPMA_NV_WRITTEN, which changes the index's Name.
	if name, err = k.nvName(); err != nil {
		return 0, fmt.Errorf("nv %#x: %w", uint32(NVIndex), err)
	}
	rsp, err := tpm2.NVRead{AuthHandle: owner, NVIndex: tpm2.NamedHandle{Handle: NVIndex, Name: name}, Size: 8}.Execute(k.t)
	if err != nil {
		return 0, fmt.Errorf("nv %#x: read: %w", uint32(NVIndex), err)
	}
	if len(rsp.Data.Buffer) != 8 {
		return 0, fmt.Errorf("nv %#x: read %d bytes, want 8", uint32(NVIndex), len(rsp.Data.Buffer))
	}
	return binary.BigEndian.Uint64(rsp.Data.Buffer), nil
}

func (k *TPM) nvName() (tpm2.TPM2BName, error) {
	rsp, err := tpm2.NVReadPublic{NVIndex: NVIndex}.Execute(k.t)
	if err != nil {
		return tpm2.TPM2BName{}, err
	}
	pub, err := rsp.NVPublic.Contents()
	if err != nil {
		return tpm2.TPM2BName{}, err
	}
	if pub.Attributes.NT != tpm2.TPMNTCounter {
		return tpm2.TPM2BName{}, fmt.Errorf("index exists but is not a counter (type %d)", pub.Attributes.NT)
	}
	return rsp.NVName, nil
}
