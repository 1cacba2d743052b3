package control

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

// Defaults of Health.
const (
	// DefaultProbeEvery is how often the API server is asked, each ask bounded by as
	// long.
	DefaultProbeEvery = 2 * time.Second
	// DefaultReadyWithin: a replica is ready while the API server answered within this.
	DefaultReadyWithin = 10 * time.Second
)

// Health answers /healthz (liveness: the process serves HTTP) and /readyz (readiness:
// the API server answered Probe within Within, and the exchange's slots are not all
// held). Probe runs in the background (Run), never on a request: a readiness check that
// waited on a hung API server would hang the kubelet's probe with it.
type Health struct {
	// Probe is one cheap call to the API server (its /readyz), bounded by ctx.
	Probe func(ctx context.Context) error
	// Every is how often Probe runs, each bounded by as long; Within is how recent its
	// last success must be. Zero: DefaultProbeEvery, DefaultReadyWithin.
	Every, Within time.Duration
	// Limit, when not nil: a replica whose every slot is held is not ready.
	Limit *Limit
	// Now is the clock; nil: time.Now.
	Now func() time.Time

	mu      sync.Mutex
	last    time.Time // the last success
	lastErr error     // the last failure since it, if any
}

func (h *Health) now() time.Time {
	if h.Now != nil {
		return h.Now()
	}
	return time.Now()
}

func (h *Health) every() time.Duration {
	if h.Every > 0 {
		return h.Every
	}
	return DefaultProbeEvery
}

func (h *Health) within() time.Duration {
	if h.Within > 0 {
		return h.Within
	}
	return DefaultReadyWithin
}

// Check runs Probe once, bounded by Every, and records what it said.
func (h *Health) Check(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, h.every())
	defer cancel()
	err := h.Probe(ctx)
	h.mu.Lock()
	defer h.mu.Unlock()
	if err == nil {
		h.last, h.lastErr = h.now(), nil
	} else {
		h.lastErr = err
	}
}

// Run checks at once, then every Every, until ctx ends.
func (h *Health) Run(ctx context.Context) {
	t := time.NewTicker(h.every())
	defer t.Stop()
	for {
		h.Check(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Ready says whether the replica should get requests, and if not, why.
func (h *Health) Ready() (bool, string) {
	h.mu.Lock()
	last, lastErr := h.last, h.lastErr
	h.mu.Unlock()
	if last.IsZero() {
		if lastErr != nil {
			return false, fmt.Sprintf("api server: not answered yet (%v)", lastErr)
		}
		return false, "api server: not answered yet"
	}
	if age := h.now().Sub(last); age > h.within() {
		return false, fmt.Sprintf("api server: no answer for %s, over %s (%v)", age.Round(time.Second), h.within(), lastErr)
	}
	if h.Limit != nil && h.Limit.Saturated() {
		return false, fmt.Sprintf("exchange: all %d slots held", cap(h.Limit.slots))
	}
	return true, ""
}

// Healthz answers 200 while the process serves: whether the API server answers is
// readiness, not liveness (a restart would not make it answer).
func (h *Health) Healthz(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	io.WriteString(w, "ok\n")
}

// Readyz answers 200 when Ready, else 503 saying why.
func (h *Health) Readyz(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	ok, why := h.Ready()
	if !ok {
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, why+"\n")
		return
	}
	io.WriteString(w, "ok\n")
}
