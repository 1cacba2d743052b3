package boot

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/metrics"
	"github.com/passage-boot/passage/stages"
)

// pushgateway starts Debian's prometheus-pushgateway on a free loopback port with its
// persistence in a temporary file, waits until it is ready, and stops it when the test
// ends. It returns the gateway's URL.
func pushgateway(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("prometheus-pushgateway")
	if err != nil {
		t.Fatalf("prometheus-pushgateway not found (image/deps.sh installs it): %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cmd := exec.Command(bin, "--web.listen-address="+addr, "--persistence.file="+filepath.Join(t.TempDir(), "pushgateway.db"))
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
	})
	url := "http://" + addr
	hc := &http.Client{Timeout: time.Second}
	for i := 0; i < 200; i++ {
		select {
		case <-done:
			t.Fatalf("pushgateway exited: %s", out)
		default:
		}
		if resp, err := hc.Get(url + "/-/ready"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return url
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("pushgateway on %s not ready in 10 s: %s", addr, out)
	return ""
}

var (
	reSample = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$`)
	reLabel  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)
)

// samples reads an exposition into "name{sorted labels} value" strings, leaving out
// the labels in drop.
func samples(t *testing.T, r io.Reader, drop ...string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		m := reSample.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		var ls []string
		for _, l := range reLabel.FindAllStringSubmatch(m[2], -1) {
			if !slices.Contains(drop, l[1]) {
				ls = append(ls, l[1]+"="+l[2])
			}
		}
		slices.Sort(ls)
		out[m[1]+"{"+strings.Join(ls, ",")+"} "+m[3]] = true
	}
	return out
}

func fakeNet(b *Boot) {
	b.LinkUp = func(string) error { return nil }
	b.NetUp = func(_ context.Context, ifs []string) ([]netboot.Lease, error) {
		return []netboot.Lease{{Iface: ifs[0], MAC: "52:54:00:00:00:01", CIDR: "10.0.2.15/24"}}, nil
	}
}

// TestPushToPushgateway boots the reference node with passage.push= pointing at a real
// Pushgateway: the textfile beside the manifest is what the gateway serves back, under
// job="passage" and the node's instance.
func TestPushToPushgateway(t *testing.T) {
	gw := pushgateway(t)
	bn := newBootNode(t)
	b := bn.boot(bootCmdline + " passage.push=" + gw)
	fakeNet(b)
	rs, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{})
	if err != nil {
		t.Fatal(err)
	}
	if r := resultOf(rs, "push"); r.Status != stages.OK {
		t.Fatalf("push %s %v %v", r.Status, r.Err, r.Findings)
	}
	text, err := os.Open(filepath.Join(bn.node.Root, "run/passage", metrics.TextfileName))
	if err != nil {
		t.Fatal(err)
	}
	defer text.Close()
	ours := samples(t, text)
	resp, err := http.Get(gw + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	back := samples(t, resp.Body)
	inst := b.metricsInstance
	if inst == "" {
		t.Fatal("no instance")
	}
	n := 0
	for s := range ours {
		name, rest, _ := strings.Cut(s, "{")
		labels, value, _ := strings.Cut(rest, "} ")
		ls := []string{"instance=" + inst, "job=passage"}
		if labels != "" {
			ls = append(ls, strings.Split(labels, ",")...)
		}
		slices.Sort(ls)
		if want := name + "{" + strings.Join(ls, ",") + "} " + value; !back[want] {
			t.Errorf("the gateway does not serve %s", want)
		}
		n++
	}
	if n < 50 || !ours["passage_unit_status{status=ready,unit=gpu7} 1"] {
		t.Errorf("%d samples in %s, gpu7 ready among them: %v", n, metrics.TextfileName, ours["passage_unit_status{status=ready,unit=gpu7} 1"])
	}
}

// hangingGateway accepts connections and never answers. It records whether the signed
// manifest was already on disk when the first connection came.
type hangingGateway struct {
	l         net.Listener
	mu        sync.Mutex
	conns     []net.Conn
	manifestA []bool // per connection: was the manifest on disk
}

func (g *hangingGateway) serve(bn *bootNode) {
	for {
		c, err := g.l.Accept()
		if err != nil {
			return
		}
		_, merr := bn.envelopeOnDisk()
		g.mu.Lock()
		g.conns = append(g.conns, c)
		g.manifestA = append(g.manifestA, merr == nil)
		g.mu.Unlock()
	}
}

// TestPushDeadGateway: a gateway that accepts and never answers, and one that refuses,
// leave the manifest as it is without them: the push stage fails, alone, within its
// bound, after the manifest was on disk.
func TestPushDeadGateway(t *testing.T) {
	for _, mode := range []string{"hangs", "refuses"} {
		t.Run(mode, func(t *testing.T) {
			bn := newBootNode(t)
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			g := &hangingGateway{l: l}
			if mode == "hangs" {
				go g.serve(bn)
			} else {
				l.Close()
			}
			defer func() {
				l.Close()
				g.mu.Lock()
				for _, c := range g.conns {
					c.Close()
				}
				g.mu.Unlock()
			}()
			// A hung gateway meets the stage's deadline; a refusing one must fail on its
			// own, 3 refused tries 1 s apart, well inside a deadline that a loaded machine
			// cannot reach.
			timeout := "2s"
			if mode == "refuses" {
				timeout = "30s"
			}
			b := bn.boot(bootCmdline + " passage.net_timeout=" + timeout + " passage.push=http://" + l.Addr().String())
			fakeNet(b)
			rs, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{})
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range rs {
				want := r.Status == stages.OK || r.Status == stages.Degraded || (r.Name == "publish" && r.Status == stages.Skipped) ||
					(r.Name == "erase" && r.Status == stages.Skipped) // bn.boot runs with passage.erase=off
				if r.Name == "push" {
					want = r.Status == stages.Failed
				}
				if !want {
					t.Errorf("stage %s: %s %v", r.Name, r.Status, r.Err)
				}
			}
			push := resultOf(rs, "push")
			switch mode {
			case "hangs":
				if !errors.Is(push.Err, context.DeadlineExceeded) {
					t.Errorf("push error %v, want its deadline", push.Err)
				}
				g.mu.Lock()
				if len(g.manifestA) == 0 || slices.Contains(g.manifestA, false) {
					t.Errorf("connections to the gateway with the manifest on disk: %v", g.manifestA)
				}
				g.mu.Unlock()
			case "refuses":
				if push.Err == nil || !strings.Contains(push.Err.Error(), "connection refused") {
					t.Errorf("push error %v, want the refused connection", push.Err)
				}
			}
			m, err := bn.envelopeOnDisk()
			if err != nil {
				t.Fatal(err)
			}
			for _, u := range m.Units {
				if u.Status != "ready" {
					t.Errorf("unit %s %s with a dead gateway", u.ID, u.Status)
				}
			}
			if got := stageNames(m); !slices.Equal(got, preManifest) {
				t.Errorf("manifest stages %v", got)
			}
			if _, err := os.Stat(filepath.Join(bn.node.Root, "run/passage", metrics.TextfileName)); err != nil {
				t.Errorf("textfile: %v", err)
			}
		})
	}
}
