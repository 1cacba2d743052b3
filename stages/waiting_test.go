package stages

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// An abandoned stage, one that returns its context's error and one that returns nil
// past its deadline are each named with what they were waiting on when time ran out.
func TestTimedOutStageNamesWhatItWaitedOn(t *testing.T) {
	block := make(chan struct{})
	defer close(block)
	rn := &Runner{
		Timeout: 20 * time.Millisecond,
		Grace:   20 * time.Millisecond,
		Stages: []Stage{
			{Name: "ignores", Run: func(_ context.Context, _ *State, r *Result) error {
				r.Wait("the kernel's random pool")
				<-block
				return nil
			}},
			{Name: "polite", Run: func(ctx context.Context, _ *State, r *Result) error {
				done := r.Wait("a DHCP OFFER on eth0")
				defer done()
				<-ctx.Done()
				return ctx.Err()
			}},
			{Name: "late-nil", Run: func(ctx context.Context, _ *State, r *Result) error {
				outer := r.Wait("carrier on eth0")
				inner := r.Wait("an ACK")
				inner() // back to the outer wait
				<-ctx.Done()
				_ = outer
				return nil
			}},
			{Name: "finished", Run: func(ctx context.Context, _ *State, r *Result) error {
				r.Wait("something")() // done before the deadline: nothing to name
				<-ctx.Done()
				return ctx.Err()
			}},
		},
	}
	rs, err := rn.Run(context.Background(), &State{})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"waiting for the kernel's random pool, and the stage did not return within 20ms: abandoned",
		"waiting for a DHCP OFFER on eth0",
		"waiting for carrier on eth0",
	}
	for i, w := range want {
		if rs[i].Status != Failed || rs[i].Err == nil || !strings.Contains(rs[i].Err.Error(), w) {
			t.Errorf("%s: %s %v, want failed naming %q", rs[i].Name, rs[i].Status, rs[i].Err, w)
		}
	}
	if !errors.Is(rs[1].Err, context.DeadlineExceeded) {
		t.Errorf("polite: %v does not wrap the deadline", rs[1].Err)
	}
	if strings.Contains(rs[3].Err.Error(), "waiting for") {
		t.Errorf("finished: %v names a wait that had ended", rs[3].Err)
	}
}

// lineWatch is a console that hands each "still waiting" line to a channel.
type lineWatch struct {
	mu    sync.Mutex
	all   strings.Builder
	still chan string
}

func (w *lineWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.all.Write(p)
	if s := string(p); strings.Contains(s, "still waiting") {
		select {
		case w.still <- s:
		default:
		}
	}
	return len(p), nil
}

func (w *lineWatch) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return strings.Count(w.all.String(), "still waiting")
}

// A stage that waits on something shows it on the console while it waits, as a start
// job does; one that waits on nothing, or no longer, shows no such line.
func TestWaitingStageShownWhileItWaits(t *testing.T) {
	w := &lineWatch{still: make(chan string, 1)}
	var seen string
	var atDone, afterDone int
	rn := &Runner{
		Console: w,
		Tick:    time.Millisecond,
		Timeout: time.Minute,
		Stages: []Stage{
			{Name: "quiet", Run: func(ctx context.Context, _ *State, r *Result) error {
				time.Sleep(20 * time.Millisecond) // many ticks, no wait named
				return nil
			}},
			{Name: "network", Run: func(ctx context.Context, _ *State, r *Result) error {
				done := r.Wait("a DHCP OFFER on eth0 (xid 0x1234)")
				select {
				case seen = <-w.still:
				case <-time.After(30 * time.Second):
					return errors.New("no still-waiting line within 30 s")
				}
				done()
				atDone = w.count()
				time.Sleep(20 * time.Millisecond) // many ticks after the wait ended
				afterDone = w.count()
				return nil
			}},
		},
	}
	rs, err := rn.Run(context.Background(), &State{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if r.Status != OK {
			t.Errorf("%s: %s %v", r.Name, r.Status, r.Err)
		}
	}
	if !strings.HasPrefix(seen, "passage: network: still waiting for a DHCP OFFER on eth0 (xid 0x1234) (") || !strings.HasSuffix(seen, " of 1m0s)\n") {
		t.Errorf("still-waiting line %q", seen)
	}
	w.mu.Lock()
	all := w.all.String()
	w.mu.Unlock()
	if strings.Contains(all, "quiet: still waiting") {
		t.Errorf("a stage that named no wait was shown waiting:\n%s", all)
	}
	// One tick may have read the wait just before it ended; none after.
	if afterDone > atDone+1 {
		t.Errorf("%d still-waiting lines when the wait ended, %d later: it went on being shown:\n%s", atDone, afterDone, all)
	}
}
