package netboot

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"

	"github.com/passage-boot/passage/entropy"
	"github.com/passage-boot/passage/entropy/entropytest"
)

// within runs f and fails the test if it has not returned after d: a call that blocks on
// a blocked random source never returns on its own.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s still running after %v: it waits on the random source", what, d)
	}
}

// The library's own way to build a DISCOVER draws its xid from the random source
// entropytest blocks: the seam is real, and the test below would catch a return to it.
func TestLibraryDiscoveryWaitsOnBlockedSource(t *testing.T) {
	blk := entropytest.Block(t)
	saved := dhcpv4.RandomTimeout
	dhcpv4.RandomTimeout = 50 * time.Millisecond
	defer func() { dhcpv4.RandomTimeout = saved }()
	_, err := dhcpv4.NewDiscovery(net.HardwareAddr{0x52, 0x54, 0, 0, 0, 1})
	if err == nil || blk.Calls() == 0 {
		t.Fatalf("dhcpv4.NewDiscovery with a blocked source: err %v after %d reads; want it to wait and fail", err, blk.Calls())
	}
}

// A whole DHCP exchange with every random source blocked: the lease comes, and nothing
// read from them.
func TestAcquireWithBlockedRandomSource(t *testing.T) {
	srv := dhcpServer(t, true, true)
	c := loopbackClient(t, srv, DHCPPolicy{Timeout: 500 * time.Millisecond, Tries: 3})
	blk := entropytest.Block(t)
	var waited []string
	p := DefaultDHCP
	p.Waiting = func(what string) func() { waited = append(waited, what); return func() {} }
	var le Lease
	var err error
	within(t, 10*time.Second, "Acquire", func() { le, err = Acquire(context.Background(), c, "eth0", p) })
	if err != nil {
		t.Fatal(err)
	}
	if le.CIDR != "10.0.2.15/24" {
		t.Errorf("lease %+v", le)
	}
	if n := blk.Calls(); n != 0 {
		t.Errorf("%d reads from a blocked random source during DHCP", n)
	}
	if len(waited) != 2 || !strings.HasPrefix(waited[0], "a DHCP OFFER on eth0 (xid 0x") || !strings.HasPrefix(waited[1], "a DHCP ACK on eth0 from 10.0.2.2") {
		t.Errorf("waits reported %q", waited)
	}
}

// Transaction IDs are not constant: a fixed xid would pair one node's replies with
// another's on a shared segment.
func TestTransactionIDVaries(t *testing.T) {
	blk := entropytest.Block(t)
	seen := map[dhcpv4.TransactionID]bool{}
	within(t, 5*time.Second, "TransactionID", func() {
		for i := 0; i < 64; i++ {
			seen[TransactionID()] = true
		}
	})
	if len(seen) < 60 || blk.Calls() != 0 {
		t.Errorf("%d distinct xids of 64, %d reads from the blocked source", len(seen), blk.Calls())
	}
}

// Publishing over https needs TLS session keys: with the pool never ready it waits until
// its deadline, says so, and sends nothing. Over http it needs no secret and does not
// wait. With the pool ready, https goes through.
func TestPublishWaitsForThePoolOnlyForTLS(t *testing.T) {
	var posts int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { posts++ })
	tlsSrv := httptest.NewTLSServer(h)
	defer tlsSrv.Close()
	plain := httptest.NewServer(h)
	defer plain.Close()

	pool := &entropytest.NotReady{}
	var waited, notes []string
	p := PublishPolicy{Tries: 1, PerTry: time.Second, Pool: pool,
		Waiting: func(what string) func() { waited = append(waited, what); return func() {} },
		Note:    func(s string) { notes = append(notes, s) }}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	att, err := Publish(ctx, tlsSrv.Client(), tlsSrv.URL, []byte("{}"), p)
	if err == nil || !strings.Contains(err.Error(), "waiting for the kernel's random pool") || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("https with the pool not ready: err = %v", err)
	}
	if len(att) != 0 || posts != 0 || pool.Looks() < 2 {
		t.Errorf("https with the pool not ready: %d attempts, %d posts, %d looks at the pool", len(att), posts, pool.Looks())
	}
	if len(notes) != 1 || notes[0] != "publish "+tlsSrv.URL+": TLS: waiting for the kernel's random pool" {
		t.Errorf("notes %q", notes)
	}
	if len(waited) == 0 || waited[0] != entropy.Waiting {
		t.Errorf("waits reported %q, want %q first", waited, entropy.Waiting)
	}

	looks := pool.Looks()
	if _, err := Publish(context.Background(), plain.Client(), plain.URL, []byte("{}"), p); err != nil || posts != 1 || pool.Looks() != looks {
		t.Errorf("http with the pool not ready: err %v, %d posts, pool asked %d more times", err, posts, pool.Looks()-looks)
	}

	p.Pool = entropy.Kernel{} // this test machine's pool is ready
	if _, err := Publish(context.Background(), tlsSrv.Client(), tlsSrv.URL, []byte("{}"), p); err != nil || posts != 2 {
		t.Errorf("https with the pool ready: err %v, %d posts", err, posts)
	}
}
