package manifest

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/secure-systems-lab/go-securesystemslib/dsse"

	"github.com/passage-boot/passage/entropy"
)

// Key files are PEM: the private key as "PRIVATE KEY" (PKCS #8), the public key as
// "PUBLIC KEY" (PKIX), the forms `openssl pkey` reads and writes. The TPM key's public
// part uses the same "PUBLIC KEY" form, so one verifier loader serves both.
const (
	PrivateKeyFile = "passage.key"
	PublicKeyFile  = "passage.pub"
)

// Signer signs the DSSE pre-authentication encoding; it is dsse.Signer, named here so
// the boot stage need not import dsse.
type Signer = dsse.Signer

// Verifier checks a signature over the DSSE pre-authentication encoding.
type Verifier = dsse.Verifier

// KeyID is the identifier written into a DSSE signature: the OpenSSH SHA256 fingerprint
// of the public key ("SHA256:..."), which `ssh-keygen -l` also prints.
func KeyID(pub crypto.PublicKey) (string, error) {
	id, err := dsse.SHA256KeyID(pub)
	if err != nil {
		return "", fmt.Errorf("key id: %w", err)
	}
	return id, nil
}

// Ed25519Signer signs with an ed25519 private key (the `passage.key=` file).
type Ed25519Signer struct {
	key ed25519.PrivateKey
	id  string
}

// NewEd25519Signer wraps key.
func NewEd25519Signer(key ed25519.PrivateKey) (*Ed25519Signer, error) {
	if len(key) != ed25519.PrivateKeySize {
		return nil, fmt.Errorf("ed25519 signer: key is %d bytes, want %d", len(key), ed25519.PrivateKeySize)
	}
	id, err := KeyID(key.Public())
	if err != nil {
		return nil, err
	}
	return &Ed25519Signer{key: key, id: id}, nil
}

// Sign implements dsse.Signer.
func (s *Ed25519Signer) Sign(_ context.Context, data []byte) ([]byte, error) {
	return ed25519.Sign(s.key, data), nil
}

// KeyID implements dsse.Signer.
func (s *Ed25519Signer) KeyID() (string, error) { return s.id, nil }

// Public returns the public key.
func (s *Ed25519Signer) Public() crypto.PublicKey { return s.key.Public() }

// PublicKeyVerifier verifies DSSE signatures made by an ed25519 key or by an ECDSA P-256
// key (the TPM-resident key, whose signatures are ASN.1 DER over SHA-256 of the PAE).
type PublicKeyVerifier struct {
	pub crypto.PublicKey
	id  string
}

// NewVerifier accepts an ed25519.PublicKey or a P-256 *ecdsa.PublicKey.
func NewVerifier(pub crypto.PublicKey) (*PublicKeyVerifier, error) {
	switch k := pub.(type) {
	case ed25519.PublicKey:
		if len(k) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("verifier: ed25519 key is %d bytes, want %d", len(k), ed25519.PublicKeySize)
		}
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() {
			return nil, fmt.Errorf("verifier: ECDSA key on %s, want P-256", k.Curve.Params().Name)
		}
	default:
		return nil, fmt.Errorf("verifier: unsupported public key type %T", pub)
	}
	id, err := KeyID(pub)
	if err != nil {
		return nil, err
	}
	return &PublicKeyVerifier{pub: pub, id: id}, nil
}

// Verify implements dsse.Verifier.
func (v *PublicKeyVerifier) Verify(_ context.Context, data, sig []byte) error {
	switch k := v.pub.(type) {
	case ed25519.PublicKey:
		if !ed25519.Verify(k, data, sig) {
			return errors.New("ed25519: signature does not verify")
		}
	case *ecdsa.PublicKey:
		sum := sha256.Sum256(data)
		if !ecdsa.VerifyASN1(k, sum[:], sig) {
			return errors.New("ecdsa P-256: signature does not verify")
		}
	}
	return nil
}

// KeyID implements dsse.Verifier.
func (v *PublicKeyVerifier) KeyID() (string, error) { return v.id, nil }

// Public implements dsse.Verifier.
func (v *PublicKeyVerifier) Public() crypto.PublicKey { return v.pub }

// GenerateKeyContext is GenerateKey once the kernel's random pool is ready: a private key
// is a secret, and crypto/rand would otherwise block in getrandom(2) without a bound on a
// freshly booted node. ctx bounds the wait; note (may be nil) hears "waiting for the
// kernel's random pool" when it is not ready at once. pool nil is entropy.Kernel.
func GenerateKeyContext(ctx context.Context, dir string, pool entropy.Pool, note func(string)) (privPath, pubPath string, err error) {
	if err := entropy.Wait(ctx, pool, "keygen", note); err != nil {
		return "", "", err
	}
	return GenerateKey(dir)
}

// GenerateKey writes a new ed25519 pair into dir as passage.key (mode 0600) and
// passage.pub, refusing to overwrite an existing private key.
func GenerateKey(dir string) (privPath, pubPath string, err error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return "", "", fmt.Errorf("keygen: %w", err)
	}
	privDER, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return "", "", fmt.Errorf("keygen: %w", err)
	}
	pubPEM, err := MarshalPublicKey(pub)
	if err != nil {
		return "", "", fmt.Errorf("keygen: %w", err)
	}
	privPath = filepath.Join(dir, PrivateKeyFile)
	pubPath = filepath.Join(dir, PublicKeyFile)
	if _, err := os.Stat(privPath); err == nil {
		return "", "", fmt.Errorf("keygen: %s already exists", privPath)
	}
	if err := writeAtomic(dir, PrivateKeyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: privDER}), 0o600); err != nil {
		return "", "", fmt.Errorf("keygen: %w", err)
	}
	if err := WriteAtomic(dir, PublicKeyFile, pubPEM); err != nil {
		return "", "", fmt.Errorf("keygen: %w", err)
	}
	return privPath, pubPath, nil
}

// MarshalPublicKey encodes pub as a PEM "PUBLIC KEY" block.
func MarshalPublicKey(pub crypto.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, fmt.Errorf("public key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), nil
}

// LoadSigner reads an ed25519 private key file written by GenerateKey.
func LoadSigner(path string) (*Ed25519Signer, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("private key %s: %w", path, err)
	}
	return ParseSigner(path, b)
}

// ParseSigner decodes the private key file bytes b (read from path, named in errors).
func ParseSigner(path string, b []byte) (*Ed25519Signer, error) {
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return nil, fmt.Errorf("private key %s: no PEM \"PRIVATE KEY\" block", path)
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("private key %s: %w", path, err)
	}
	priv, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("private key %s: %T, want ed25519", path, k)
	}
	s, err := NewEd25519Signer(priv)
	if err != nil {
		return nil, fmt.Errorf("private key %s: %w", path, err)
	}
	return s, nil
}

// ParsePublicKey decodes a PEM "PUBLIC KEY" block into a verifier.
func ParsePublicKey(b []byte) (*PublicKeyVerifier, error) {
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PUBLIC KEY" {
		return nil, ErrNoPublicKey
	}
	k, err := x509.ParsePKIXPublicKey(blk.Bytes)
	if err != nil {
		return nil, err
	}
	return NewVerifier(k)
}

// ErrNoPublicKey is a file read whole that holds no PEM public key at all (a private
// key, a README): a key directory ignores it, where a damaged key is an error.
var ErrNoPublicKey = errors.New("no PEM \"PUBLIC KEY\" block")

// LoadVerifier reads a public key file (ed25519 from keygen, or P-256 from tpm-pubkey).
// It reads only a regular file of at most MaxKeyFileSize bytes.
func LoadVerifier(path string) (*PublicKeyVerifier, error) {
	b, err := ReadRegular(path, MaxKeyFileSize)
	if err != nil {
		return nil, fmt.Errorf("public key %s: %w", path, err)
	}
	v, err := ParsePublicKey(b)
	if err != nil {
		return nil, fmt.Errorf("public key %s: %w", path, err)
	}
	return v, nil
}
