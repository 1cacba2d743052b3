package netboot

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestFetchNonce: a GET of passage.url that accepts the nonce type; a 503 is retried with
// the publish backoff, a 404 (a control plane without nonces) is not; an answer that is
// not 16 to 64 bytes of hex is refused with the answer quoted.
func TestFetchNonce(t *testing.T) {
	const good = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
	for _, tc := range []struct {
		name    string
		codes   []int
		body    string
		tries   int
		want    string // the nonce in hex, or words of the error
		wantErr bool
	}{
		{"first try", []int{200}, good + "\n", 1, good, false},
		{"503 then ok", []int{503, 200}, good + "\n", 2, good, false},
		{"404 not retried", []int{404}, "", 1, "404", true},
		{"not hex", []int{200}, "rdinit=/bin/sh", 1, `"rdinit=/bin/sh" is not 16 to 64 bytes of hex`, true},
		{"too short", []int{200}, "0011", 1, "not 16 to 64 bytes", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			n := 0
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method != http.MethodGet || r.Header.Get("Accept") != NonceType {
					t.Errorf("request %s Accept %q", r.Method, r.Header.Get("Accept"))
				}
				mu.Lock()
				code := tc.codes[min(n, len(tc.codes)-1)]
				n++
				mu.Unlock()
				w.WriteHeader(code)
				if code == 200 {
					w.Write([]byte(tc.body))
				}
			}))
			defer srv.Close()
			rec := &recorder{}
			p := DefaultPublish
			p.Sleep, p.Rand = rec.sleep, noJitter
			nonce, att, err := FetchNonce(context.Background(), srv.Client(), srv.URL, p)
			if len(att) != tc.tries {
				t.Errorf("%d tries, want %d: %+v", len(att), tc.tries, att)
			}
			if tc.wantErr {
				if err == nil || nonce != nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("nonce %x, err %v; want an error saying %q", nonce, err, tc.want)
				}
				return
			}
			if err != nil || hex.EncodeToString(nonce) != tc.want {
				t.Fatalf("nonce %x, err %v; want %s", nonce, err, tc.want)
			}
			if tc.tries > 1 && (len(rec.waits) != 1 || rec.waits[0] != time.Second) {
				t.Errorf("waits %v, want the publish backoff", rec.waits)
			}
		})
	}
}

// TestFetchNonceWholeLineOnly: a nonce is the whole answer the control plane writes (the
// hex and its newline) and nothing less or more. A prefix of a good nonce decodes as hex
// of a valid length, so each of these would have been a (wrong) nonce if the answer
// were taken as far as it went; each is refused, without a retry, never returning a
// nonce.
func TestFetchNonceWholeLineOnly(t *testing.T) {
	const good = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
	for _, tc := range []struct {
		name, body, words string
	}{
		{"empty", "", "is not 16 to 64 bytes of hex"},
		{"newline only", "\n", "is not 16 to 64 bytes of hex"},
		{"no newline", good, "not a whole line"},
		{"cut to 20 bytes, no newline", good[:40], "not a whole line"},
		{"odd hex digits", good[:41] + "\n", "is not 16 to 64 bytes of hex"},
		{"two lines", good + "\n" + good + "\n", "is not 16 to 64 bytes of hex"},
		{"65 bytes", good + good + "00\n", "is not 16 to 64 bytes of hex"},
		{"spaces around", " " + good + " \n", "is not 16 to 64 bytes of hex"},
		{"over MaxBody", strings.Repeat("0", MaxBody) + "\n", "over 512 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			n := 0
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				n++
				mu.Unlock()
				w.Header().Set("Content-Type", NonceType)
				io.WriteString(w, tc.body)
			}))
			defer srv.Close()
			rec := &recorder{}
			p := DefaultPublish
			p.Sleep = rec.sleep
			nonce, att, err := FetchNonce(context.Background(), srv.Client(), srv.URL, p)
			if err == nil || nonce != nil || !strings.Contains(err.Error(), tc.words) {
				t.Fatalf("answer %q: nonce %x, err %v; want an error saying %q", tc.body, nonce, err, tc.words)
			}
			if len(att) != 1 || n != 1 {
				t.Errorf("answer %q: %d attempts, %d requests; a whole answer that is not a nonce is not asked again", tc.body, len(att), n)
			}
		})
	}
	// A nonce line ended CRLF is whole.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, good+"\r\n") }))
	defer srv.Close()
	if nonce, _, err := FetchNonce(context.Background(), srv.Client(), srv.URL, PublishPolicy{Tries: 1}); err != nil || hex.EncodeToString(nonce) != good {
		t.Errorf("CRLF: nonce %x, err %v", nonce, err)
	}
}

// cutServer answers each GET 200 with a Content-Length of the whole nonce line, writes
// the first cut bytes of it and drops the connection; from request whole on it answers
// the whole line.
func cutServer(t *testing.T, line string, cut, whole int) (*httptest.Server, func() int) {
	t.Helper()
	var mu sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		i := n
		mu.Unlock()
		if whole > 0 && i >= whole {
			io.WriteString(w, line)
			return
		}
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Errorf("hijack: %v", err)
			return
		}
		defer conn.Close()
		fmt.Fprintf(buf, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s", NonceType, len(line), line[:cut])
		buf.Flush()
	}))
	return srv, func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// TestFetchNonceCutMidBody: a connection lost mid-body is a failed try, retried within
// the policy, and never a nonce, though the bytes that came are a valid-looking nonce
// (20 bytes of hex of the 32 promised).
func TestFetchNonceCutMidBody(t *testing.T) {
	const good = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
	srv, requests := cutServer(t, good+"\n", 40, 0)
	defer srv.Close()
	rec := &recorder{}
	p := DefaultPublish
	p.Sleep, p.Rand = rec.sleep, noJitter
	nonce, att, err := FetchNonce(context.Background(), srv.Client(), srv.URL, p)
	if err == nil || nonce != nil || !strings.Contains(err.Error(), "answer cut short") {
		t.Fatalf("cut every time: nonce %x, err %v; want an error saying the answer was cut", nonce, err)
	}
	if len(att) != p.Tries || requests() != p.Tries || att[0].Status != 200 {
		t.Errorf("cut every time: attempts %+v, %d requests; want %d tries (a cut answer is retried)", att, requests(), p.Tries)
	}

	srv2, requests2 := cutServer(t, good+"\n", 40, 2)
	defer srv2.Close()
	nonce, att, err = FetchNonce(context.Background(), srv2.Client(), srv2.URL, p)
	if err != nil || hex.EncodeToString(nonce) != good || len(att) != 2 || requests2() != 2 {
		t.Errorf("cut once, then whole: nonce %x, err %v, attempts %+v", nonce, err, att)
	}
}
