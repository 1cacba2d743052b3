package erase_test

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
)

// fakeClock steps time instead of sleeping.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
	return ctx.Err()
}

func opts(clk *fakeClock) erase.Options {
	return erase.Options{SanitizeTimeout: time.Minute, PollInterval: time.Second, Samples: 16, Now: clk.Now, Sleep: clk.Sleep}
}

var marker = bytes.Repeat([]byte("TENANT-A-SECRET!"), 32) // one 512-byte block

// dirty writes the marker at the first, a middle and the last block of every namespace.
func dirty(c *erasetest.Controller) {
	for _, n := range c.Namespaces {
		for _, lba := range []uint64{0, n.Blocks / 2, n.Blocks - 1} {
			c.Write(n.NSID, lba, marker)
		}
	}
}

func twoNS() []erasetest.Namespace {
	return []erasetest.Namespace{{NSID: 1, Blocks: 1 << 20}, {NSID: 2, Blocks: 4096, DLFEAT: 0b010}}
}

// TestMethodOrder: the strongest method the controller advertises is used, in NIST SP
// 800-88 order, and every namespace reads back clean.
func TestMethodOrder(t *testing.T) {
	for _, tc := range []struct {
		name    string
		sanicap uint32
		fna     uint8
		format  bool
		over    bool
		want    erase.Method
	}{
		{"crypto and block: crypto", erase.SANICAPCES | erase.SANICAPBES, 0, true, false, erase.SanitizeCrypto},
		{"block only", erase.SANICAPBES, erase.FNACrypto, true, false, erase.SanitizeBlock},
		{"no sanitize, crypto format", 0, erase.FNACrypto, true, false, erase.FormatCrypto},
		{"no sanitize, format only (QEMU's hw/nvme)", 0, 0, true, false, erase.FormatUserData},
		{"format applies to all namespaces", 0, erase.FNAFormatAll, true, false, erase.FormatUserData},
		{"overwrite only when asked", erase.SANICAPOWS, 0, false, true, erase.SanitizeOverwrite},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := erasetest.New("S1", tc.sanicap, tc.fna, tc.format, twoNS()...)
			dirty(c)
			o := opts(&fakeClock{})
			o.Overwrite = tc.over
			r := erase.Erase(context.Background(), c, o)
			if !r.Erased() || r.Method != tc.want {
				t.Fatalf("method %q err %q, want %q erased", r.Method, r.Err, tc.want)
			}
			for _, n := range c.Namespaces {
				if c.Dirty(n.NSID) != 0 {
					t.Errorf("ns %d: %d blocks still hold data", n.NSID, c.Dirty(n.NSID))
				}
			}
			if r.VerifiedLBAs != 32 || r.NS[0].Verified != 16 || r.NS[1].Verified != 16 {
				t.Errorf("verified %d (%+v), want 16 per namespace", r.VerifiedLBAs, r.NS)
			}
			if r.Serial != "S1" || r.Model == "" || r.Firmware == "" || len(r.NS) != 2 || r.NS[1].Blocks != 4096 || r.NS[0].BlockSize != 512 {
				t.Errorf("record %+v", r)
			}
		})
	}
}

// TestOverwriteNotWithoutPolicy: a controller that only overwrites is not erased unless
// the policy names overwrite.
func TestOverwriteNotWithoutPolicy(t *testing.T) {
	c := erasetest.New("S1", erase.SANICAPOWS, 0, false, twoNS()...)
	dirty(c)
	r := erase.Erase(context.Background(), c, opts(&fakeClock{}))
	if r.Erased() || !strings.Contains(r.Err, "no erase method") {
		t.Fatalf("erased %v err %q, want no erase method", r.Erased(), r.Err)
	}
	for _, cmd := range c.Commands() {
		if cmd.Opcode == erase.OpSanitize {
			t.Errorf("sanitize sent: %+v", cmd)
		}
	}
}

// TestFaults: every fault at the ioctl boundary ends with the controller not erased and
// the reason in the record, or with a fallback that is recorded.
func TestFaults(t *testing.T) {
	for _, tc := range []struct {
		name       string
		sanicap    uint32
		format     bool
		faults     erasetest.Faults
		erased     bool
		method     erase.Method
		err        string
		attempts   int
		dataRemain bool
	}{
		{"sanitize advertised but refused: falls back to format", erase.SANICAPCES | erase.SANICAPBES, true,
			erasetest.Faults{Refuse: map[uint8]bool{erase.OpSanitize: true}}, true, erase.FormatUserData, "", 3, false},
		{"sanitize refused, no format: nothing left", erase.SANICAPBES, false,
			erasetest.Faults{Refuse: map[uint8]bool{erase.OpSanitize: true}}, false, "", "every erase method was refused", 1, true},
		{"command error", erase.SANICAPBES, true,
			erasetest.Faults{ErrorStatus: map[uint8]erase.Status{erase.OpSanitize: 0x4006}}, false, "", "sanitize: status 0x4006 (internal error", 1, true},
		{"sanitize never completes: deadline", erase.SANICAPBES, true,
			erasetest.Faults{SanitizeStuck: true}, false, "", "sanitize still in progress", 1, true},
		{"sanitize fails", erase.SANICAPCES, true,
			erasetest.Faults{SanitizeFails: true}, false, "", "the sanitize failed", 1, true},
		{"verification finds data", erase.SANICAPCES, true,
			erasetest.Faults{KeepData: true}, false, erase.SanitizeCrypto, "data remains", 1, true},
		{"format leaves data", 0, true,
			erasetest.Faults{KeepData: true}, false, erase.FormatUserData, "data remains", 1, true},
		{"device vanishes mid-erase", erase.SANICAPBES, true,
			erasetest.Faults{VanishAfter: 5}, false, "", "no such device", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := erasetest.New("S1", tc.sanicap, 0, tc.format, twoNS()...)
			c.Faults = tc.faults
			dirty(c)
			r := erase.Erase(context.Background(), c, opts(&fakeClock{}))
			if r.Erased() != tc.erased || r.Method != tc.method {
				t.Fatalf("erased %v method %q err %q, want erased %v method %q", r.Erased(), r.Method, r.Err, tc.erased, tc.method)
			}
			if !strings.Contains(r.Err, tc.err) {
				t.Errorf("err %q, want %q", r.Err, tc.err)
			}
			if len(r.Attempts) != tc.attempts {
				t.Errorf("attempts %+v, want %d", r.Attempts, tc.attempts)
			}
			if got := c.Dirty(1) > 0; got != tc.dataRemain {
				t.Errorf("data remains %v, want %v", got, tc.dataRemain)
			}
		})
	}
}

// TestDeadlineFromContext: a sanitize that never completes also ends with ctx.
func TestDeadlineFromContext(t *testing.T) {
	c := erasetest.New("S1", erase.SANICAPBES, 0, false, twoNS()...)
	c.Faults.SanitizeStuck = true
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	r := erase.Erase(ctx, c, erase.Options{PollInterval: 5 * time.Millisecond})
	if r.Erased() || !strings.Contains(r.Err, "deadline exceeded") {
		t.Fatalf("erased %v err %q, want a deadline", r.Erased(), r.Err)
	}
}

func TestSampleCoversEnds(t *testing.T) {
	c := erasetest.New("S1", 0, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1000})
	c.Faults.KeepData = true
	c.Write(1, 999, marker) // only the last block
	r := erase.Erase(context.Background(), c, opts(&fakeClock{}))
	if r.Erased() || !strings.Contains(r.Err, "lba 999") {
		t.Fatalf("err %q, want the last block found", r.Err)
	}
}
