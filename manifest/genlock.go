package manifest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// GenerationLockName is the lock file, beside the manifest and its event log, that every
// writer of a generation holds: the boot's manifest stage, passage recycle and unbind,
// the DRA plugin's turnaround and its quotes. A name starting with a dot, as WriteAtomic's
// temporary files do, so that nothing copying or showing the directory's files takes it
// for one of them.
const GenerationLockName = ".generation.lock"

// DefaultLockWait bounds how long a writer waits for the generation lock: a holder keeps
// it for one generation's write (sign, extend, log, quote: seconds on a slow TPM), not for
// a recycle's erase.
const DefaultLockWait = time.Minute

// ErrLocked is a generation lock another writer kept past the wait; the error names it.
var ErrLocked = errors.New("generation lock held")

// GenerationLock is the node's generation lock, held. A generation is one sequence that
// must not interleave with another's: read the counter, sign, append the event to the
// log, extend the PCR (and quote it). Two at once leave a log that does not replay to
// the PCR for the rest of that TPM boot (one append lost to the other's rewrite, or the
// extends in the other order), and every later attestation of the node fails.
//
// It is an exclusive flock(2) on GenerationLockName in the manifest's directory. flock
// belongs to an open file description: two processes, or two goroutines each with its
// own LockGenerations, exclude each other alike, and a holder that dies releases it.
// The holder writes who it is into the file, for the error of one that waits in vain.
type GenerationLock struct {
	f *os.File
}

// LockGenerations takes the generation lock of dir (created when missing), waiting at
// most wait (0: DefaultLockWait) and no longer than ctx. who names the holder in the
// error of a writer that waits in vain ("passage recycle gpu3"); the process id and the
// time are added. The wait polls a non-blocking flock, so no thread sleeps in the kernel
// and ctx is heard between polls. The error of a wait in vain wraps ErrLocked and says
// what the file names as its holder.
func LockGenerations(ctx context.Context, dir, who string, wait time.Duration) (*GenerationLock, error) {
	if wait <= 0 {
		wait = DefaultLockWait
	}
	path := filepath.Join(dir, GenerationLockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("generation lock: %w", err)
	}
	start := time.Now()
	deadline := start.Add(wait)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	for pause := time.Millisecond; ; pause = min(2*pause, 50*time.Millisecond) {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("generation lock %s: flock: %w", path, err)
		}
		if ctx.Err() != nil || time.Now().Add(pause).After(deadline) {
			holder := readHolder(path)
			f.Close()
			waited := time.Since(start).Round(time.Millisecond)
			if cerr := ctx.Err(); cerr != nil {
				return nil, fmt.Errorf("generation lock %s: %w after %s (held by %s): %w", path, ErrLocked, waited, holder, cerr)
			}
			return nil, fmt.Errorf("generation lock %s: %w: waited %s, held by %s", path, ErrLocked, waited, holder)
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
	// The lock is ours: say who holds it. A failed write only makes a waiter's error
	// vaguer.
	if err := f.Truncate(0); err == nil {
		fmt.Fprintf(f, "pid %d (%s) %s since %s\n", os.Getpid(), Printable(filepath.Base(os.Args[0])), Printable(who), time.Now().UTC().Format(time.RFC3339))
	}
	return &GenerationLock{f: f}, nil
}

// readHolder is what the lock file says of its holder, one line, bounded.
func readHolder(path string) string {
	b, err := ReadRegular(path, 512)
	s := strings.TrimSpace(Printable(string(b)))
	if err != nil || s == "" {
		return "another process (the lock file names none yet)"
	}
	return s
}

// Unlock releases the lock (closing the file releases the flock). The holder line stays
// until the next holder replaces it.
func (l *GenerationLock) Unlock() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}
