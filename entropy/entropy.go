// Package entropy keeps the boot path off the kernel's random pool wherever no secret is
// made, and bounds the wait where one is.
//
// Until the kernel's crng is initialised, getrandom(2) without GRND_NONBLOCK blocks
// (drivers/char/random.c, wait_for_random_bytes). A node whose CPU RNG the kernel does
// not trust (random.trust_cpu=off, a VM without RDRAND or virtio-rng, a CPU with a
// known-bad RDRAND) can wait a minute or more for it after boot. A DHCP transaction ID
// or a temp file name needs no secrecy: they come from the Go runtime's generator
// (math/rand/v2, seeded from the kernel's AT_RANDOM without waiting). What needs a secret
// (a TLS session key, a generated signing key) calls Wait first: it returns when the
// pool is ready or fails at the caller's deadline, and says what it waited for.
package entropy

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// Waiting is what a caller that waits reports: the console, log and an abandoned stage
// name it.
const Waiting = "the kernel's random pool"

// Pool tells, without blocking, whether the kernel's random pool is ready.
type Pool interface {
	Ready() (bool, error)
}

// Kernel is the running kernel's pool: getrandom(2) with GRND_NONBLOCK fails with EAGAIN
// until the crng is initialised, and never blocks.
type Kernel struct{}

// Ready implements Pool.
func (Kernel) Ready() (bool, error) {
	var b [1]byte
	_, err := unix.Getrandom(b[:], unix.GRND_NONBLOCK)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
		return false, nil
	}
	return false, fmt.Errorf("getrandom(GRND_NONBLOCK): %w", err)
}

// Poll is how often Wait asks the pool again.
const Poll = 50 * time.Millisecond

// Wait returns nil once p is ready. When it is not at the first look, it calls note
// (when not nil) with "waiting for the kernel's random pool" and polls until ready or
// until ctx ends; the error then says it was waiting for the pool, and for what.
func Wait(ctx context.Context, p Pool, what string, note func(string)) error {
	if p == nil {
		p = Kernel{}
	}
	start := time.Now()
	t := time.NewTicker(Poll)
	defer t.Stop()
	for first := true; ; first = false {
		ok, err := p.Ready()
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if ok {
			return nil
		}
		if first && note != nil {
			note(fmt.Sprintf("%s: waiting for %s", what, Waiting))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: waiting for %s, not ready after %s: %w", what, Waiting, time.Since(start).Round(time.Millisecond), ctx.Err())
		case <-t.C:
		}
	}
}
