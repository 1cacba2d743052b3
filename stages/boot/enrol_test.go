package boot

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/attest/verifiertest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/stages"
)

// TestPublishNetOff: with passage.net=off the publish stage needs only the manifest (no
// network stage to wait for), and publishes only to a loopback passage.url: any other
// host is skipped naming it and why, before any request, and the stage's client refuses
// to dial a non-loopback address even when a name resolves to one.
func TestPublishNetOff(t *testing.T) {
	needs := func(cmdline string) []string {
		for _, s := range (&Boot{Config: initramfs.ParseCmdline(cmdline)}).Stages() {
			if s.Name == "publish" {
				return s.Needs
			}
		}
		return nil
	}
	if n := needs("passage.net=off passage.url=http://127.0.0.1/"); !reflect.DeepEqual(n, []string{"manifest"}) {
		t.Errorf("passage.net=off: publish needs %v, want [manifest]", n)
	}
	for _, c := range []string{"", "passage.net=eth0", "passage.net=auto"} {
		if n := needs(c); !slices.Contains(n, "network") || !slices.Contains(n, "manifest") {
			t.Errorf("%q: publish needs %v, want network and manifest", c, n)
		}
	}

	b := &Boot{Config: initramfs.ParseCmdline("passage.net=off passage.url=http://192.0.2.1:8080/passage"),
		Signed: &manifest.Signed{Envelope: []byte("{}"), Digest: "sha256:00"}}
	var r stages.Result
	err := b.publish(context.Background(), &stages.State{}, &r)
	if err == nil || !strings.Contains(err.Error(), `passage.url host "192.0.2.1" is not loopback`) || len(r.Findings) != 0 {
		t.Errorf("publish to 192.0.2.1 with passage.net=off: %v %v, want skipped naming the host", err, r.Findings)
	}

	// TEST-NET-1 (RFC 5737) is never routed: the dial is refused before any packet.
	hc := b.publishClient()
	hc.Timeout = 5 * time.Second // without the guard, the test fails instead of hanging
	_, err = hc.Get("http://192.0.2.1:9/")
	if err == nil || !strings.Contains(err.Error(), "not a loopback address (passage.net=off)") {
		t.Errorf("the net=off client dialled 192.0.2.1: %v", err)
	}
	if (&Boot{Config: initramfs.ParseCmdline("passage.net=auto")}).publishClient() != nil {
		t.Error("passage.net=auto: a guarded client, want the default")
	}
}

// TestPublishEnrolBounded: every request of the enrolment is bounded and retried as the
// envelope's is: a control plane answering 503 to the activation, or to the attestation,
// gets exactly the policy's tries, with its backoff between them, and the publish stage
// ends degraded naming the status and reason, with no further request.
func TestPublishEnrolBounded(t *testing.T) {
	ca := attesttest.NewCA(t)
	tpm := attesttest.Start(t, ca)
	open := func(string) (manifest.Signer, manifest.Measurer, error) {
		k, err := tpmkey.New(noClose{tpm})
		if err != nil {
			return nil, nil, err
		}
		return k, k, nil
	}
	for _, tc := range []struct {
		name     string
		down     string
		exchange []string
		words    string
	}{
		{"activation", "application/vnd.passage.activation+json",
			[]string{"GET 200", "att 428", "act 503", "act 503", "act 503", "act 503", "act 503"},
			"enrolment: record node-"},
		{"attestation", "application/vnd.passage.attestation+json",
			[]string{"GET 200", "att 503", "att 503", "att 503", "att 503", "att 503"},
			"manifest.dsse.json.attest.json not posted: publish "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cp := verifiertest.NewEnrolling(t, filepath.Join(t.TempDir(), "nonces.json"),
				verifiertest.EnrolOptions{EKCA: ca.PEM(t), Unavailable: map[string]int{tc.down: 1000}})
			root, _ := signingNode(t)
			var waits []time.Duration
			p := netboot.DefaultPublish
			p.Sleep = func(_ context.Context, d time.Duration) error { waits = append(waits, d); return nil }
			p.Rand = func(int64) int64 { return 0 } // no jitter: the waits are the schedule's
			b := &Boot{Root: root, OpenTPM: open, PublishPolicy: &p,
				Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key passage.net=off passage.url=" + cp.URL)}
			rs, _ := run(t, b, "scan", "decide", "manifest", "publish")
			if rs[2].Status != stages.OK {
				t.Fatalf("manifest %s %v %v", rs[2].Status, rs[2].Err, rs[2].Findings)
			}
			pub := rs[3]
			if pub.Status != stages.Degraded {
				t.Errorf("publish %s %v, want degraded", pub.Status, pub.Findings)
			}
			var got []string
			short := strings.NewReplacer("application/vnd.passage.activation+json", "act", "application/vnd.passage.attestation+json", "att")
			for _, r := range cp.Requests()[1:] { // the envelope first
				got = append(got, short.Replace(r.Type)+" "+strconv.Itoa(r.Status))
			}
			if !reflect.DeepEqual(got, tc.exchange) {
				t.Errorf("exchange %v, want %v", got, tc.exchange)
			}
			want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second}
			if !reflect.DeepEqual(waits, want) {
				t.Errorf("waits %v, want %v (DefaultPublish's backoff, once)", waits, want)
			}
			all := strings.Join(pub.Findings, "\n")
			if !strings.Contains(all, tc.words) || !strings.Contains(all, "5 tries: 503 Service Unavailable: replica unavailable") {
				t.Errorf("publish findings lack %q and the last status:\n%s", tc.words, all)
			}
		})
	}
}

// TestPublishOfflineOpensNoTPM: when the control plane gives no nonce (503 to every GET)
// and takes the attestation as it is, the publish stage posts the manifest stage's
// attestation without opening the TPM again: the only open is the manifest stage's.
// The TPM is opened in publish only to quote over a nonce or to answer a challenge.
func TestPublishOfflineOpensNoTPM(t *testing.T) {
	ca := attesttest.NewCA(t)
	tpm := attesttest.Start(t, ca)
	var opens atomic.Int32
	open := func(string) (manifest.Signer, manifest.Measurer, error) {
		opens.Add(1)
		k, err := tpmkey.New(noClose{tpm})
		if err != nil {
			return nil, nil, err
		}
		return k, k, nil
	}
	var mu sync.Mutex
	var posted []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			http.Error(w, "no nonces here", http.StatusServiceUnavailable)
			return
		}
		mu.Lock()
		posted = append(posted, r.Header.Get("Content-Type"))
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	root, _ := signingNode(t)
	p := netboot.DefaultPublish
	p.Sleep = func(context.Context, time.Duration) error { return nil }
	b := &Boot{Root: root, OpenTPM: open, PublishPolicy: &p,
		Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key passage.net=off passage.url=" + srv.URL)}
	rs, _ := run(t, b, "scan", "decide", "manifest", "publish")
	if rs[2].Status != stages.OK || rs[3].Status != stages.OK {
		t.Fatalf("manifest %s, publish %s %v", rs[2].Status, rs[3].Status, rs[3].Findings)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{netboot.EnvelopeType, netboot.AttestationType}; !reflect.DeepEqual(posted, want) {
		t.Errorf("posted %v, want %v", posted, want)
	}
	if n := opens.Load(); n != 1 {
		t.Errorf("the TPM was opened %d times, want once (the manifest stage's): publish opened it to post the attestation as it is", n)
	}
}
