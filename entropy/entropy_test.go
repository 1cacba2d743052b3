package entropy_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/entropy"
	"github.com/passage-boot/passage/entropy/entropytest"
)

type readyAfter struct{ n, looks int }

func (r *readyAfter) Ready() (bool, error) { r.looks++; return r.looks > r.n, nil }

type broken struct{}

func (broken) Ready() (bool, error) { return false, errors.New("getrandom: ENOSYS") }

func TestWait(t *testing.T) {
	var notes []string
	note := func(s string) { notes = append(notes, s) }

	// Never ready: bounded by the context, and both the note and the error say why.
	pool := &entropytest.NotReady{}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Millisecond)
	defer cancel()
	err := entropy.Wait(ctx, pool, "tls session key", note)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) ||
		!strings.HasPrefix(err.Error(), "tls session key: waiting for the kernel's random pool, not ready after ") {
		t.Errorf("never ready: %v", err)
	}
	if len(notes) != 1 || notes[0] != "tls session key: waiting for the kernel's random pool" {
		t.Errorf("notes %q, want one", notes)
	}
	if pool.Looks() < 2 {
		t.Errorf("the pool was asked %d times in 120 ms", pool.Looks())
	}

	// Ready after a few looks: no error, one note.
	notes = nil
	if err := entropy.Wait(context.Background(), &readyAfter{n: 2}, "key", note); err != nil || len(notes) != 1 {
		t.Errorf("ready after 2 looks: %v, notes %q", err, notes)
	}
	// Ready at once: no note.
	notes = nil
	if err := entropy.Wait(context.Background(), &readyAfter{}, "key", note); err != nil || len(notes) != 0 {
		t.Errorf("ready: %v, notes %q", err, notes)
	}
	// A pool that cannot be asked is an error naming the caller, not a wait.
	if err := entropy.Wait(context.Background(), broken{}, "key", note); err == nil || !strings.Contains(err.Error(), "key: getrandom: ENOSYS") {
		t.Errorf("broken pool: %v", err)
	}
}

// This machine's pool is ready long after boot: Kernel says so without blocking.
func TestKernelPoolReady(t *testing.T) {
	ok, err := entropy.Kernel{}.Ready()
	if err != nil || !ok {
		t.Errorf("Kernel.Ready = %v, %v on a running host", ok, err)
	}
}
