package attest

import (
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestNonceStore: a nonce is good once, within its life; one never issued, one used, one
// expired are refused naming the nonce; issuing from several goroutines loses none (the
// file is replaced under a lock); a store that is not one is an error naming the file.
func TestNonceStore(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	s := &NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json"), Now: func() time.Time { return now }}
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

	var wg sync.WaitGroup
	got := make(chan []byte, 16)
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := s.Issue()
			if err != nil {
				t.Error(err)
			}
			got <- n
		}()
	}
	wg.Wait()
	close(got)
	for n := range got {
		if err := s.Use(n); err != nil {
			t.Errorf("issued concurrently, then lost: %v", err)
		}
	}

	// The control plane's endpoint: GET issues, anything else is refused.
	srv := httptest.NewServer(NonceHandler(s))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	var buf [128]byte
	k, _ := resp.Body.Read(buf[:])
	resp.Body.Close()
	n, err := hex.DecodeString(strings.TrimSpace(string(buf[:k])))
	if err != nil || resp.Header.Get("Content-Type") != NonceType || s.Use(n) != nil {
		t.Errorf("GET: %q (%s), %v", buf[:k], resp.Header.Get("Content-Type"), err)
	}
	if resp, err := http.Post(srv.URL, "text/plain", nil); err != nil || resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST: %v %v", resp.StatusCode, err)
	}

	if err := os.WriteFile(s.Path, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Issue(); err == nil || !strings.Contains(err.Error(), s.Path) {
		t.Errorf("a store that is not one: %v", err)
	}
}
