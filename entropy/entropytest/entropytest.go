// Package entropytest makes the process's random sources block, as they do on a node
// whose kernel random pool is not ready yet, so a test can show that a boot-path call
// does not wait on them (or waits only as long as its deadline).
package entropytest

import (
	"context"
	cryptorand "crypto/rand"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"testing"

	uiorand "github.com/u-root/uio/rand"

	"github.com/passage-boot/passage/entropy"
)

// Blocked counts the reads that reached a blocked source.
type Blocked struct {
	calls   atomic.Int64
	release chan struct{}
	once    sync.Once
}

// Calls is how many reads reached a blocked source so far.
func (b *Blocked) Calls() int { return int(b.calls.Load()) }

// Block replaces, until t ends, the two random sources a Go boot path draws from:
// crypto/rand.Reader (what crypto/rand.Read and every API given rand.Reader use) and
// github.com/u-root/uio/rand.Reader (insomniacslk/dhcp's transaction IDs). Reads block
// until t ends (a context-aware read until its context is done) and are counted. The
// crypto/internal generator behind a nil io.Reader in Go 1.26 (crypto/tls, ecdsa with a
// nil reader) is not replaced: calls that need it wait through entropy.Wait, which a
// test gives a Pool that is never ready (NotReady).
//
// Tests that call Block must not run in parallel with others in the same process.
func Block(t testing.TB) *Blocked {
	b := &Blocked{release: make(chan struct{})}
	prevCrypto, prevUIO := cryptorand.Reader, uiorand.Reader
	cryptorand.Reader = cryptoReader{b}
	uiorand.Reader = uioReader{b}
	t.Cleanup(func() {
		cryptorand.Reader, uiorand.Reader = prevCrypto, prevUIO
		b.once.Do(func() { close(b.release) })
	})
	return b
}

// cryptoReader blocks until the test ends, then fills b: crypto/rand.Read treats a read
// error as fatal, and a goroutine still blocked here belongs to a test that has failed.
type cryptoReader struct{ b *Blocked }

func (r cryptoReader) Read(p []byte) (int, error) {
	r.b.calls.Add(1)
	<-r.b.release
	clear(p)
	return len(p), nil
}

type uioReader struct{ b *Blocked }

func (r uioReader) Read(p []byte) (int, error) { return r.ReadContext(context.Background(), p) }

func (r uioReader) ReadContext(ctx context.Context, p []byte) (int, error) {
	r.b.calls.Add(1)
	select {
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-r.b.release:
		return 0, errors.New("entropytest: the random source stayed blocked until the test ended")
	}
}

var _ io.Reader = cryptoReader{}

// NotReady is a kernel random pool that never becomes ready; it counts the looks.
type NotReady struct{ looks atomic.Int64 }

// Ready implements entropy.Pool.
func (p *NotReady) Ready() (bool, error) { p.looks.Add(1); return false, nil }

// Looks is how often the pool was asked.
func (p *NotReady) Looks() int { return int(p.looks.Load()) }

var _ entropy.Pool = (*NotReady)(nil)
