// Package kubelet makes, during the boot, the key the node's kubelet joins the cluster
// with, and names it the way the manifest and passage-control do.
//
// The key is an ECDSA P-256 key made in the manifest stage, before the manifest is
// signed: the manifest carries its digest (node.kubelet_key), so the attestation that
// vouches for the manifest vouches for the key. It is written where the kubelet's TLS
// bootstrap takes it, CertDir/KeyFile: with --cert-dir=CertDir the kubelet loads that
// file with keyutil.LoadOrGenerateKeyFile before it requests its client certificate
// (k8s.io/kubernetes v1.37 pkg/kubelet/certificate/bootstrap, tmpPrivateKeyFile), and
// makes no key of its own. /run is the tmpfs passage's switch_root hands to the real
// root, so the key exists for this boot only. passage-control approves the kubelet's
// certificate request only when its key is the one a verified boot attested
// (kube/control, Approver).
package kubelet

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"

	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/manifest"
)

const (
	// CertDir is the kubelet's --cert-dir: beneath /run/passage, on the tmpfs the real
	// root is handed.
	CertDir = "/run/passage/kubelet"
	// KeyFile is the name the kubelet's bootstrap loads its key from before its
	// certificate is issued (tmpPrivateKeyFile); it renames nothing, and removes the
	// file once its certificate is stored beside it.
	KeyFile = "kubelet-client.key.tmp"
)

// SeedSize is the randomness a key is derived from: 64 bytes, over the 320 bits FIPS
// 186-5 Appendix A.2.1 asks of a P-256 key (the order's 256 bits and 64 more).
const SeedSize = 64

// seedLabel separates this use of the TPM's bytes from any other.
const seedLabel = "passage kubelet client key v1\x00"

// Digest is what the manifest's node.kubelet_key and a PassageNode's status.kubeletKey
// hold for pub: "sha256:" and the hex of SHA-256 over its SubjectPublicKeyInfo (DER),
// as x509 writes it and a certificate request carries it.
func Digest(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", fmt.Errorf("kubelet key: %w", err)
	}
	return DigestSPKI(der), nil
}

// DigestSPKI is Digest of a SubjectPublicKeyInfo already encoded (a certificate
// request's RawSubjectPublicKeyInfo).
func DigestSPKI(der []byte) string {
	sum := sha256.Sum256(der)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// p256N1 is the order of P-256's base point less one.
var p256N1 = new(big.Int).Sub(elliptic.P256().Params().N, big.NewInt(1))

// KeyFromSeed derives the P-256 private key of seed (at least SeedSize bytes), as FIPS
// 186-5 Appendix A.2.1 ("key pair generation using extra random bits") does: c is the
// seed read as a big-endian integer and d = (c mod (n-1)) + 1, so d is in [1, n-1] with
// a bias below 2^-64. The same seed gives the same key; no other randomness is read.
func KeyFromSeed(seed []byte) (*ecdsa.PrivateKey, error) {
	if len(seed) < SeedSize {
		return nil, fmt.Errorf("kubelet key: a seed of %d bytes, want %d", len(seed), SeedSize)
	}
	d := new(big.Int).SetBytes(seed)
	d.Mod(d, p256N1).Add(d, big.NewInt(1))
	k, err := ecdsa.ParseRawPrivateKey(elliptic.P256(), d.FillBytes(make([]byte, 32)))
	if err != nil {
		return nil, fmt.Errorf("kubelet key: %w", err)
	}
	return k, nil
}

// Seed mixes tpm, the TPM's random bytes, with whatever the kernel's pool gives without
// waiting (getrandom with GRND_INSECURE: before the pool is initialised, its best
// effort; after, what any read gives) through SHA-512. The TPM's generator is what the
// boot counts on: its EK, AK and signing key are the TPM's own, and so is this key's
// seed. The kernel's bytes are added so that a weak TPM generator alone does not make a
// guessable key once the pool is ready; they are never waited for.
func Seed(tpm []byte) ([]byte, error) {
	if len(tpm) < SeedSize {
		return nil, fmt.Errorf("kubelet key: %d bytes from the TPM, want %d", len(tpm), SeedSize)
	}
	h := sha512.New()
	h.Write([]byte(seedLabel))
	h.Write(tpm)
	h.Write(kernelBytes(SeedSize))
	return h.Sum(nil), nil
}

// kernelBytes reads n bytes from the kernel without blocking, or returns none: Linux 5.6
// and later answer GRND_INSECURE at once; an older kernel refuses it (EINVAL) and is
// asked with GRND_NONBLOCK, which fails with EAGAIN until its pool is ready.
func kernelBytes(n int) []byte {
	b := make([]byte, n)
	for _, flag := range []int{unix.GRND_INSECURE, unix.GRND_NONBLOCK} {
		got, err := unix.Getrandom(b, flag)
		if err == nil && got == n {
			return b
		}
		if !errors.Is(err, unix.EINVAL) {
			return nil
		}
	}
	return nil
}

// PEM is key as the kubelet's keyutil writes and reads it: "EC PRIVATE KEY", SEC 1 DER.
func PEM(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("kubelet key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), nil
}

// New makes a kubelet key in memory from SeedSize bytes of random (the TPM's,
// tpmkey.TPM.Random), mixed with the kernel's (Seed), and returns it with its Digest.
// Make is New written where the kubelet's bootstrap loads it; a renewal on the running
// host (kube/dra/plugin, KubeletCert) keeps the key in memory until its certificate is
// issued.
func New(random func(n int) ([]byte, error)) (*ecdsa.PrivateKey, string, error) {
	tpm, err := random(SeedSize)
	if err != nil {
		return nil, "", fmt.Errorf("kubelet key: %w", err)
	}
	seed, err := Seed(tpm)
	if err != nil {
		return nil, "", err
	}
	key, err := KeyFromSeed(seed)
	if err != nil {
		return nil, "", err
	}
	digest, err := Digest(key.Public())
	if err != nil {
		return nil, "", err
	}
	return key, digest, nil
}

// Make makes this boot's kubelet key (New) and writes it to dir/KeyFile, mode 0600 in a
// directory of mode 0700, atomically (manifest.WriteAtomicPrivate). It returns the
// key's Digest, which the manifest signs. dir is CertDir beneath the boot's root.
func Make(dir string, random func(n int) ([]byte, error)) (string, error) {
	key, digest, err := New(random)
	if err != nil {
		return "", err
	}
	b, err := PEM(key)
	if err != nil {
		return "", err
	}
	// Only root reads the key: the kubelet, which runs as root.
	if err := os.Chmod(dir, 0o700); err != nil {
		return "", fmt.Errorf("kubelet key: %w", err)
	}
	if err := manifest.WriteAtomicPrivate(dir, KeyFile, b); err != nil {
		return "", fmt.Errorf("kubelet key: %w", err)
	}
	return digest, nil
}
