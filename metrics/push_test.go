package metrics_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/metrics"
)

func TestPush(t *testing.T) {
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
	p := metrics.PushPolicy{Tries: 3, PerTry: time.Second, Wait: time.Millisecond}
	for path, want := range map[string]int{"/ok": 1, "/bad": 1, "/down": 3} {
		got = nil
		tries, err := metrics.Push(context.Background(), nil, srv.URL+path, []byte("x 1\n"), p)
		if (err == nil) != (path == "/ok") || len(tries) != want || len(got) != want {
			t.Errorf("%s: err %v, tries %q, %d requests, want %d", path, err, tries, len(got), want)
		}
		if len(got) > 0 && got[0] != "PUT "+path+" "+metrics.ContentType+" x 1\n" {
			t.Errorf("%s: request %q", path, got[0])
		}
	}
	for in, want := range map[string]string{"": "/metrics/job/passage/instance@base64/=", "a/b": "/metrics/job/passage/instance@base64/YS9i"} {
		if u := metrics.GroupURL("http://gw", in); u != "http://gw"+want {
			t.Errorf("GroupURL(%q) = %s", in, u)
		}
	}
	if !strings.HasPrefix(metrics.ContentType, "text/plain; version=0.0.4") {
		t.Error(metrics.ContentType)
	}
}
