package attest

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"
)

// ErrBusy is a store that could not be locked within its bound: the caller is told to
// come back later (NonceHandler: 503 with Retry-After), never queued without end.
var ErrBusy = errors.New("busy: too many callers waiting for the lock")

// queueLock is the in-process half of a store's lock, taken before the file lock so
// that a process's goroutines wait parked in Go (a goroutine each), not blocked in
// flock(2) (an OS thread each: the runtime dies at its thread limit). Waiters queue in
// two lines: the priority line (Use: a genuine attestation, already checked against an
// enrolled TPM) is served before the other (Issue: anyone's GET), and the other is
// bounded in length and in waiting time.
type queueLock struct {
	mu       sync.Mutex
	held     bool
	priority []chan struct{}
	other    []chan struct{}
}

// lock waits until deadline for the lock; max bounds the waiters of the non-priority
// line (0: no bound). It returns ErrBusy when the line is full or the deadline passes.
func (q *queueLock) lock(priority bool, max int, deadline time.Time) error {
	q.mu.Lock()
	if !q.held {
		q.held = true
		q.mu.Unlock()
		return nil
	}
	if !priority && max > 0 && len(q.other) >= max {
		q.mu.Unlock()
		return fmt.Errorf("%w (%d waiting)", ErrBusy, max)
	}
	ch := make(chan struct{})
	if priority {
		q.priority = append(q.priority, ch)
	} else {
		q.other = append(q.other, ch)
	}
	q.mu.Unlock()
	start := time.Now()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-ch:
		return nil
	case <-t.C:
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, line := range []*[]chan struct{}{&q.priority, &q.other} {
		for i, c := range *line {
			if c == ch {
				*line = append((*line)[:i], (*line)[i+1:]...)
				return fmt.Errorf("%w (waited %s)", ErrBusy, time.Since(start).Round(time.Millisecond))
			}
		}
	}
	// Handed over (unlock closed ch) as the timer fired: the lock is ours.
	return nil
}

// unlock hands the lock to the first priority waiter, else to the first other one.
func (q *queueLock) unlock() {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, line := range []*[]chan struct{}{&q.priority, &q.other} {
		if len(*line) > 0 {
			ch := (*line)[0]
			*line = (*line)[1:]
			close(ch)
			return
		}
	}
	q.held = false
}

// flockWithin takes an exclusive flock(2) on path (created when missing) by polling
// LOCK_NB until deadline: no thread ever sleeps in the kernel for the lock, and the wait
// is bounded. flock locks belong to an open file description, so two callers in one
// process, each with its own open, exclude each other as two processes do. The lock
// is released by closing the returned file.
func flockWithin(path string, deadline time.Time) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	for pause := time.Millisecond; ; pause = min(2*pause, 20*time.Millisecond) {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("flock: %w", err)
		}
		if time.Now().Add(pause).After(deadline) {
			f.Close()
			return nil, fmt.Errorf("%w: held by another process", ErrBusy)
		}
		time.Sleep(pause)
	}
}
