package stages

import (
	"context"
	"errors"
	"strings"
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
