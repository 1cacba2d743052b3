package netboot

import (
	"context"
	"encoding/hex"
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
		{"503 then ok", []int{503, 200}, good, 2, good, false},
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
			p.Sleep = rec.sleep
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
