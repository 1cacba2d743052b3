package attest

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// NonceStoreFormat names the nonce store file's shape.
const NonceStoreFormat = "passage-nonces/1"

// NonceSize is the size of a nonce the verifier issues: a quote's qualifying data takes
// up to 64 bytes; 32 random bytes are never issued twice.
const NonceSize = 32

// DefaultNonceTTL is how long an issued nonce is accepted: a boot fetches it just before
// it quotes and publishes the attestation right after, within a minute.
const DefaultNonceTTL = 15 * time.Minute

// NonceStore is the verifier's record of the nonces it issued and of those already used,
// one JSON file (conventionally nonces.json beside the node records), replaced
// atomically and under an exclusive lock (Path + ".lock") so a control plane issuing
// nonces and a verify consuming them can run at once. An attestation is fresh when its
// nonce is in the file as issued within TTL and not yet used: the same attestation shown
// twice, or one made for a nonce nobody issued, is refused naming the nonce. Entries
// older than TTL are dropped on every write: an expired nonce is refused as never issued.
type NonceStore struct {
	Path string
	TTL  time.Duration // 0: DefaultNonceTTL
	Now  func() time.Time
}

type nonceFile struct {
	Format string               `json:"format"`
	Issued map[string]time.Time `json:"issued"` // hex nonce -> when issued
	Used   map[string]time.Time `json:"used"`   // hex nonce -> when used
}

func (s *NonceStore) now() time.Time {
	if s.Now != nil {
		return s.Now()
	}
	return time.Now()
}

func (s *NonceStore) ttl() time.Duration {
	if s.TTL > 0 {
		return s.TTL
	}
	return DefaultNonceTTL
}

// update runs f on the store's contents under the lock and writes back what f left.
func (s *NonceStore) update(f func(n *nonceFile) error) error {
	lock, err := os.OpenFile(s.Path+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("nonce store: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("nonce store %s: lock: %w", s.Path, err)
	}
	n := nonceFile{Format: NonceStoreFormat, Issued: map[string]time.Time{}, Used: map[string]time.Time{}}
	b, err := manifest.ReadRegular(s.Path, MaxFile)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return fmt.Errorf("nonce store: %w", err)
	default:
		var got nonceFile
		if err := json.Unmarshal(b, &got); err != nil || got.Format != NonceStoreFormat || got.Issued == nil || got.Used == nil {
			return fmt.Errorf("nonce store %s: not a %s file (%v)", s.Path, NonceStoreFormat, err)
		}
		n = got
	}
	if err := f(&n); err != nil {
		return err
	}
	cut := s.now().Add(-s.ttl())
	for _, m := range []map[string]time.Time{n.Issued, n.Used} {
		for k, t := range m {
			if t.Before(cut) {
				delete(m, k)
			}
		}
	}
	out, err := json.MarshalIndent(&n, "", "  ")
	if err != nil {
		return err
	}
	return manifest.WriteAtomic(filepath.Dir(s.Path), filepath.Base(s.Path), append(out, '\n'))
}

// Issue makes a fresh nonce and records it as issued.
func (s *NonceStore) Issue() ([]byte, error) {
	nonce := make([]byte, NonceSize)
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	err := s.update(func(n *nonceFile) error {
		n.Issued[hex.EncodeToString(nonce)] = s.now().UTC()
		return nil
	})
	if err != nil {
		return nil, err
	}
	return nonce, nil
}

// Use accepts nonce once: it must have been issued within TTL and not used; it is then
// recorded as used, whatever the rest of the verification says (a nonce is good for one
// showing).
func (s *NonceStore) Use(nonce []byte) error {
	h := hex.EncodeToString(nonce)
	var refusal error
	err := s.update(func(n *nonceFile) error {
		issued, ok := n.Issued[h]
		switch _, used := n.Used[h]; {
		case used:
			refusal = refuse("nonce", "%s was already used by another attestation (a replay)", h)
		case !ok:
			refusal = refuse("nonce", "%s was never issued by this verifier (or expired: nonces live %s)", h, s.ttl())
		case s.now().Sub(issued) > s.ttl():
			refusal = refuse("nonce", "%s was issued %s ago, over %s", h, s.now().Sub(issued).Round(time.Second), s.ttl())
		default:
			delete(n.Issued, h)
			n.Used[h] = s.now().UTC()
		}
		return nil
	})
	if err != nil {
		return err
	}
	return refusal
}

// NonceType is the media type a boot asks passage.url for (Accept) and the control plane
// answers with: the nonce in hex.
const NonceType = "application/vnd.passage.nonce"

// NonceHandler is a control plane's nonce endpoint: a GET issues a nonce from s and
// answers it in hex (NonceType). passage.url serves it beside the POSTs of manifests.
func NonceHandler(s *NonceStore) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			http.Error(w, "GET a nonce", http.StatusMethodNotAllowed)
			return
		}
		n, err := s.Issue()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", NonceType)
		w.Header().Set("Cache-Control", "no-store")
		fmt.Fprintln(w, hex.EncodeToString(n))
	})
}
