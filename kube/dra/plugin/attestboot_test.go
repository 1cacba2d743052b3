package plugin_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/recycle"
)

// front puts h in front of the rig's control plane (passage-control's real handler):
// h answers a request itself by returning true. The plugin's turnaround is pointed at
// it, each exchange tried once (the retries under test are AttestCurrent's own).
func (r *turnRig) front(t *testing.T, h func(w http.ResponseWriter, req *http.Request) bool) {
	t.Helper()
	ts := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if !h(w, req) {
			r.srv.ServeHTTP(w, req)
		}
	}))
	ts.StartTLS()
	t.Cleanup(ts.Close)
	r.cfg.Turnaround = r.turnaround(ts)
	if err := os.MkdirAll(r.cfg.StateDir, 0o750); err != nil { // the kubelet's plugin data directory
		t.Fatal(err)
	}
	r.cfg.Turnaround.Publish = netboot.PublishPolicy{Tries: 1, PerTry: 30 * time.Second}
}

// bootMeasured replaces the rig's manifest with the one a boot with its TPM writes: the
// next generation of the TPM's counter, signed by the TPM key and the key file, its
// digest logged and extended into PCR 13 (what the turnaround's attestation quotes).
func (r *turnRig) bootMeasured(t *testing.T) uint64 {
	t.Helper()
	rec, err := recycle.OpenRecorder(r.Root, r.cfg.Turnaround.Keys)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Close()
	m := *r.M
	m.BootID = noderig.BootID
	if m.Generation, m.GenerationSource, err = manifest.NextGeneration(rec.Counters...); err != nil {
		t.Fatal(err)
	}
	if _, err := manifest.WriteSigned(context.Background(), &m, rec.Dir, recycle.EnvelopeName, rec.Measurer, rec.Signers...); err != nil {
		t.Fatal(err)
	}
	if got := r.generation(t); got != m.Generation {
		t.Fatalf("the plugin's manifest is generation %d, the boot wrote %d", got, m.Generation)
	}
	return m.Generation
}

// TestAttestCurrentAfterBusy: a node whose boot delivered nothing (the control plane has
// no record of it) is attested from the host when the plugin starts, with no recycle and
// no reboot: the control plane answers 503 three times, then the plugin's fourth try
// enrols the TPM and the generation the host is on is verified; units.json records it.
// A plugin started again does not attest a generation already verified.
func TestAttestCurrentAfterBusy(t *testing.T) {
	r := newTurnRig(t)
	var mu sync.Mutex
	busy, nonces, posts := 3, 0, 0
	r.front(t, func(w http.ResponseWriter, req *http.Request) bool {
		mu.Lock()
		defer mu.Unlock()
		if req.Method == http.MethodGet {
			nonces++
		} else {
			posts++
		}
		if req.Method == http.MethodGet && busy > 0 {
			busy--
			w.Header().Set("Retry-After", "1")
			http.Error(w, "replica busy", http.StatusServiceUnavailable)
			return true
		}
		return false
	})
	gen := r.bootMeasured(t)
	if _, err := r.srv.Store.Node(context.Background(), r.M.Node.Hostname); err == nil {
		t.Fatal("the control plane has a record before anything was attested")
	}
	d, err := plugin.New(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runTurnaround(d)
	r.waitFor(t, "the host's generation verified", func() bool { return r.logs.has("attest: generation ") && r.logs.has(" verified by ") })
	stop()
	rec, err := r.srv.Store.Node(context.Background(), r.M.Node.Hostname)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status.Verdict != control.VerdictVerified || uint64(rec.Status.Generation) != gen {
		t.Errorf("control plane record: verdict %q generation %d reason %q, want verified %d", rec.Status.Verdict, rec.Status.Generation, rec.Status.Reason, gen)
	}
	mu.Lock()
	if nonces != 4 {
		t.Errorf("%d nonce GETs, want 4 (3 answered 503, then one)", nonces)
	}
	mu.Unlock()
	if u := r.units(t); u.Verified != gen {
		t.Errorf("units.json verified %d, want %d", u.Verified, gen)
	}
	if !r.logs.has("try 3 of ") || r.logs.has("try 4 of ") {
		t.Errorf("the log does not say three tries failed:\n%s", r.logs)
	}

	// Started again: the generation is verified already, nothing is asked.
	mu.Lock()
	nonces, posts = 0, 0
	mu.Unlock()
	d2, err := plugin.New(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.AttestCurrent(context.Background()); err != nil {
		t.Errorf("again: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if nonces != 0 || posts != 0 {
		t.Errorf("a verified generation attested again: %d GETs, %d POSTs", nonces, posts)
	}
}

// TestAttestCurrentRefused: a control plane that refuses the attestation for good (403:
// not a TPM it knows) is not asked again; the error says so and carries its reason, and
// units.json records nothing verified. A 409 (a conflict a later state resolves) is not
// a refusal: tried again.
func TestAttestCurrentRefused(t *testing.T) {
	r := newTurnRig(t)
	var mu sync.Mutex
	code, attestations := http.StatusForbidden, 0
	r.front(t, func(w http.ResponseWriter, req *http.Request) bool {
		if req.Header.Get("Content-Type") != netboot.AttestationType {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		attestations++
		if code == 0 {
			return false
		}
		c := code
		if c == http.StatusConflict {
			code = 0 // once
		}
		http.Error(w, "record node-x: the EK is not on the intake list", c)
		return true
	})
	r.bootMeasured(t)
	d, err := plugin.New(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = d.AttestCurrent(context.Background())
	if !errors.Is(err, plugin.ErrRefused) || !strings.Contains(err.Error(), "not on the intake list") {
		t.Fatalf("refused: err %v, want ErrRefused with the reason", err)
	}
	mu.Lock()
	if attestations != 1 {
		t.Errorf("%d attestation POSTs, want 1: a refusal is not asked again", attestations)
	}
	attestations, code = 0, http.StatusConflict
	mu.Unlock()
	if b, err := os.ReadFile(filepath.Join(r.cfg.StateDir, "units.json")); err == nil && !strings.Contains(string(b), `"verified": 0`) && strings.Contains(string(b), `"verified"`) {
		t.Errorf("units.json after a refusal: %s", b)
	}

	if err := d.AttestCurrent(context.Background()); err != nil {
		t.Fatalf("409 then the control plane's own answer: %v\n%s", err, r.logs)
	}
	mu.Lock()
	defer mu.Unlock()
	if attestations < 2 {
		t.Errorf("%d attestation POSTs, want the 409 tried again", attestations)
	}
}
