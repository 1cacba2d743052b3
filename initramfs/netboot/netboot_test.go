package netboot

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/insomniacslk/dhcp/dhcpv4/server4"
)

func TestCandidates(t *testing.T) {
	root := t.TempDir()
	net := filepath.Join(root, "sys", "class", "net")
	links := map[string]string{
		"eth0": "../../../devices/pci0000:00/0000:00:02.0/0000:01:00.0",
		"eth1": "../../../devices/pci0000:00/0000:00:03.0/0000:02:00.0",
		"usb0": "../../../devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0",
	}
	for n, target := range links {
		os.MkdirAll(filepath.Join(net, n), 0o755)
		if err := os.Symlink(target, filepath.Join(net, n, "device")); err != nil {
			t.Fatal(err)
		}
	}
	os.MkdirAll(filepath.Join(net, "lo"), 0o755) // no device link
	got, err := Candidates(root)
	if err != nil {
		t.Fatal(err)
	}
	want := []Iface{{"eth0", "0000:01:00.0"}, {"eth1", "0000:02:00.0"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Candidates = %v, want %v", got, want)
	}
	if _, err := Candidates(t.TempDir()); err == nil || !strings.Contains(err.Error(), "class/net") {
		t.Errorf("missing sysfs: err = %v", err)
	}
}

// dhcpServer answers on loopback only. respond=false makes it silent.
func dhcpServer(t *testing.T, respond bool, withMask bool) *net.UDPAddr {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	serverID := net.IPv4(10, 0, 2, 2)
	handler := func(c net.PacketConn, peer net.Addr, m *dhcpv4.DHCPv4) {
		if !respond {
			return
		}
		mt := dhcpv4.MessageTypeOffer
		if m.MessageType() == dhcpv4.MessageTypeRequest {
			mt = dhcpv4.MessageTypeAck
		}
		mods := []dhcpv4.Modifier{
			dhcpv4.WithMessageType(mt),
			dhcpv4.WithYourIP(net.IPv4(10, 0, 2, 15)),
			dhcpv4.WithServerIP(serverID),
			dhcpv4.WithOption(dhcpv4.OptServerIdentifier(serverID)),
			dhcpv4.WithRouter(net.IPv4(10, 0, 2, 2)),
			dhcpv4.WithLeaseTime(86400),
		}
		if withMask {
			mods = append(mods, dhcpv4.WithNetmask(net.CIDRMask(24, 32)))
		}
		// Not dhcpv4.NewReplyFromRequest: it draws an xid it then overwrites, from the
		// random source the entropy tests make block.
		resp, err := dhcpv4.FromBytes(m.ToBytes())
		if err != nil {
			t.Error(err)
			return
		}
		resp.Options = make(dhcpv4.Options)
		dhcpv4.WithReply(m)(resp)
		for _, mod := range mods {
			mod(resp)
		}
		c.WriteTo(resp.ToBytes(), peer)
	}
	srv, err := server4.NewServer("", nil, handler, server4.WithConn(conn))
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve()
	t.Cleanup(func() { srv.Close() })
	return conn.LocalAddr().(*net.UDPAddr)
}

func loopbackClient(t *testing.T, server *net.UDPAddr, p DHCPPolicy) *nclient4.Client {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	mac := net.HardwareAddr{0x52, 0x54, 0x00, 0x12, 0x34, 0x56}
	c, err := nclient4.NewWithConn(conn, mac, nclient4.WithServerAddr(server),
		nclient4.WithTimeout(p.Timeout), nclient4.WithRetry(p.Tries))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestAcquire(t *testing.T) {
	for _, withMask := range []bool{true, false} {
		srv := dhcpServer(t, true, withMask)
		c := loopbackClient(t, srv, DHCPPolicy{Timeout: 500 * time.Millisecond, Tries: 3})
		le, err := Acquire(context.Background(), c, "eth0", DefaultDHCP)
		if err != nil {
			t.Fatal(err)
		}
		wantCIDR := "10.0.2.15/24"
		if !withMask {
			wantCIDR = "10.0.2.15/8" // class A default
		}
		if le.CIDR != wantCIDR || !le.Router.Equal(net.IPv4(10, 0, 2, 2)) || !le.Server.Equal(net.IPv4(10, 0, 2, 2)) ||
			le.LeaseS != 86400 || le.MAC != "52:54:00:12:34:56" || le.Iface != "eth0" {
			t.Errorf("lease (mask %v) = %+v", withMask, le)
		}
		if d := le.Describe(); !strings.Contains(d, "eth0 52:54:00:12:34:56: "+wantCIDR+" via 10.0.2.2 (server 10.0.2.2, ") {
			t.Errorf("Describe = %q", d)
		}
		le.CarrierWait = "1.5s"
		if d := le.Describe(); !strings.HasSuffix(d, ", carrier wait 1.5s)") {
			t.Errorf("Describe with a carrier wait = %q", d)
		}
	}
}

func TestAcquireSilentServerIsBounded(t *testing.T) {
	srv := dhcpServer(t, false, true)
	c := loopbackClient(t, srv, DHCPPolicy{Timeout: 20 * time.Millisecond, Tries: 2})
	_, err := Acquire(context.Background(), c, "eth0", DefaultDHCP)
	if !errors.Is(err, nclient4.ErrNoResponse) || !strings.Contains(err.Error(), "dhcp eth0") {
		t.Errorf("err = %v, want ErrNoResponse naming eth0", err)
	}
	// The context bounds it too, whatever the policy.
	c2 := loopbackClient(t, srv, DHCPPolicy{Timeout: time.Hour, Tries: 10})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if _, err := Acquire(ctx, c2, "eth1", DefaultDHCP); err == nil {
		t.Error("no error from a silent server")
	}
}

// TestLinkUpNamesInterface: LinkUp and Up set the link up the same way and name the
// interface when it does not exist. The name is longer than IFNAMSIZ allows, so no
// interface of this machine can have it and nothing is touched.
func TestLinkUpNamesInterface(t *testing.T) {
	const name = "passage-no-such-if"
	err := LinkUp(name)
	if err == nil || !strings.HasPrefix(err.Error(), "net "+name+": ") {
		t.Fatalf("LinkUp err = %v, want one naming %s", err, name)
	}
	_, upErr := Up(context.Background(), name, DHCPPolicy{Timeout: time.Millisecond, Tries: 1})
	if upErr == nil || upErr.Error() != err.Error() {
		t.Errorf("Up err = %v, want LinkUp's %v", upErr, err)
	}
}

func TestLeaseFromACKNoAddress(t *testing.T) {
	ack, _ := dhcpv4.New()
	if _, err := leaseFromACK("eth0", ack); err == nil || !strings.Contains(err.Error(), "no address") {
		t.Errorf("err = %v", err)
	}
	if _, err := leaseFromACK("eth0", nil); err == nil {
		t.Error("nil ACK accepted")
	}
}

type recorder struct {
	mu    sync.Mutex
	waits []time.Duration
}

// noJitter is a PublishPolicy.Rand that takes none: the waits are exactly the schedule's.
func noJitter(int64) int64 { return 0 }

func (r *recorder) sleep(ctx context.Context, d time.Duration) error {
	r.mu.Lock()
	r.waits = append(r.waits, d)
	r.mu.Unlock()
	return ctx.Err()
}

func TestPublish(t *testing.T) {
	envelope := []byte(`{"payloadType":"application/vnd.passage.manifest+json","payload":"e30=","signatures":[]}`)
	tests := []struct {
		name      string
		codes     []int // status per request; the last repeats
		tries     int
		wantErr   bool
		wantCodes []int
		wantWaits []time.Duration
	}{
		{"first try", []int{200}, 5, false, []int{200}, nil},
		{"created", []int{201}, 5, false, []int{201}, nil},
		{"retries 503 then ok", []int{503, 502, 204}, 5, false, []int{503, 502, 204}, []time.Duration{time.Second, 2 * time.Second}},
		{"429 retried", []int{429, 200}, 5, false, []int{429, 200}, []time.Duration{time.Second}},
		{"400 not retried", []int{400}, 5, true, []int{400}, nil},
		{"always 500: bounded, backoff capped", []int{500}, 6, true, []int{500, 500, 500, 500, 500, 500},
			[]time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 8 * time.Second}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var mu sync.Mutex
			var n int
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				body, _ := io.ReadAll(r.Body)
				if r.Method != http.MethodPost || r.Header.Get("Content-Type") != EnvelopeType || string(body) != string(envelope) {
					t.Errorf("request %s %s %q", r.Method, r.Header.Get("Content-Type"), body)
				}
				mu.Lock()
				code := tt.codes[min(n, len(tt.codes)-1)]
				n++
				mu.Unlock()
				w.WriteHeader(code)
				io.WriteString(w, "reason text\n")
			}))
			defer srv.Close()
			rec := &recorder{}
			p := DefaultPublish
			p.Tries, p.Sleep, p.Rand = tt.tries, rec.sleep, noJitter
			att, err := Publish(context.Background(), srv.Client(), srv.URL, envelope, p)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v", err)
			}
			var codes []int
			for _, a := range att {
				codes = append(codes, a.Status)
			}
			if !reflect.DeepEqual(codes, tt.wantCodes) {
				t.Errorf("codes = %v, want %v", codes, tt.wantCodes)
			}
			if !reflect.DeepEqual(rec.waits, tt.wantWaits) {
				t.Errorf("waits = %v, want %v", rec.waits, tt.wantWaits)
			}
			if tt.wantErr && !strings.Contains(err.Error(), "reason text") {
				t.Errorf("err %v does not carry the server's reason", err)
			}
		})
	}
}

func TestPublishUnreachableAndTimeouts(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	url := srv.URL
	srv.Close() // nothing listens there now: connection refused on loopback
	rec := &recorder{}
	att, err := Publish(context.Background(), nil, url, []byte("{}"), PublishPolicy{Tries: 3, Backoff: time.Millisecond, Sleep: rec.sleep})
	if err == nil || len(att) != 3 || att[0].Status != 0 || att[0].Err == "" {
		t.Errorf("refused: %d attempts, err %v", len(att), err)
	}

	hang := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	defer slow.Close()
	defer close(hang)
	att, err = Publish(context.Background(), slow.Client(), slow.URL, []byte("{}"),
		PublishPolicy{Tries: 2, PerTry: 20 * time.Millisecond, Backoff: time.Millisecond, Sleep: rec.sleep})
	if err == nil || len(att) != 2 || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("per-try timeout: %d attempts, err %v", len(att), err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	att, err = Publish(ctx, slow.Client(), slow.URL, []byte("{}"), PublishPolicy{Tries: 5, Backoff: time.Hour})
	if err == nil || len(att) != 1 {
		t.Errorf("cancelled context: %d attempts, err %v", len(att), err)
	}
}

func TestPolicyWaits(t *testing.T) {
	got := DefaultPublish.Waits()
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("DefaultPublish.Waits = %v, want %v", got, want)
	}
	var total time.Duration
	for _, w := range got {
		total += w
	}
	total += time.Duration(DefaultPublish.Tries) * DefaultPublish.PerTry
	if total > time.Minute+30*time.Second {
		t.Errorf("default publish can take %v", total)
	}
}

// TestLeaseHostName: a DISCOVER and a REQUEST ask for option 12, and the lease keeps the
// name the server sent, its NUL padding trimmed (some servers count the terminator).
func TestLeaseHostName(t *testing.T) {
	for _, mt := range []dhcpv4.MessageType{dhcpv4.MessageTypeDiscover, dhcpv4.MessageTypeRequest} {
		if m := bootRequest(net.HardwareAddr{0x52, 0x54, 0, 0, 0, 1}, dhcpv4.TransactionID{1, 2, 3, 4}, mt); !m.IsOptionRequested(dhcpv4.OptionHostName) {
			t.Errorf("%s does not ask for the host name: %v", mt, m.ParameterRequestList())
		}
	}
	for _, c := range []struct{ sent, want string }{{"b300-r07-n3", "b300-r07-n3"}, {"b300-r07-n3\x00", "b300-r07-n3"}, {"", ""}} {
		mods := []dhcpv4.Modifier{dhcpv4.WithYourIP(net.IPv4(10, 0, 2, 15)), dhcpv4.WithNetmask(net.CIDRMask(24, 32))}
		if c.sent != "" {
			mods = append(mods, dhcpv4.WithOption(dhcpv4.OptHostName(c.sent)))
		}
		ack, err := dhcpv4.New(mods...)
		if err != nil {
			t.Fatal(err)
		}
		le, err := leaseFromACK("eth0", ack)
		if err != nil {
			t.Fatal(err)
		}
		if le.Hostname != c.want {
			t.Errorf("option 12 %q: lease host name %q, want %q", c.sent, le.Hostname, c.want)
		}
		if d := le.Describe(); (c.want != "") != strings.Contains(d, `host name "`+c.want+`"`) {
			t.Errorf("option 12 %q: Describe = %q", c.sent, d)
		}
	}
}
