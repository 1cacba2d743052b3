package kubelet

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/entropy/entropytest"
)

// TestKeyFromSeed: FIPS 186-5 A.2.1's d = (c mod (n-1)) + 1 at its edges: c = 0 and
// c = n-1 give d = 1 (the base point), c = n gives d = 2; the same seed gives the same
// key; a short seed is refused.
func TestKeyFromSeed(t *testing.T) {
	curve := elliptic.P256()
	n := curve.Params().N
	seedOf := func(c *big.Int) []byte { return c.FillBytes(make([]byte, SeedSize)) }
	for _, tc := range []struct {
		c *big.Int
		d int64
	}{
		{big.NewInt(0), 1},
		{new(big.Int).Sub(n, big.NewInt(1)), 1},
		{n, 2},
		{new(big.Int).Add(n, big.NewInt(1)), 3},
	} {
		k, err := KeyFromSeed(seedOf(tc.c))
		if err != nil {
			t.Fatal(err)
		}
		want, err := ecdsa.ParseRawPrivateKey(curve, big.NewInt(tc.d).FillBytes(make([]byte, 32)))
		if err != nil {
			t.Fatal(err)
		}
		if !k.Equal(want) {
			t.Errorf("c = %v: key is not d = %d", tc.c, tc.d)
		}
	}
	seed := bytes.Repeat([]byte{0xff}, SeedSize)
	a, _ := KeyFromSeed(seed)
	b, _ := KeyFromSeed(seed)
	if !a.Equal(b) {
		t.Error("one seed, two keys")
	}
	if _, err := KeyFromSeed(seed[:SeedSize-1]); err == nil {
		t.Error("a short seed was taken")
	}
}

// TestMake: the key is written where the kubelet loads it, mode 0600 in a directory of
// mode 0700, as PEM "EC PRIVATE KEY" (what the kubelet's keyutil reads), and its digest
// is sha256 of its SubjectPublicKeyInfo; with the process's random sources blocked it
// reads none of them. Two keys made from the same TPM bytes differ when the kernel's
// pool answers (its bytes are mixed in). A TPM that fails makes no key.
func TestMake(t *testing.T) {
	blk := entropytest.Block(t)
	dir := filepath.Join(t.TempDir(), "kubelet")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tpm := func(n int) ([]byte, error) { return bytes.Repeat([]byte{7}, n), nil }
	digest, err := Make(dir, tpm)
	if err != nil {
		t.Fatal(err)
	}
	if n := blk.Calls(); n != 0 {
		t.Errorf("%d reads from a blocked random source", n)
	}
	for p, want := range map[string]os.FileMode{dir: 0o700 | os.ModeDir, filepath.Join(dir, KeyFile): 0o600} {
		if fi, err := os.Stat(p); err != nil || fi.Mode() != want {
			t.Errorf("%s: %v %v, want %v", p, fi.Mode(), err, want)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, KeyFile))
	if err != nil {
		t.Fatal(err)
	}
	p, _ := pem.Decode(b)
	if p == nil || p.Type != "EC PRIVATE KEY" {
		t.Fatalf("not PEM EC PRIVATE KEY:\n%s", b)
	}
	key, err := x509.ParseECPrivateKey(p.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	spki, _ := x509.MarshalPKIXPublicKey(key.Public())
	if want := DigestSPKI(spki); digest != want || !strings.HasPrefix(digest, "sha256:") || len(digest) != len("sha256:")+64 {
		t.Errorf("digest %q, want %q", digest, want)
	}
	if kernelBytes(SeedSize) != nil {
		again, err := Make(dir, tpm)
		if err != nil {
			t.Fatal(err)
		}
		if again == digest {
			t.Error("the kernel's bytes were not mixed in: the same key from the same TPM bytes")
		}
	}
	if _, err := Make(dir, func(int) ([]byte, error) { return nil, errors.New("tpm: no answer") }); err == nil || !strings.Contains(err.Error(), "tpm: no answer") {
		t.Errorf("a failing TPM: %v", err)
	}
	if _, err := Make(dir, func(n int) ([]byte, error) { return make([]byte, n-1), nil }); err == nil {
		t.Error("a TPM answering short: a key was made")
	}
}
