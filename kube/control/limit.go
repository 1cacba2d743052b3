package control

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Defaults of the bounds a Limit puts on the exchange.
const (
	// DefaultMaxInFlight requests at once do API work in a replica. Each may hold a body
	// of up to MaxAttestation bytes while it is decoded, so this, not the request rate,
	// is what bounds a replica's memory; the requests past it are answered at once.
	DefaultMaxInFlight = 16
	// DefaultDeadline is a request's time from its headers read to its answer: well
	// under a boot's try (netboot.DefaultPublish's PerTry, 10 s), so the boot hears 503
	// and Retry-After instead of timing out with nothing.
	DefaultDeadline = 8 * time.Second
	// DefaultRetryAfter and DefaultRetrySpread make Retry-After a whole number of
	// seconds from RetryAfter to RetryAfter+Spread, drawn per answer: the boots a storm
	// shed together do not come back together.
	DefaultRetryAfter  = 1 * time.Second
	DefaultRetrySpread = 4 * time.Second
	// maxAnswer bounds what a request's answer may buffer (the largest the exchange
	// writes is a challenge, maxChallenge).
	maxAnswer = 1 << 20
)

// Limit wraps the exchange (a Server) so that a replica never collapses under what
// strangers send: at most Slots requests are in Handler at once, one more is answered
// 503 with Retry-After without being read; an admitted request is answered by its
// Deadline, 503 with Retry-After if Handler has not finished by then. Handler's own 503s
// (the API failed) get a Retry-After too.
//
// A request answered at its deadline keeps its slot until Handler returns: what the
// slots bound is the work and memory really held, not the answers pending. Handler's
// API calls end by the same deadline (the request's context, and the client's
// rest.Config.Timeout for a call that ignores it).
type Limit struct {
	Handler  http.Handler
	Deadline time.Duration
	// Exempt, when not nil, names the requests that take no slot (still bounded by the
	// deadline): ones that do no API work and read no body.
	Exempt func(*http.Request) bool
	// RetryAfter and RetrySpread: see DefaultRetryAfter.
	RetryAfter, RetrySpread time.Duration
	Metrics                 *Metrics
	// Log hears a Handler panic after its request was answered. Nothing from the
	// request itself is logged here.
	Log *log.Logger

	slots chan struct{}
}

// NewLimit bounds h to slots requests at once, each answered within deadline.
func NewLimit(h http.Handler, slots int, deadline time.Duration, m *Metrics) *Limit {
	m.setSlots(slots)
	return &Limit{Handler: h, Deadline: deadline, RetryAfter: DefaultRetryAfter, RetrySpread: DefaultRetrySpread,
		Metrics: m, slots: make(chan struct{}, slots)}
}

// Saturated says whether every slot is held now.
func (l *Limit) Saturated() bool { return len(l.slots) == cap(l.slots) }

// Held is how many slots are held now.
func (l *Limit) Held() int { return len(l.slots) }

func (l *Limit) retryAfter() string {
	s := int(l.RetryAfter / time.Second)
	if n := int(l.RetrySpread / time.Second); n > 0 {
		s += rand.IntN(n + 1)
	}
	return strconv.Itoa(max(s, 1))
}

// unavailable answers 503 with Retry-After; why is fixed text, never the request's.
func (l *Limit) unavailable(w http.ResponseWriter, why string) {
	h := w.Header()
	h.Set("Retry-After", l.retryAfter())
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusServiceUnavailable)
	io.WriteString(w, why+"; retry after "+h.Get("Retry-After")+" s\n")
}

func (l *Limit) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	exempt := l.Exempt != nil && l.Exempt(r)
	if !exempt {
		select {
		case l.slots <- struct{}{}:
		default:
			l.Metrics.shed(ShedFull)
			l.unavailable(w, "passage-control: busy")
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), l.Deadline)
	defer cancel()
	a := &answer{h: http.Header{}}
	done := make(chan any, 1)
	l.Metrics.enter()
	go func() {
		defer func() {
			p := recover()
			if !exempt {
				<-l.slots
			}
			l.Metrics.leave()
			done <- p
		}()
		l.Handler.ServeHTTP(a, r.WithContext(ctx))
	}()
	finished := func(p any) {
		if p != nil {
			// As http.TimeoutHandler does: the server recovers it on its own goroutine
			// (and ErrAbortHandler keeps its meaning).
			panic(p)
		}
		a.writeTo(w, l)
	}
	select {
	case p := <-done:
		finished(p)
	case <-ctx.Done():
		select {
		case p := <-done: // finished as the deadline passed: its answer stands
			finished(p)
			return
		default:
		}
		a.abandon()
		if r.Context().Err() != nil {
			return // the client left: no one to answer
		}
		l.Metrics.shed(ShedDeadline)
		l.unavailable(w, "passage-control: no answer within "+l.Deadline.String())
		go func() {
			if p := <-done; p != nil && !errors.Is(asError(p), http.ErrAbortHandler) && l.Log != nil {
				l.Log.Printf("a request answered at its deadline then panicked: %v", p)
			}
		}()
	}
}

func asError(p any) error {
	if err, ok := p.(error); ok {
		return err
	}
	return fmt.Errorf("%v", p)
}

// answer is a Handler's response, held until it is known to come in time.
type answer struct {
	h    http.Header // the Handler's alone until it returns
	mu   sync.Mutex
	code int
	body bytes.Buffer
	over bool // the body passed maxAnswer
	gone bool // answered at the deadline: writes are dropped
}

func (a *answer) Header() http.Header { return a.h }

func (a *answer) WriteHeader(code int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.code == 0 {
		a.code = code
	}
}

func (a *answer) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.gone {
		return 0, http.ErrHandlerTimeout
	}
	if a.code == 0 {
		a.code = http.StatusOK
	}
	if a.body.Len()+len(p) > maxAnswer {
		a.over = true
		return 0, fmt.Errorf("answer over %d bytes", maxAnswer)
	}
	return a.body.Write(p)
}

func (a *answer) abandon() {
	a.mu.Lock()
	a.gone = true
	a.mu.Unlock()
}

// writeTo sends the answer, once the Handler has returned.
func (a *answer) writeTo(w http.ResponseWriter, l *Limit) {
	if a.over {
		http.Error(w, "passage-control: answer too large", http.StatusInternalServerError)
		return
	}
	h := w.Header()
	for k, v := range a.h {
		h[k] = v
	}
	code := a.code
	if code == 0 {
		code = http.StatusOK
	}
	if code == http.StatusServiceUnavailable && h.Get("Retry-After") == "" {
		h.Set("Retry-After", l.retryAfter())
	}
	h.Set("Content-Length", strconv.Itoa(a.body.Len()))
	w.WriteHeader(code)
	w.Write(a.body.Bytes())
}

// Shed reasons, the metrics' label.
const (
	ShedFull     = "full"     // every slot held: answered without being read
	ShedDeadline = "deadline" // admitted, not finished within the deadline
)
