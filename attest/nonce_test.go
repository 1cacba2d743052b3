package attest

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// logTo collects what a store logs.
type logTo struct {
	mu    sync.Mutex
	lines []string
}

func (l *logTo) Logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

func (l *logTo) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// TestNonceStore: a nonce is good once, within its life; one never issued, one used, one
// expired are refused naming the nonce; issuing from several goroutines, and from two
// stores on one file (two processes), loses none.
func TestNonceStore(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	// Waits as long as a loaded machine needs: 32 issues at once on one file.
	s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Now: clock, IssueWait: time.Minute}
	a, err := s.Issue()
	if err != nil || len(a) != NonceSize {
		t.Fatalf("issue: %x %v", a, err)
	}
	if err := s.Use(a); err != nil {
		t.Fatalf("an issued nonce: %v", err)
	}
	for name, c := range map[string]struct {
		nonce []byte
		words string
	}{
		"used":         {a, "already used"},
		"never issued": {make([]byte, NonceSize), "never issued"},
		"short":        {[]byte{1}, "never issued"},
	} {
		if err := s.Use(c.nonce); CheckOf(err) != "nonce" || !strings.Contains(err.Error(), hex.EncodeToString(c.nonce)) || !strings.Contains(err.Error(), c.words) {
			t.Errorf("%s: %v", name, err)
		}
	}
	old, err := s.Issue()
	if err != nil {
		t.Fatal(err)
	}
	now = now.Add(DefaultNonceTTL + time.Second)
	if err := s.Use(old); CheckOf(err) != "nonce" || !strings.Contains(err.Error(), hex.EncodeToString(old)) {
		t.Errorf("expired: %v", err)
	}

	// Another process's store on the same file: each reads what the other appended.
	other := &NonceStore{Path: s.Path, Now: clock, IssueWait: time.Minute}
	var wg sync.WaitGroup
	got := make(chan []byte, 32)
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := s
			if i%2 == 1 {
				st = other
			}
			n, err := st.Issue()
			if err != nil {
				t.Error(err)
			}
			got <- n
		}()
	}
	wg.Wait()
	close(got)
	i := 0
	for n := range got {
		st := s
		if i++; i%2 == 0 {
			st = other
		}
		if err := st.Use(n); err != nil {
			t.Errorf("issued concurrently, then lost: %v", err)
		}
	}

	// The control plane's endpoint: GET issues, anything else is refused.
	srv := httptest.NewServer(NonceHandler(s))
	defer srv.Close()
	n := get(t, srv.URL, http.StatusOK)
	if err := other.Use(n); err != nil {
		t.Errorf("GET: %x: %v", n, err)
	}
	if resp, err := http.Post(srv.URL, "text/plain", nil); err != nil || resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST: %v %v", resp.StatusCode, err)
	}
}

// get GETs a nonce from url, wanting status; it returns the nonce (nil unless 200).
func get(t *testing.T, url string, want int) []byte {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("GET: %d %q, want %d", resp.StatusCode, body, want)
	}
	if want != http.StatusOK {
		return nil
	}
	n, err := hex.DecodeString(strings.TrimSpace(string(body)))
	if err != nil || resp.Header.Get("Content-Type") != NonceType {
		t.Fatalf("GET: %q (%s)", body, resp.Header.Get("Content-Type"))
	}
	return n
}

// TestNonceFutureDated: a nonce issued while the clock ran ahead (here a day) is refused
// once the clock is back, not accepted when the clock catches up with it; and a store at
// its bound prunes it, so it frees its place.
func TestNonceFutureDated(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Now: func() time.Time { return now }, MaxOutstanding: 2}
	now = now.Add(23 * time.Hour)
	ahead, err := s.Issue()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Issue(); err != nil {
		t.Fatal(err)
	}
	now = now.Add(-23 * time.Hour)
	if err := s.Use(ahead); CheckOf(err) != "nonce" || !strings.Contains(err.Error(), "ahead of this verifier's clock") {
		t.Errorf("a nonce dated 23h ahead: %v, want refused", err)
	}
	// Full (two outstanding, both dated ahead): the next issue prunes them.
	for i := 0; i < 2; i++ {
		if _, err := s.Issue(); err != nil {
			t.Errorf("issue %d at the bound with future-dated entries: %v", i, err)
		}
	}
	// A fresh store reading the file refuses it as well.
	fresh := &NonceStore{Path: s.Path, Now: s.Now}
	now = now.Add(23 * time.Hour)
	if err := fresh.Use(ahead); err == nil {
		t.Errorf("a nonce issued 23h ahead, when the clock caught up: accepted")
	}
	// Within the skew, a nonce is good.
	now = now.Add(time.Hour)
	n, err := s.Issue()
	if err != nil {
		t.Fatal(err)
	}
	now = now.Add(-NonceClockSkew / 2)
	if err := fresh.Use(n); err != nil {
		t.Errorf("a nonce within the skew: %v", err)
	}
}

// TestNonceHandlerFull: the store issues at most MaxOutstanding nonces; past it a GET is
// refused 503 with Retry-After, a genuine Use still served, and the store frees a place
// as a nonce is used or expires.
func TestNonceHandlerFull(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Now: func() time.Time { return now }, MaxOutstanding: 3}
	srv := httptest.NewServer(NonceHandler(s))
	defer srv.Close()
	var issued [][]byte
	for i := 0; i < 3; i++ {
		issued = append(issued, get(t, srv.URL, http.StatusOK))
	}
	now = now.Add(time.Minute)
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != http.StatusServiceUnavailable || ra < 1 || ra > int((DefaultNonceTTL-time.Minute)/time.Second) {
		t.Errorf("full: %d Retry-After %q, want 503 and at most the life left of the oldest", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if err := s.Use(issued[0]); err != nil {
		t.Fatalf("use, store full: %v", err)
	}
	get(t, srv.URL, http.StatusOK)
	get(t, srv.URL, http.StatusServiceUnavailable)
	now = now.Add(DefaultNonceTTL + time.Minute)
	for i := 0; i < 3; i++ {
		get(t, srv.URL, http.StatusOK)
	}
	if err := s.Use(issued[1]); CheckOf(err) != "nonce" {
		t.Errorf("expired, pruned: %v", err)
	}
}

// TestNonceHandlerHeals: a store file that is not one, or over its bound, is set aside
// (logged) and the endpoint issues again; the nonces it held are refused, none accepted
// that was not issued. A torn last line is dropped and the rest kept. A store the
// handler cannot use at all is a 500 that names no server path (the log does).
func TestNonceHandlerHeals(t *testing.T) {
	for name, content := range map[string][]byte{
		"not a store":    []byte("{}"),
		"a v1 store":     []byte(`{"format":"passage-nonces/1","issued":{},"used":{}}`),
		"bad line":       []byte(NonceStoreFormat + " 00112233445566778899aabbccddeeff\ni zz 1\n"),
		"over its bound": bytes.Repeat([]byte("i "), maxNonceFile/2+1),
	} {
		t.Run(name, func(t *testing.T) {
			var log logTo
			s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Logf: log.Logf}
			before, err := s.Issue()
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(s.Path, content, 0o600); err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(NonceHandler(s))
			defer srv.Close()
			n := get(t, srv.URL, http.StatusOK)
			if err := s.Use(n); err != nil {
				t.Errorf("issued after healing: %v", err)
			}
			if err := s.Use(before); CheckOf(err) != "nonce" {
				t.Errorf("issued before the store was replaced: %v, want refused", err)
			}
			if b, err := os.ReadFile(s.Path + ".bad"); err != nil || !bytes.Equal(b, content) {
				t.Errorf("the bad store is not kept aside: %v", err)
			}
			if !strings.Contains(log.String(), "set aside") {
				t.Errorf("log: %q", log.String())
			}
		})
	}

	t.Run("torn last line", func(t *testing.T) {
		var log logTo
		s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Logf: log.Logf}
		kept, err := s.Issue()
		if err != nil {
			t.Fatal(err)
		}
		used, err := s.Issue()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Use(used); err != nil {
			t.Fatal(err)
		}
		// A write cut short: its Issue never returned the nonce.
		f, _ := os.OpenFile(s.Path, os.O_WRONLY|os.O_APPEND, 0)
		fmt.Fprintf(f, "i %x", make([]byte, NonceSize))
		f.Close()
		for _, st := range []*NonceStore{s, {Path: s.Path, Logf: log.Logf}} {
			if err := st.Use(used); CheckOf(err) != "nonce" || !strings.Contains(err.Error(), "already used") {
				t.Errorf("used before the torn line: %v", err)
			}
		}
		if err := s.Use(make([]byte, NonceSize)); CheckOf(err) != "nonce" {
			t.Errorf("the torn line's nonce: %v, want refused", err)
		}
		if err := s.Use(kept); err != nil {
			t.Errorf("issued before the torn line: %v", err)
		}
		if !strings.Contains(log.String(), "torn") {
			t.Errorf("log: %q", log.String())
		}
	})

	t.Run("no path to clients", func(t *testing.T) {
		var log logTo
		dir := t.TempDir()
		s := &NonceStore{Path: filepath.Join(dir, "nonces.json"), Logf: log.Logf}
		if err := os.Mkdir(s.Path, 0o700); err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(NonceHandler(s))
		defer srv.Close()
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusInternalServerError || strings.Contains(string(body), dir) {
			t.Errorf("a directory for the store: %d %q, want 500 naming no path", resp.StatusCode, body)
		}
		if !strings.Contains(log.String(), s.Path) {
			t.Errorf("the server's log does not name the store: %q", log.String())
		}
	})
}

// TestNonceStoreStaysSmall: a verifier's steady work (a nonce issued and used every
// second, nonces living a minute, for 2,500 s: over 40 lives) keeps the file bounded by
// the nonces alive and the compaction's slack, however long it runs; and another store
// reading the file across its rewrites still refuses a used nonce.
func TestNonceStoreStaysSmall(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Now: clock, TTL: time.Minute}
	other := &NonceStore{Path: s.Path, Now: clock, TTL: time.Minute}
	// Alive: 60 used; pruned every compactSlack lines, rewritten past twice the entries
	// in memory and the slack.
	line := len(fmt.Sprintf("u %x %d\n", make([]byte, NonceSize), now.UnixNano()))
	bound := int64((2*(60+compactSlack) + compactSlack + 2) * line)
	var biggest int64
	for i := 0; i < 2500; i++ {
		now = now.Add(time.Second)
		n, err := s.Issue()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Use(n); err != nil {
			t.Fatal(err)
		}
		if i%250 == 0 {
			if err := other.Use(n); CheckOf(err) != "nonce" {
				t.Fatalf("op %d: used, then read by another store: %v", i, err)
			}
		}
		if fi, err := os.Stat(s.Path); err != nil {
			t.Fatal(err)
		} else {
			biggest = max(biggest, fi.Size())
		}
	}
	if biggest > bound {
		t.Errorf("the file grew to %d bytes, over %d", biggest, bound)
	}
	t.Logf("largest file: %d bytes (bound %d, 5,000 lines written: %d)", biggest, bound, 5000*line)
}

// TestQueueLockPriority: a Use waiting for the lock is served before an Issue that
// waited longer; an Issue past MaxWaiting, or past its wait, is refused ErrBusy.
func TestQueueLockPriority(t *testing.T) {
	var q queueLock
	far := time.Now().Add(time.Minute)
	if err := q.lock(false, 1, far); err != nil {
		t.Fatal(err)
	}
	order := make(chan string, 2)
	go func() {
		if err := q.lock(false, 1, far); err == nil {
			order <- "issue"
			q.unlock()
		}
	}()
	waitFor(t, func() bool { q.mu.Lock(); defer q.mu.Unlock(); return len(q.other) == 1 })
	if err := q.lock(false, 1, far); !isBusy(err) {
		t.Errorf("a second waiting issue, bound 1: %v, want busy", err)
	}
	go func() {
		if err := q.lock(true, 0, far); err == nil {
			order <- "use"
			q.unlock()
		}
	}()
	waitFor(t, func() bool { q.mu.Lock(); defer q.mu.Unlock(); return len(q.priority) == 1 })
	q.unlock()
	if a, b := <-order, <-order; a != "use" || b != "issue" {
		t.Errorf("served %s then %s, want use first", a, b)
	}
	if err := q.lock(false, 0, far); err != nil {
		t.Fatal(err)
	}
	if err := q.lock(false, 0, time.Now().Add(10*time.Millisecond)); !isBusy(err) {
		t.Errorf("past its wait: %v, want busy", err)
	}
}

func isBusy(err error) bool { return err != nil && strings.Contains(err.Error(), ErrBusy.Error()) }

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for i := 0; i < 1000; i++ {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("condition not reached in 10 s")
}

// TestNonceHandlerFlood: 1,000 concurrent GETs while another process holds the store's
// lock, in a child process limited to 200 OS threads (the runtime aborts past it, as it
// would past its real 10,000): no crash, the excess refused 503 with Retry-After at
// once, those that waited refused when their wait ran out, and a genuine Use waiting
// behind them all served first once the lock is free. Then 1,000 GETs with the lock
// free beside genuine Uses: every Use served, every GET answered 200 or 503.
func TestNonceHandlerFlood(t *testing.T) {
	if os.Getenv("PASSAGE_NONCE_FLOOD") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestNonceHandlerFlood$", "-test.v")
		cmd.Env = append(os.Environ(), "PASSAGE_NONCE_FLOOD="+t.TempDir())
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestNonceHandlerFlood") {
			t.Fatalf("the flood's process: %v\n%s", err, lastLines(out, 30))
		}
		t.Logf("%s", lastLines(out, 6))
		return
	}
	debug.SetMaxThreads(200)
	path := filepath.Join(os.Getenv("PASSAGE_NONCE_FLOOD"), "nonces.json")
	var log logTo
	s := &NonceStore{Path: path, IssueWait: 300 * time.Millisecond, Logf: log.Logf}
	var genuine [][]byte
	for i := 0; i < 20; i++ {
		n, err := s.Issue()
		if err != nil {
			t.Fatal(err)
		}
		genuine = append(genuine, n)
	}
	srv := httptest.NewServer(NonceHandler(s))
	defer srv.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1000}, Timeout: time.Minute}
	flood := func(n int) map[int]int {
		var mu sync.Mutex
		codes := map[int]int{}
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				code := -1
				resp, err := client.Get(srv.URL)
				if err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					code = resp.StatusCode
					if code == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
						code = -2
					}
				} else {
					t.Errorf("GET: %v", err)
				}
				mu.Lock()
				codes[code]++
				mu.Unlock()
			}()
		}
		wg.Wait()
		return codes
	}

	// Another process's lock, as flock sees it: another open file description.
	held, err := os.OpenFile(path+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(held.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	used := make(chan error, 1)
	go func() { used <- s.Use(genuine[0]) }()
	codes := flood(1000)
	if codes[http.StatusServiceUnavailable] != 1000 {
		t.Errorf("lock held: %v, want 1000 refused 503 with Retry-After", codes)
	}
	select {
	case err := <-used:
		t.Fatalf("Use with the lock held: %v", err)
	default:
	}
	held.Close()
	if err := <-used; err != nil {
		t.Errorf("the genuine Use behind the flood: %v", err)
	}

	// With the lock free, the question is whether GETs are served beside the genuine
	// Uses, not how fast: the Uses go first, and each one's write on a loaded machine can
	// outlast a 300 ms wait, so the GETs wait up to 10 s now (nothing runs beside this).
	s.IssueWait = 10 * time.Second
	var wg sync.WaitGroup
	for _, n := range genuine[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.Use(n); err != nil {
				t.Errorf("a genuine Use during the flood: %v", err)
			}
		}()
	}
	codes = flood(1000)
	wg.Wait()
	if codes[http.StatusOK]+codes[http.StatusServiceUnavailable] != 1000 || codes[http.StatusOK] == 0 {
		t.Errorf("lock free: %v, want every GET 200 or 503 with Retry-After, some 200", codes)
	}
	t.Logf("lock held: 1000 GETs refused 503; lock free: %v; OS threads at the end: %d", codes, threads())
	if log.String() != "" {
		t.Errorf("log: %s", log.String())
	}
}

func threads() int {
	b, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return -1
}

func lastLines(b []byte, n int) string {
	l := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}

// FuzzNonceStoreFile: whatever bytes stand in the store's file, the store neither
// panics nor accepts a nonce it did not issue, and a nonce it issues after reading them
// is accepted exactly once.
func FuzzNonceStoreFile(f *testing.F) {
	id := NonceStoreFormat + " 00112233445566778899aabbccddeeff\n"
	f.Add([]byte(id))
	f.Add([]byte(id + "i " + strings.Repeat("ab", NonceSize) + " 1764763200000000000\n"))
	f.Add([]byte(id + "u " + strings.Repeat("ab", NonceSize) + " 1\ni " + strings.Repeat("cd", NonceSize) + " 9"))
	f.Add([]byte("{}"))
	f.Fuzz(func(t *testing.T, b []byte) {
		s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Logf: func(string, ...any) {},
			Now: func() time.Time { return time.Unix(0, 1764763200000000000) }}
		if err := os.WriteFile(s.Path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := s.Use(bytes.Repeat([]byte{0xab}, NonceSize)); err == nil && !bytes.Contains(b, []byte("i "+strings.Repeat("ab", NonceSize))) {
			t.Fatalf("accepted a nonce the file never held")
		}
		n, err := s.Issue()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Use(n); err != nil {
			t.Fatalf("issued then refused: %v", err)
		}
		if err := (&NonceStore{Path: s.Path, Now: s.Now}).Use(n); CheckOf(err) != "nonce" {
			t.Fatalf("used twice: %v", err)
		}
	})
}
