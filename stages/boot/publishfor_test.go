package boot

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/stages"
)

// TestPublishFor: passage.publish_for makes the publish stage keep trying a busy control
// plane past DefaultPublish's 5 tries, waiting each 503's Retry-After, within its budget;
// the stage's deadline is the budget plus one try. Without the argument the stage keeps
// the runner's deadline and 5 tries.
func TestPublishFor(t *testing.T) {
	var mu sync.Mutex
	n := 0
	cp := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		i := n
		mu.Unlock()
		if i <= 8 {
			w.Header().Set("Retry-After", "20")
			http.Error(w, "replica busy", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	}))
	defer cp.Close()

	for _, tc := range []struct {
		args      string
		timeout   time.Duration
		tries     int
		delivered bool
	}{
		{"", 0, 5, false},
		{"passage.publish_for=30m", 30*time.Minute + netboot.DefaultPublish.PerTry, 9, true},
	} {
		mu.Lock()
		n = 0
		mu.Unlock()
		var waits []time.Duration
		now := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
		p := netboot.DefaultPublish
		p.Rand = func(int64) int64 { return 0 }
		p.Now = func() time.Time { return now }
		p.Sleep = func(_ context.Context, d time.Duration) error { waits = append(waits, d); now = now.Add(d); return nil }
		b := &Boot{Root: t.TempDir(), PublishPolicy: &p,
			Config: initramfs.ParseCmdline("passage.net=off passage.url=" + cp.URL + " " + tc.args)}
		b.Signed = &manifest.Signed{Envelope: []byte("{}"), Digest: "sha256:00"}
		for _, s := range b.Stages() {
			if s.Name == "publish" && s.Timeout != tc.timeout {
				t.Errorf("%q: publish stage deadline %v, want %v", tc.args, s.Timeout, tc.timeout)
			}
		}
		r := &stages.Result{}
		err := b.publish(context.Background(), nil, r)
		if (err == nil) != tc.delivered || len(r.Findings) != tc.tries {
			t.Errorf("%q: err %v, findings %q; want %d tries, delivered %v", tc.args, err, r.Findings, tc.tries, tc.delivered)
		}
		if tc.delivered {
			for i, w := range waits {
				if w != 20*time.Second {
					t.Errorf("%q: wait %d is %v, want the Retry-After of 20s", tc.args, i, w)
				}
			}
			if len(r.Changes) == 0 || !strings.Contains(r.Changes[0], "posted to") {
				t.Errorf("%q: changes %q", tc.args, r.Changes)
			}
		}
	}
}
