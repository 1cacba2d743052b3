package netboot

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/entropy/entropytest"
)

// A publish or push answered with a redirect is not delivered: the redirect is not
// followed (a 301/302/303 would turn the POST or PUT into a GET without the body, whose
// 200 would be taken for delivery), nothing reaches the redirect's target, the error
// names the status and where it pointed, and a redirect to https cannot skip the
// random-pool wait. Loopback servers only.
func TestPublishFollowsNoRedirect(t *testing.T) {
	var mu sync.Mutex
	var target []string
	dst := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		target = append(target, r.Method+" "+string(b))
		mu.Unlock()
	}))
	defer dst.Close()
	tlsDst := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		target = append(target, "tls "+r.Method)
		mu.Unlock()
	}))
	defer tlsDst.Close()

	for _, code := range []int{301, 302, 303, 307, 308} {
		for _, to := range []string{dst.URL + "/elsewhere", tlsDst.URL + "/elsewhere"} {
			src := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				http.Redirect(w, r, to, code)
			}))
			p := PublishPolicy{Tries: 3, PerTry: time.Second, Pool: &entropytest.NotReady{}, Sleep: func(context.Context, time.Duration) error { return nil }}
			for verb, send := range map[string]func() ([]Attempt, error){
				"publish": func() ([]Attempt, error) { return Publish(context.Background(), nil, src.URL, []byte("envelope"), p) },
				"put": func() ([]Attempt, error) {
					return Put(context.Background(), nil, src.URL, "text/plain", []byte("metrics"), p)
				},
			} {
				att, err := send()
				if err == nil || len(att) != 1 || att[0].Status != code ||
					!strings.Contains(err.Error(), "redirect to \""+to+"\" not followed") {
					t.Errorf("%s answered %d to %s: attempts %+v, err %v", verb, code, to, att, err)
				}
			}
			src.Close()
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(target) != 0 {
		t.Errorf("the redirects' targets got %q", target)
	}
}
