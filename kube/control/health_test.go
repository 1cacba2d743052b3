package control_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/passage-boot/passage/kube/control"
)

// fakeAPI is a probe target that answers, or hangs until the probe's context ends.
type fakeAPI struct{ hung atomic.Bool }

func (a *fakeAPI) probe(ctx context.Context) error {
	if a.hung.Load() {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

func get(t *testing.T, h http.HandlerFunc) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	return rec.Code, rec.Body.String()
}

// TestReadyz: not ready until the API server first answers; ready while it answered
// within the window; not ready once it has not (hung), ready again when it answers; not
// ready while every slot is held. /healthz says ok throughout.
func TestReadyz(t *testing.T) {
	var mu sync.Mutex
	now := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	api := &fakeAPI{}
	g := newGate()
	l := control.NewLimit(g, 1, time.Hour, control.NewMetrics())
	h := &control.Health{Probe: api.probe, Every: 20 * time.Millisecond, Within: 10 * time.Second, Limit: l,
		Now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }}
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	ready := func(what string, want bool, why string) {
		t.Helper()
		code, body := get(t, h.Readyz)
		if (code == http.StatusOK) != want || !strings.Contains(body, why) {
			t.Errorf("%s: /readyz %d %q, want ready=%v naming %q", what, code, body, want, why)
		}
		if code, _ := get(t, h.Healthz); code != http.StatusOK {
			t.Errorf("%s: /healthz %d, want 200", what, code)
		}
	}
	ready("before any probe", false, "not answered yet")
	h.Check(context.Background())
	ready("the API answered", true, "ok")
	api.hung.Store(true)
	advance(5 * time.Second)
	h.Check(context.Background())
	ready("hung 5s, within the 10s window", true, "ok")
	advance(6 * time.Second)
	h.Check(context.Background())
	ready("hung 11s", false, "api server: no answer for 11s")
	api.hung.Store(false)
	h.Check(context.Background())
	ready("answering again", true, "ok")

	ts := httptest.NewServer(l)
	defer ts.Close()
	held := make(chan reply, 1)
	go func() { held <- do(http.MethodPost, ts.URL, control.AttestationType, nil) }()
	g.wait(t, 1)
	ready("every slot held", false, "all 1 slots held")
	close(g.release)
	<-held
	ready("the slot given back", true, "ok")
}

// TestReadyzRun: Run's background probe turns /readyz unready while the API hangs and
// ready once it answers again (waits bounded, nothing timed).
func TestReadyzRun(t *testing.T) {
	api := &fakeAPI{}
	h := &control.Health{Probe: api.probe, Every: 10 * time.Millisecond, Within: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	await := func(what string, want bool) {
		t.Helper()
		for i := 0; ; i++ {
			ok, why := h.Ready()
			if ok == want {
				return
			}
			if i > 3000 {
				t.Fatalf("%s: ready=%v (%s), want %v", what, ok, why, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	await("the API answering", true)
	api.hung.Store(true)
	await("the API hung", false)
	api.hung.Store(false)
	await("the API back", true)
}
