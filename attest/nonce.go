package attest

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// NonceStoreFormat names the nonce store file's shape: its first line.
const NonceStoreFormat = "passage-nonces/2"

// NonceSize is the size of a nonce the verifier issues: a quote's qualifying data takes
// up to 64 bytes; 32 random bytes are never issued twice.
const NonceSize = 32

// DefaultNonceTTL is how long an issued nonce is accepted: a boot fetches it just before
// it quotes and publishes the attestation right after, within a minute.
const DefaultNonceTTL = 15 * time.Minute

// NonceClockSkew is how far ahead of the store's clock an entry's time may be: the
// processes sharing a store share a host clock, so only a step of that clock moves it.
// An issued nonce dated further ahead (issued while the clock ran ahead) is refused and
// pruned: with no bound it would live until the clock caught up, hours later.
const NonceClockSkew = 10 * time.Second

// The store's default bounds (NonceStore's fields, when zero).
const (
	// DefaultMaxOutstanding bounds the nonces issued and neither used nor expired: GETs
	// are unauthenticated, so a flood fills the store to this and no further, and the
	// file and every operation stay small.
	DefaultMaxOutstanding = 4096
	// DefaultMaxWaiting bounds the Issue calls waiting for the store's lock.
	DefaultMaxWaiting = 32
	// DefaultIssueWait bounds how long an Issue waits for the lock.
	DefaultIssueWait = 2 * time.Second
	// DefaultUseWait bounds how long a Use waits for the lock.
	DefaultUseWait = time.Minute
)

// maxNonceFile bounds the store file read back. Compaction keeps it near the live
// entries (about 90 bytes each); one larger was not written by a store and is set aside.
const maxNonceFile = MaxFile

// compactSlack is how many lines beyond twice the live entries the file may hold before
// it is rewritten with the live entries only.
const compactSlack = 1024

// ErrFull is a store holding its most outstanding nonces: Issue refuses until one is
// used or expires (NonceHandler: 503 with Retry-After). Use is unaffected.
var ErrFull = errors.New("full: the most nonces outstanding")

// NonceStore is the verifier's record of the nonces it issued and of those already used,
// one file (conventionally nonces.json beside the node records) shared by every process
// of the verifier (a control plane issuing nonces, a verify consuming them).
//
// The file is a log: a header line naming the format and the file, then one line per
// nonce issued ("i HEX UNIXNANO") or used ("u HEX UNIXNANO"), each appended and fsynced
// under an exclusive flock of Path + ".lock" before the call returns. The store keeps
// what it read in memory and reads only what other processes appended since; when dead
// lines (used, expired, future-dated) outnumber the live ones it rewrites the file
// atomically with the live ones (a new file, a new header).
//
// An attestation is fresh when its nonce is in the file as issued within TTL, not ahead
// of the clock by more than NonceClockSkew, and not yet used: the same attestation shown
// twice, or one made for a nonce nobody issued, is refused naming the nonce.
//
// Losing entries is safe only one way, and the store only ever loses them that way: a
// nonce is accepted only with its issue line present and no use line after it. A torn
// last line (a write cut short: its call returned an error, never a nonce nor an
// acceptance) is dropped; a file that is not a store, or is over its bound, is renamed
// to Path + ".bad" and the store starts empty. Every nonce issued before is then
// refused as never issued: a boot fetches another. Nothing is ever accepted that was not
// issued, nor twice.
//
// Goroutines share one *NonceStore: it serialises them in-process (Use ahead of Issue)
// before the file lock, so a waiting caller is a parked goroutine, not a thread blocked
// in flock. Issue waits at most IssueWait behind at most MaxWaiting others and is
// otherwise refused with ErrBusy. A NonceStore must not be copied after first use.
type NonceStore struct {
	Path string
	TTL  time.Duration // 0: DefaultNonceTTL
	Now  func() time.Time

	MaxOutstanding int           // 0: DefaultMaxOutstanding
	MaxWaiting     int           // 0: DefaultMaxWaiting
	IssueWait      time.Duration // 0: DefaultIssueWait
	UseWait        time.Duration // 0: DefaultUseWait
	// Logf receives what the store repairs and the errors NonceHandler keeps from its
	// clients (nil: log.Printf).
	Logf func(format string, args ...any)

	q queueLock
	c nonceCache
}

// nonceCache is what the store read of its file, valid while the file is the same one
// (device, inode and header id) and has not shrunk.
type nonceCache struct {
	ok        bool
	dirty     bool // entries dropped in memory, still in the file
	dev, ino  uint64
	id        string
	off       int64 // bytes of the file applied
	lines     int   // entry lines in the file
	pruned    int   // lines when last pruned
	issued    map[string]time.Time
	used      map[string]time.Time
	fullUntil time.Time // full (after pruning) until the oldest outstanding expires
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

func orDefault[T int | time.Duration](v, d T) T {
	if v > 0 {
		return v
	}
	return d
}

func (s *NonceStore) logf(format string, args ...any) {
	if s.Logf != nil {
		s.Logf(format, args...)
		return
	}
	log.Printf(format, args...)
}

// retryError is a refusal that says when to come back.
type retryError struct {
	err   error
	after time.Duration
}

func (e *retryError) Error() string { return e.err.Error() }
func (e *retryError) Unwrap() error { return e.err }

// do runs op on the store's contents under both locks; op returns the line to append
// (none: "") and the line is applied to the contents once it is on disk.
func (s *NonceStore) do(priority bool, op func(c *nonceCache, now time.Time) (string, error)) error {
	wait, max := orDefault(s.IssueWait, DefaultIssueWait), orDefault(s.MaxWaiting, DefaultMaxWaiting)
	if priority {
		wait, max = orDefault(s.UseWait, DefaultUseWait), 0
	}
	deadline := time.Now().Add(wait)
	if err := s.q.lock(priority, max, deadline); err != nil {
		return &retryError{fmt.Errorf("nonce store %s: %w", s.Path, err), time.Second}
	}
	defer s.q.unlock()
	lock, err := flockWithin(s.Path+".lock", deadline)
	if err != nil {
		if errors.Is(err, ErrBusy) {
			return &retryError{fmt.Errorf("nonce store %s: %w", s.Path, err), time.Second}
		}
		return fmt.Errorf("nonce store %s: lock: %w", s.Path, err)
	}
	defer lock.Close()
	now := s.now()
	f, err := s.load(now)
	if err != nil {
		s.c.ok = false
		return err
	}
	defer f.Close()
	line, err := op(&s.c, now)
	if s.c.dirty {
		// Entries dropped from memory that the file must lose too before anything
		// else is written (prune: dated ahead, they would come back valid later).
		f.Close()
		if cerr := s.compact(); cerr != nil {
			s.c.ok = false
			return cerr
		}
		var oerr error
		if f, oerr = s.open(); oerr != nil {
			return oerr
		}
		defer f.Close()
	}
	if err != nil || line == "" {
		return err
	}
	if _, err := f.WriteString(line); err != nil {
		s.c.ok = false
		return fmt.Errorf("nonce store %s: append: %w", s.Path, err)
	}
	if err := f.Sync(); err != nil {
		s.c.ok = false
		return fmt.Errorf("nonce store %s: fsync: %w", s.Path, err)
	}
	if err := s.c.apply([]byte(strings.TrimSuffix(line, "\n"))); err != nil {
		return err
	}
	s.c.off += int64(len(line))
	if s.c.lines-s.c.pruned > compactSlack {
		// Expired entries stay in memory until pruned: prune every compactSlack lines,
		// else a steady issue-and-use never looks dead enough to compact.
		s.prune(now)
		s.c.pruned = s.c.lines
	}
	if s.c.lines > 2*(len(s.c.issued)+len(s.c.used))+compactSlack {
		s.prune(now)
		// The line is on disk already: a failed compaction leaves a longer file, no
		// lost entry, and the next operation reads it afresh.
		if err := s.compact(); err != nil {
			s.c.ok = false
			s.logf("nonce store %s: compact: %v", s.Path, err)
		}
	}
	return nil
}

// load brings the cache up to the file and returns the file open for appending.
func (s *NonceStore) load(now time.Time) (*os.File, error) {
	f, err := os.OpenFile(s.Path, os.O_RDWR|os.O_APPEND|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return s.restart()
	}
	if err != nil {
		return nil, fmt.Errorf("nonce store: %w", err)
	}
	st, err := statOf(f)
	if err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		f.Close()
		return nil, fmt.Errorf("nonce store %s: not a regular file", s.Path)
	}
	c := &s.c
	if c.ok && c.dev == uint64(st.Dev) && c.ino == st.Ino && st.Size >= c.off && st.Size-c.off <= maxNonceFile {
		head := make([]byte, len(NonceStoreFormat)+1+len(c.id))
		if _, err := f.ReadAt(head, 0); err == nil && string(head) == NonceStoreFormat+" "+c.id {
			tail := make([]byte, st.Size-c.off)
			if _, err := f.ReadAt(tail, c.off); err != nil && err != io.EOF {
				f.Close()
				return nil, fmt.Errorf("nonce store %s: read: %w", s.Path, err)
			}
			torn, err := c.applyAll(tail)
			if err != nil {
				f.Close()
				return s.setAside(err.Error())
			}
			c.off += int64(len(tail) - torn)
			if torn > 0 {
				f.Close()
				return s.rewrite("a torn last line", now)
			}
			return f, nil
		}
	}
	if st.Size > maxNonceFile {
		f.Close()
		return s.setAside(fmt.Sprintf("%d bytes, over the %d a store holds", st.Size, maxNonceFile))
	}
	b, err := io.ReadAll(io.LimitReader(f, maxNonceFile+1))
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("nonce store %s: read: %w", s.Path, err)
	}
	*c = nonceCache{dev: uint64(st.Dev), ino: st.Ino, issued: map[string]time.Time{}, used: map[string]time.Time{}}
	head, rest, ok := bytes.Cut(b, []byte("\n"))
	id, isStore := strings.CutPrefix(string(head), NonceStoreFormat+" ")
	if !ok || !isStore || len(id) != 32 || !isHex(id) {
		f.Close()
		return s.setAside("not a " + NonceStoreFormat + " file")
	}
	c.id = id
	torn, err := c.applyAll(rest)
	if err != nil {
		f.Close()
		return s.setAside(err.Error())
	}
	c.off = int64(len(b) - torn)
	c.ok = true
	if torn > 0 {
		f.Close()
		return s.rewrite("a torn last line", now)
	}
	return f, nil
}

func statOf(f *os.File) (*syscall.Stat_t, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil, fmt.Errorf("%s: no stat", f.Name())
	}
	return st, nil
}

func isHex(s string) bool {
	for _, r := range s {
		if (r < '0' || r > '9') && (r < 'a' || r > 'f') {
			return false
		}
	}
	return true
}

// applyAll applies b's complete lines and returns the length of the incomplete last
// line, if any.
func (c *nonceCache) applyAll(b []byte) (torn int, err error) {
	for len(b) > 0 {
		line, rest, ok := bytes.Cut(b, []byte("\n"))
		if !ok {
			return len(b), nil
		}
		if err := c.apply(line); err != nil {
			return 0, err
		}
		b = rest
	}
	return 0, nil
}

// apply applies one entry line: an issued nonce, or a nonce used (no longer issued).
func (c *nonceCache) apply(line []byte) error {
	kind, rest, _ := strings.Cut(string(line), " ")
	h, at, _ := strings.Cut(rest, " ")
	ns, err := strconv.ParseInt(at, 10, 64)
	if (kind != "i" && kind != "u") || len(h) != 2*NonceSize || !isHex(h) || err != nil {
		return fmt.Errorf("line %d: %.100q is not an entry", c.lines+2, line)
	}
	t := time.Unix(0, ns).UTC()
	if kind == "i" {
		c.issued[h] = t
	} else {
		delete(c.issued, h)
		c.used[h] = t
	}
	c.lines++
	return nil
}

// prune drops entries dated before TTL or further ahead than NonceClockSkew: an expired
// nonce is then refused as never issued, as is a future-dated one. An issued nonce
// dated ahead would be valid again once the clock caught up with it, so dropping one
// marks the cache dirty: the file is rewritten before the operation's own line.
func (s *NonceStore) prune(now time.Time) {
	cut, ahead := now.Add(-s.ttl()), now.Add(NonceClockSkew)
	for _, m := range []map[string]time.Time{s.c.issued, s.c.used} {
		for k, t := range m {
			if t.Before(cut) || t.After(ahead) {
				delete(m, k)
				s.c.dirty = s.c.dirty || t.After(ahead)
			}
		}
	}
}

// setAside renames a file that is not a store (or is over its bound) to Path + ".bad"
// and starts an empty store: every nonce issued before is refused from now on, none
// accepted that was not issued.
func (s *NonceStore) setAside(why string) (*os.File, error) {
	if err := os.Rename(s.Path, s.Path+".bad"); err != nil {
		return nil, fmt.Errorf("nonce store %s: %s, and setting it aside failed: %w", s.Path, why, err)
	}
	s.logf("nonce store %s: %s: set aside as %s; the nonces it held are refused from now on", s.Path, why, s.Path+".bad")
	return s.restart()
}

// restart writes an empty store.
func (s *NonceStore) restart() (*os.File, error) {
	s.c = nonceCache{issued: map[string]time.Time{}, used: map[string]time.Time{}}
	if err := s.compact(); err != nil {
		return nil, err
	}
	return s.open()
}

// rewrite replaces the file with the cache's live entries (after a torn line).
func (s *NonceStore) rewrite(why string, now time.Time) (*os.File, error) {
	s.logf("nonce store %s: %s: rewritten from its complete lines", s.Path, why)
	s.prune(now)
	if err := s.compact(); err != nil {
		return nil, err
	}
	return s.open()
}

func (s *NonceStore) open() (*os.File, error) {
	f, err := os.OpenFile(s.Path, os.O_RDWR|os.O_APPEND|syscall.O_CLOEXEC, 0)
	if err != nil {
		s.c.ok = false
		return nil, fmt.Errorf("nonce store: %w", err)
	}
	st, err := statOf(f)
	if err != nil || st.Size != s.c.off || st.Ino != s.c.ino {
		f.Close()
		s.c.ok = false
		return nil, fmt.Errorf("nonce store %s: changed under its lock", s.Path)
	}
	return f, nil
}

// compact writes the cache's entries as a new file (a new id: a process caching the old
// one reads the new one whole) and records its identity.
func (s *NonceStore) compact() error {
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		return err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s %x\n", NonceStoreFormat, id)
	for _, e := range []struct {
		kind string
		m    map[string]time.Time
	}{{"i", s.c.issued}, {"u", s.c.used}} {
		keys := make([]string, 0, len(e.m))
		for k := range e.m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(&b, "%s %s %d\n", e.kind, k, e.m[k].UnixNano())
		}
	}
	if err := manifest.WriteAtomic(filepath.Dir(s.Path), filepath.Base(s.Path), b.Bytes()); err != nil {
		return fmt.Errorf("nonce store: %w", err)
	}
	fi, err := os.Stat(s.Path)
	if err != nil {
		return fmt.Errorf("nonce store: %w", err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	s.c.ok, s.c.dev, s.c.ino, s.c.id = true, uint64(st.Dev), st.Ino, hex.EncodeToString(id)
	s.c.off, s.c.lines, s.c.fullUntil, s.c.dirty = int64(b.Len()), len(s.c.issued)+len(s.c.used), time.Time{}, false
	s.c.pruned = s.c.lines
	return nil
}

// Issue makes a fresh nonce and records it as issued. A store holding MaxOutstanding
// nonces first drops the expired and future-dated ones, then refuses with ErrFull; a
// store locked for longer than IssueWait, or with MaxWaiting callers ahead, refuses
// with ErrBusy.
func (s *NonceStore) Issue() ([]byte, error) {
	nonce := make([]byte, NonceSize)
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	max := orDefault(s.MaxOutstanding, DefaultMaxOutstanding)
	err := s.do(false, func(c *nonceCache, now time.Time) (string, error) {
		if len(c.issued) >= max && now.Before(c.fullUntil) {
			return "", &retryError{fmt.Errorf("nonce store %s: %w (%d)", s.Path, ErrFull, max), c.fullUntil.Sub(now)}
		}
		if len(c.issued) >= max {
			s.prune(now)
		}
		if len(c.issued) >= max {
			oldest := now
			for _, t := range c.issued {
				if t.Before(oldest) {
					oldest = t
				}
			}
			c.fullUntil = oldest.Add(s.ttl())
			return "", &retryError{fmt.Errorf("nonce store %s: %w (%d)", s.Path, ErrFull, max), c.fullUntil.Sub(now)}
		}
		return fmt.Sprintf("i %x %d\n", nonce, now.UnixNano()), nil
	})
	if err != nil {
		return nil, err
	}
	return nonce, nil
}

// Use accepts nonce once: it must have been issued within TTL, not dated ahead of the
// clock, and not used; it is then recorded as used, whatever the rest of the
// verification says (a nonce is good for one showing). Use waits for the lock ahead of
// every Issue.
func (s *NonceStore) Use(nonce []byte) error {
	h := hex.EncodeToString(nonce)
	var refusal error
	err := s.do(true, func(c *nonceCache, now time.Time) (string, error) {
		issued, ok := c.issued[h]
		_, used := c.used[h]
		switch age := now.Sub(issued); {
		case used:
			refusal = refuse("nonce", "%s was already used by another attestation (a replay)", h)
		case !ok:
			refusal = refuse("nonce", "%s was never issued by this verifier (or expired: nonces live %s)", h, s.ttl())
		case age > s.ttl():
			refusal = refuse("nonce", "%s was issued %s ago, over %s", h, age.Round(time.Second), s.ttl())
		case -age > NonceClockSkew:
			// Recorded as used: refused for good, not accepted once the clock has
			// caught up with it.
			refusal = refuse("nonce", "%s is dated %s ahead of this verifier's clock (issued while it ran ahead), over the %s allowed", h, (-age).Round(time.Second), NonceClockSkew)
			return fmt.Sprintf("u %s %d\n", h, now.UnixNano()), nil
		default:
			return fmt.Sprintf("u %s %d\n", h, now.UnixNano()), nil
		}
		return "", nil
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
// A store full or busy is answered 503 with Retry-After (the boot's fetch retries); any
// other failure is logged (s.Logf) and answered 500 without its detail: a client learns
// nothing of the server's files.
func NonceHandler(s *NonceStore) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			http.Error(w, "GET a nonce", http.StatusMethodNotAllowed)
			return
		}
		n, err := s.Issue()
		var retry *retryError
		switch {
		case errors.As(err, &retry):
			secs := int64((retry.after + time.Second - 1) / time.Second)
			w.Header().Set("Retry-After", strconv.FormatInt(max(secs, 1), 10))
			msg := "the verifier is busy: retry later"
			if errors.Is(err, ErrFull) {
				msg = "the verifier has too many nonces outstanding: retry later"
			}
			http.Error(w, msg, http.StatusServiceUnavailable)
			return
		case err != nil:
			s.logf("nonce handler: GET from %s: %v", r.RemoteAddr, err)
			http.Error(w, "the verifier could not issue a nonce", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", NonceType)
		w.Header().Set("Cache-Control", "no-store")
		fmt.Fprintln(w, hex.EncodeToString(n))
	})
}
