package netboot

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/entropy/entropytest"
)

// clock is a PublishPolicy's Now and Sleep: a sleep moves it on by what was waited, and
// records the wait. No real time passes.
type clock struct {
	mu    sync.Mutex
	t     time.Time
	waits []time.Duration
}

func newClock() *clock { return &clock{t: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)} }

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *clock) sleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.waits = append(c.waits, d)
	c.mu.Unlock()
	return ctx.Err()
}

// statusServer answers with codes in turn (the last repeats), each non-2xx with the
// Retry-After header given for it ("" for none).
func statusServer(t *testing.T, codes []int, after []string) (*httptest.Server, func() int) {
	t.Helper()
	var mu sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		i := min(n, len(codes)-1)
		n++
		mu.Unlock()
		if i < len(after) && after[i] != "" {
			w.Header().Set("Retry-After", after[i])
		}
		w.WriteHeader(codes[i])
		if codes[i]/100 != 2 {
			w.Write([]byte("busy\n"))
		}
	}))
	t.Cleanup(srv.Close)
	return srv, func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// TestRetryAfter: a 503 or 429 that says when to come back sets the next wait (seconds
// or an HTTP date), before jitter; one that says nonsense, or more than MaxRetryAfter,
// is ignored and the backoff waited; a Retry-After on a status that is not retried
// changes nothing.
func TestRetryAfter(t *testing.T) {
	c0 := newClock()
	for _, tc := range []struct {
		name  string
		codes []int
		after []string
		want  []time.Duration
		tries int
	}{
		{"seconds", []int{503, 200}, []string{"7"}, []time.Duration{7 * time.Second}, 2},
		{"429 seconds", []int{429, 200}, []string{"3"}, []time.Duration{3 * time.Second}, 2},
		{"http date", []int{503, 200}, []string{c0.now().Add(30 * time.Second).Format(http.TimeFormat)}, []time.Duration{30 * time.Second}, 2},
		{"date in the past: backoff", []int{503, 200}, []string{c0.now().Add(-time.Hour).Format(http.TimeFormat)}, []time.Duration{time.Second}, 2},
		{"absurd: backoff", []int{503, 200}, []string{"999999999"}, []time.Duration{time.Second}, 2},
		{"over an hour: backoff", []int{503, 200}, []string{"3601"}, []time.Duration{time.Second}, 2},
		{"negative: backoff", []int{503, 200}, []string{"-5"}, []time.Duration{time.Second}, 2},
		{"zero: backoff", []int{503, 200}, []string{"0"}, []time.Duration{time.Second}, 2},
		{"garbage: backoff", []int{503, 200}, []string{"soon"}, []time.Duration{time.Second}, 2},
		{"then none: backoff again", []int{503, 503, 200}, []string{"5", ""}, []time.Duration{5 * time.Second, 2 * time.Second}, 3},
		{"500 with it: backoff", []int{500, 200}, []string{"9"}, []time.Duration{time.Second}, 2},
		{"403 with it: no retry", []int{403}, []string{"9"}, nil, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := statusServer(t, tc.codes, tc.after)
			c := newClock()
			p := DefaultPublish
			p.Sleep, p.Now, p.Rand = c.sleep, c.now, noJitter
			att, _ := Publish(context.Background(), srv.Client(), srv.URL, []byte("{}"), p)
			if len(att) != tc.tries {
				t.Errorf("%d tries, want %d: %+v", len(att), tc.tries, att)
			}
			if len(c.waits) != len(tc.want) {
				t.Fatalf("waits %v, want %v", c.waits, tc.want)
			}
			for i := range tc.want {
				if c.waits[i] != tc.want[i] {
					t.Errorf("waits %v, want %v", c.waits, tc.want)
				}
			}
			if tc.name == "seconds" && att[0].RetryAfter != "7s" {
				t.Errorf("attempt %+v does not say the Retry-After taken", att[0])
			}
		})
	}
}

// TestJitter: every wait is spread. Backoff step d: within [d/2, d], so never longer
// than the schedule (Waits); Retry-After ra: within [ra, 3ra/2], never sooner than the
// server said. Drawn from math/rand/v2 by default, which reads nothing from a random
// source the kernel could block (entropytest.Block), and not the same wait for every
// node.
func TestJitter(t *testing.T) {
	blk := entropytest.Block(t)
	p := DefaultPublish
	seen := map[time.Duration]bool{}
	within(t, 5*time.Second, "jitter", func() {
		for range 200 {
			for _, d := range p.Waits() {
				w := p.jitter(d, false)
				if w < d/2 || w > d {
					t.Fatalf("backoff %v jittered to %v, outside [%v, %v]", d, w, d/2, d)
				}
				if d == time.Second {
					seen[w] = true
				}
			}
			ra := 60 * time.Second
			if w := p.jitter(ra, true); w < ra || w > ra+ra/2 {
				t.Fatalf("Retry-After %v jittered to %v, outside [%v, %v]", ra, w, ra, ra+ra/2)
			}
		}
	})
	if blk.Calls() != 0 {
		t.Errorf("%d reads from the blocked random source", blk.Calls())
	}
	if len(seen) < 100 {
		t.Errorf("200 draws of the first wait gave %d distinct waits: not spread", len(seen))
	}
	p.Rand = func(n int64) int64 { return n - 1 }
	if w := p.jitter(8*time.Second, false); w != 4*time.Second {
		t.Errorf("the most jitter takes 8s to %v, want 4s", w)
	}
	if w := p.jitter(10*time.Second, true); w != 15*time.Second {
		t.Errorf("the most jitter takes a Retry-After of 10s to %v, want 15s", w)
	}
}

// TestPublishFor: with For the exchange is bounded in time, not in tries: against a
// control plane answering 503 it goes on past Tries until For is spent, and stops
// without waiting past it; a Retry-After longer than what is left is not waited at all.
// A Retry-After within the budget is honoured even past Tries' count.
func TestPublishFor(t *testing.T) {
	srv, requests := statusServer(t, []int{503}, nil)
	c := newClock()
	p := DefaultPublish
	p.For, p.Sleep, p.Now = 2*time.Minute, c.sleep, c.now
	start := c.now()
	att, err := Publish(context.Background(), srv.Client(), srv.URL, []byte("{}"), p)
	if err == nil || !strings.Contains(err.Error(), "left") {
		t.Fatalf("err %v, want one saying what was left of the budget", err)
	}
	if len(att) <= p.Tries || requests() != len(att) {
		t.Errorf("%d tries (%d requests) in %v, want more than Tries=%d", len(att), requests(), p.For, p.Tries)
	}
	if spent := c.now().Sub(start); spent > p.For {
		t.Errorf("waited %v, past For %v", spent, p.For)
	}
	for i, w := range c.waits {
		if w > p.MaxBackoff || w <= 0 {
			t.Errorf("wait %d: %v, outside (0, %v]", i, w, p.MaxBackoff)
		}
	}

	// 20 s of budget, the server asks for 60: one try, no wait, the error says why.
	long, requests := statusServer(t, []int{503}, []string{"60"})
	c = newClock()
	p.For, p.Sleep, p.Now = 20*time.Second, c.sleep, c.now
	att, err = Publish(context.Background(), long.Client(), long.URL, []byte("{}"), p)
	if err == nil || len(att) != 1 || requests() != 1 || len(c.waits) != 0 ||
		!strings.Contains(err.Error(), "the server asks for 1m0s more (Retry-After)") || !strings.Contains(err.Error(), "busy") {
		t.Errorf("Retry-After past the budget: %d tries, waits %v, err %v", len(att), c.waits, err)
	}

	// Told 30 s six times, then 200: seven tries within For 5 m, Tries=5 no bound.
	told, _ := statusServer(t, []int{503, 503, 503, 503, 503, 503, 200}, []string{"30", "30", "30", "30", "30", "30"})
	c = newClock()
	p.For, p.Sleep, p.Now, p.Rand = 5*time.Minute, c.sleep, c.now, noJitter
	att, err = Publish(context.Background(), told.Client(), told.URL, []byte("{}"), p)
	if err != nil || len(att) != 7 || len(c.waits) != 6 || c.waits[5] != 30*time.Second {
		t.Errorf("told 30 s six times: %d tries, waits %v, err %v", len(att), c.waits, err)
	}

	// Without For a boot stays within Tries, as before.
	c = newClock()
	p = DefaultPublish
	p.Sleep, p.Now = c.sleep, c.now
	if att, _ := Publish(context.Background(), srv.Client(), srv.URL, []byte("{}"), p); len(att) != p.Tries {
		t.Errorf("no For: %d tries, want %d", len(att), p.Tries)
	}
}

// TestRetryAfterBoundedByContext: without For, a Retry-After longer than the caller's
// own deadline (the publish stage's) is not waited either.
func TestRetryAfterBoundedByContext(t *testing.T) {
	srv, requests := statusServer(t, []int{503}, []string{"60"})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := newClock()
	p := DefaultPublish
	p.Sleep, p.Now = c.sleep, c.now
	att, err := Publish(ctx, srv.Client(), srv.URL, []byte("{}"), p)
	if err == nil || len(att) != 1 || requests() != 1 || len(c.waits) != 0 {
		t.Errorf("Retry-After past the context's deadline: %d tries, waits %v, err %v", len(att), c.waits, err)
	}
}
