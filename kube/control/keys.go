package control

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"
)

// Keys are the exchange's two secrets, derived from one key every replica holds (a
// Secret mounted in each): a nonce is checked by its MAC, and an enrolment's state
// comes back sealed, so neither is stored and any replica serves any step. A stranger
// can ask for both, as often as it likes, and it costs the API nothing.
type Keys struct {
	nonce []byte
	seal  cipher.AEAD
}

// MinKey is the shortest shared key taken: 256 bits.
const MinKey = 32

// MaxKeyFile bounds what is read of the key file.
const MaxKeyFile = 4 << 10

// NewKeys derives the keys from secret (at least MinKey bytes).
func NewKeys(secret []byte) (*Keys, error) {
	if len(secret) < MinKey {
		return nil, fmt.Errorf("exchange key: %d bytes, want at least %d", len(secret), MinKey)
	}
	derive := func(label string) []byte {
		m := hmac.New(sha256.New, secret)
		m.Write([]byte("passage-control/" + label))
		return m.Sum(nil)
	}
	block, err := aes.NewCipher(derive("enrolment state"))
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &Keys{nonce: derive("nonce"), seal: aead}, nil
}

// ReadKeys reads the shared key file (the Secret's key, raw bytes).
func ReadKeys(path string) (*Keys, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("exchange key: %w", err)
	}
	defer f.Close()
	b := make([]byte, MaxKeyFile+1)
	n, err := f.Read(b)
	if err != nil {
		return nil, fmt.Errorf("exchange key %s: %w", path, err)
	}
	if n > MaxKeyFile {
		return nil, fmt.Errorf("exchange key %s: over %d bytes", path, MaxKeyFile)
	}
	k, err := NewKeys(b[:n])
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, path)
	}
	return k, nil
}

// A nonce is the time it was issued (Unix nanoseconds, 8 bytes big-endian), 16 random
// bytes, and the first 16 bytes of HMAC-SHA256 over both under the nonce key: 40 bytes,
// within a quote's qualifying data (at most 64).
const (
	NonceSize = 40
	nonceMAC  = 24
)

// Nonce issues a nonce at now.
func (k *Keys) Nonce(now time.Time) ([]byte, error) {
	n := make([]byte, NonceSize)
	binary.BigEndian.PutUint64(n, uint64(now.UnixNano()))
	if _, err := rand.Read(n[8:nonceMAC]); err != nil {
		return nil, err
	}
	copy(n[nonceMAC:], k.mac(n[:nonceMAC]))
	return n, nil
}

func (k *Keys) mac(b []byte) []byte {
	m := hmac.New(sha256.New, k.nonce)
	m.Write(b)
	return m.Sum(nil)[:NonceSize-nonceMAC]
}

// NonceSkew is how far ahead of a replica's clock another replica's nonce may be.
const NonceSkew = time.Minute

// CheckNonce says when n was issued, if a replica holding these keys issued it no more
// than ttl before now. Whether it is spent is the record's to say (NodeStatus.Nonce).
func (k *Keys) CheckNonce(n []byte, now time.Time, ttl time.Duration) (time.Time, error) {
	if len(n) != NonceSize {
		return time.Time{}, &NonceRefusal{Reason: fmt.Sprintf("%d bytes, not a nonce this control plane issues (%d)", len(n), NonceSize)}
	}
	if subtle.ConstantTimeCompare(n[nonceMAC:], k.mac(n[:nonceMAC])) != 1 {
		return time.Time{}, &NonceRefusal{Reason: "never issued (its MAC is not this control plane's)"}
	}
	issued := time.Unix(0, int64(binary.BigEndian.Uint64(n)))
	switch age := now.Sub(issued); {
	case age > ttl:
		return issued, &NonceRefusal{Reason: fmt.Sprintf("issued %s ago, accepted for %s: fetch a new one", age.Round(time.Second), ttl)}
	case age < -NonceSkew:
		return issued, &NonceRefusal{Reason: fmt.Sprintf("issued %s in the future (replica clocks apart?)", (-age).Round(time.Second))}
	}
	return issued, nil
}

// NonceRefusal is a nonce not taken: never issued, expired or spent. Anyone can send
// one; it says nothing about a node.
type NonceRefusal struct{ Reason string }

func (e *NonceRefusal) Error() string { return "nonce: " + e.Reason }

// sealed is what a challenge carries back to the control plane.
type sealed struct {
	Format  string    `json:"format"`
	Expires time.Time `json:"expires"`
	Body    any       `json:"body"`
}

// Seal encrypts and authenticates v (JSON) for use until expires, bound to format (a
// sealed value of one kind is not taken as another).
func (k *Keys) Seal(format string, v any, expires time.Time) ([]byte, error) {
	pt, err := json.Marshal(sealed{Format: format, Expires: expires.UTC(), Body: v})
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, k.seal.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	return k.seal.Seal(nonce, nonce, pt, []byte(format)), nil
}

// ErrSealed is a sealed value that was not sealed by these keys for its format, was
// changed, or has expired.
var ErrSealed = errors.New("sealed state")

// Open checks and decrypts a value Seal made for format into v.
func (k *Keys) Open(format string, b []byte, now time.Time, v any) error {
	ns := k.seal.NonceSize()
	if len(b) < ns+k.seal.Overhead() {
		return fmt.Errorf("%w: %d bytes, too short", ErrSealed, len(b))
	}
	pt, err := k.seal.Open(nil, b[:ns], b[ns:], []byte(format))
	if err != nil {
		return fmt.Errorf("%w: not this control plane's, or changed", ErrSealed)
	}
	s := sealed{Body: v}
	if err := json.Unmarshal(pt, &s); err != nil {
		return fmt.Errorf("%w: %v", ErrSealed, err)
	}
	if s.Format != format {
		return fmt.Errorf("%w: format %q, want %q", ErrSealed, s.Format, format)
	}
	if now.After(s.Expires) {
		return fmt.Errorf("%w: expired %s ago; start again", ErrSealed, now.Sub(s.Expires).Round(time.Second))
	}
	return nil
}
