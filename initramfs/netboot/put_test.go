package netboot_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs/netboot"
)

// TestPut: Put is Publish's bounded request with PUT (the boot's Pushgateway push): one
// request on success and on a status the server would answer again (400), every try on
// one worth retrying (503), the body and media type as given.
func TestPut(t *testing.T) {
	const ctype = "text/plain; version=0.0.4; charset=utf-8"
	var mu sync.Mutex
	var got []string
	codes := map[string]int{"/ok": 200, "/bad": 400, "/down": 503}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type")+" "+string(b))
		mu.Unlock()
		w.WriteHeader(codes[r.URL.Path])
	}))
	defer srv.Close()
	p := netboot.PublishPolicy{Tries: 3, PerTry: time.Second, Backoff: time.Millisecond}
	for path, want := range map[string]int{"/ok": 1, "/bad": 1, "/down": 3} {
		got = nil
		tries, err := netboot.Put(context.Background(), nil, srv.URL+path, ctype, []byte("x 1\n"), p)
		if (err == nil) != (path == "/ok") || len(tries) != want || len(got) != want {
			t.Errorf("%s: err %v, tries %+v, %d requests, want %d", path, err, tries, len(got), want)
		}
		if len(got) > 0 && got[0] != "PUT "+path+" "+ctype+" x 1\n" {
			t.Errorf("%s: request %q", path, got[0])
		}
	}
}
