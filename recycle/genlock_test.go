package recycle_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/recycle"
)

// pcr13 is a TPM's PCR 13 in its sha256 bank: each extend is atomic, as a TPM's
// commands are, and in the order they arrive.
type pcr13 struct {
	mu sync.Mutex
	v  []byte
}

func (p *pcr13) PCR() int        { return 13 }
func (p *pcr13) Banks() []string { return []string{"sha256"} }
func (p *pcr13) Extend(d map[string][]byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.v == nil {
		p.v = make([]byte, sha256.Size)
	}
	h := sha256.New()
	h.Write(p.v)
	h.Write(d["sha256"])
	p.v = h.Sum(nil)
	return nil
}

// TestGenerationWritersSerialised: two writers of generations on one node, each as a
// process of its own would be (no shared Writes mutex, each its own open of the lock
// file), race to write generations (unbind's recycle.Withdraw, one per unit). Afterwards
// every generation is in the event log once, in the order of the counter, and the log
// replays to the PCR: the next attestation of the node can be verified.
func TestGenerationWritersSerialised(t *testing.T) {
	n := newNode(t)
	pcr := &pcr13{}
	const each = 4
	var wg sync.WaitGroup
	errs := make(chan error, 2*each)
	for _, unit := range []int{2, 5} {
		addr := n.ctrlAddr(t, unit)
		wg.Go(func() {
			for range each {
				o := n.opts()
				o.Measurer = pcr
				o.Who = "writer gpu" + string(rune('0'+unit))
				if _, _, err := recycle.Withdraw(context.Background(), o, []pci.Address{addr}, "test"); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	l, err := manifest.ReadEventLog(filepath.Join(n.dir, recycle.EnvelopeName+manifest.EventLogSuffix))
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Events) != 2*each {
		t.Errorf("%d events logged, want %d (one per generation written)", len(l.Events), 2*each)
	}
	for i := 1; i < len(l.Events); i++ {
		if l.Events[i].Generation <= l.Events[i-1].Generation {
			t.Errorf("event %d: generation %d after %d", i, l.Events[i].Generation, l.Events[i-1].Generation)
		}
	}
	replay, err := l.Replay()
	if err != nil {
		t.Fatal(err)
	}
	pcr.mu.Lock()
	got := hex.EncodeToString(pcr.v)
	pcr.mu.Unlock()
	if replay["sha256"] != got {
		t.Errorf("the event log replays to %s, PCR 13 holds %s: no later attestation verifies", replay["sha256"], got)
	}
	if last := n.latest(t); last.Generation != l.Events[len(l.Events)-1].Generation {
		t.Errorf("manifest generation %d, the log's last %d", last.Generation, l.Events[len(l.Events)-1].Generation)
	}
}

// TestGenerationLockHeld: while another writer holds the node's generation lock, a
// generation is not written: the wait is bounded and the error names the holder; the
// counter, the manifest and the log are as they were.
func TestGenerationLockHeld(t *testing.T) {
	n := newNode(t)
	o := n.opts()
	if _, _, err := recycle.Withdraw(context.Background(), o, []pci.Address{n.ctrlAddr(t, 1)}, "first"); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(n.gen)
	env, _ := os.ReadFile(filepath.Join(n.dir, recycle.EnvelopeName))
	held, err := manifest.LockGenerations(context.Background(), n.dir, "passage-dra turnaround gpu4", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Unlock()
	o = n.opts()
	o.LockWait = 20 * time.Millisecond
	_, _, err = recycle.Withdraw(context.Background(), o, []pci.Address{n.ctrlAddr(t, 2)}, "second")
	if !errors.Is(err, manifest.ErrLocked) || !strings.Contains(err.Error(), "passage-dra turnaround gpu4") {
		t.Fatalf("generation written while the lock was held elsewhere: err %v", err)
	}
	after, _ := os.ReadFile(n.gen)
	env2, _ := os.ReadFile(filepath.Join(n.dir, recycle.EnvelopeName))
	if !bytes.Equal(before, after) || !bytes.Equal(env, env2) {
		t.Errorf("counter %q -> %q, manifest changed %v: the refused writer wrote", before, after, !bytes.Equal(env, env2))
	}
}
