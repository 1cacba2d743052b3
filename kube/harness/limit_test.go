//go:build cluster

package harness_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/harness"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// exchangeReply is what a boot's try got: an answer, or no answer within the try.
type exchangeReply struct {
	status     int
	retryAfter string
	body       string
	err        error
}

// tryOnce is one boot try (netboot.DefaultPublish's PerTry, 10 s) of an attestation by
// no TPM, over a nonce the replica issued, carrying an unsigned envelope naming host: it
// passes every check made without the API and then reads its record (absent: the
// answer, with the API up, is the challenge's refusal of its EK, 403).
func tryOnce(ctx context.Context, hc *http.Client, url, host string) exchangeReply {
	m := manifesttest.B300(1)
	m.Node.Hostname = host
	payload, err := manifest.Marshal(m)
	if err != nil {
		return exchangeReply{err: err}
	}
	env, err := json.Marshal(manifest.Envelope{PayloadType: manifest.PayloadType, Payload: base64.StdEncoding.EncodeToString(payload)})
	if err != nil {
		return exchangeReply{err: err}
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	nreq, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	nresp, err := hc.Do(nreq)
	if err != nil {
		return exchangeReply{err: fmt.Errorf("nonce: %w", err)}
	}
	nb, _ := io.ReadAll(io.LimitReader(nresp.Body, 256))
	nresp.Body.Close()
	nonce, err := hex.DecodeString(strings.TrimSpace(string(nb)))
	if err != nil {
		return exchangeReply{err: fmt.Errorf("nonce: %s %q", nresp.Status, nb)}
	}
	att, err := json.Marshal(attest.Attestation{Format: attest.Format, Nonce: nonce, EKCert: []byte{0x30, 0}, Envelope: env})
	if err != nil {
		return exchangeReply{err: err}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(att))
	if err != nil {
		return exchangeReply{err: err}
	}
	req.Header.Set("Content-Type", control.AttestationType)
	resp, err := hc.Do(req)
	if err != nil {
		return exchangeReply{err: err}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return exchangeReply{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), body: string(b)}
}

// retryable: a 503 within the try, with a Retry-After the boot can wait out.
func retryable(r exchangeReply) bool {
	s, err := strconv.Atoi(r.retryAfter)
	return r.err == nil && r.status == http.StatusServiceUnavailable && err == nil && s >= 1 && s <= 10
}

func getText(t testing.TB, url string) (int, string) {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// sample is one series' value in an exposition (-1 when absent).
func sample(exp, series string) float64 {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindStringSubmatch(exp)
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return -1
	}
	return v
}

// controlReplica starts the control plane and one passage-control replica with extra
// flags, on the deploy file's role.
func controlReplica(t *testing.T, ctx context.Context, extra ...string) (*replicaEnv, *replica) {
	t.Helper()
	work := t.TempDir()
	bin := goBuild(t, work, "passage-control")
	c := startCluster(t, ctx, work)
	applyCRDs(t, ctx, c)
	kc := filepath.Join(work, "passage-control.kubeconfig")
	deployControlRBAC(t, ctx, c, kc)
	ekCA, _ := serving(t) // a CA no TPM chains to: no request here enrols
	pool := replicaFiles(t, work, ekCA)
	r := startReplica(t, ctx, bin, kc, work, 1, extra...)
	e := &replicaEnv{c: c, hc: &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}},
		base: strings.TrimSuffix(r.metrics, "metrics"), kubeconfig: kc}
	return e, r
}

type replicaEnv struct {
	c    *harness.Cluster
	hc   *http.Client
	base string // http://<metrics address>/
	// kubeconfig is the replica's (passage-control's service account).
	kubeconfig string
}

// TestClusterHungAPI: the API server stopped (SIGSTOP: its sockets stay open, nothing
// answers, as a hung one) while requests are in flight. The replica answers every
// request 503 with Retry-After within a boot's try: the ones in flight at the deadline,
// the ones past --max-in-flight at once without reading them. /readyz says not ready,
// naming the API server, while /healthz says the process is alive; SIGCONT, and it is
// ready and serving again.
func TestClusterHungAPI(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const slots = 4
	e, r := controlReplica(t, ctx, "--max-in-flight", strconv.Itoa(slots), "--request-deadline", "5s")
	ready := func() (bool, string) {
		code, body := getText(t, e.base+"readyz")
		return code == http.StatusOK, fmt.Sprintf("%d %s", code, strings.TrimSpace(body))
	}
	waitFor(t, ctx, 30*time.Second, "/readyz ok with the API server up", ready)
	if res := tryOnce(ctx, e.hc, r.url, "before"); res.err != nil || res.status != http.StatusForbidden {
		t.Fatalf("an attestation with the API server up: %+v, want its EK refused", res)
	}

	pid := e.c.PIDs()["kube-apiserver"]
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resume := sync.OnceFunc(func() { syscall.Kill(pid, syscall.SIGCONT) })
	t.Cleanup(resume)

	held := make(chan exchangeReply, slots)
	for i := range slots {
		go func() { held <- tryOnce(ctx, e.hc, r.url, fmt.Sprintf("held-%d", i)) }()
	}
	waitFor(t, ctx, 30*time.Second, fmt.Sprintf("%d requests in flight", slots), func() (bool, string) {
		_, exp := getText(t, e.base+"metrics")
		v := sample(exp, "passage_control_requests_in_flight")
		return v == slots, fmt.Sprint(v)
	})
	for i := range 3 {
		res := tryOnce(ctx, e.hc, r.url, fmt.Sprintf("over-%d", i))
		if !retryable(res) || !strings.Contains(res.body, "busy") {
			t.Errorf("a request over the bound with the API server stopped: %+v, want 503 busy with Retry-After", res)
		}
	}
	for range slots {
		if res := <-held; !retryable(res) {
			t.Errorf("a request in flight when the API server stopped: %+v, want 503 with Retry-After within the try", res)
		}
	}
	waitFor(t, ctx, 60*time.Second, "/readyz not ready naming the API server", func() (bool, string) {
		ok, seen := ready()
		return !ok && strings.Contains(seen, "api server"), seen
	})
	if code, body := getText(t, e.base+"healthz"); code != http.StatusOK {
		t.Errorf("/healthz with the API server stopped: %d %s, want 200", code, body)
	}
	_, exp := getText(t, e.base+"metrics")
	if v := sample(exp, `passage_control_requests_shed_total{reason="full"}`); v < 3 {
		t.Errorf("shed full: %v, want the 3 over the bound:\n%s", v, exp)
	}
	t.Logf("with the API server stopped: shed full %v, deadline %v; refused unavailable %v",
		sample(exp, `passage_control_requests_shed_total{reason="full"}`), sample(exp, `passage_control_requests_shed_total{reason="deadline"}`),
		sample(exp, `passage_control_refusals_total{reason="unavailable"}`))

	resume()
	waitFor(t, ctx, 60*time.Second, "/readyz ok after SIGCONT", ready)
	waitFor(t, ctx, 60*time.Second, "an attestation answered after SIGCONT", func() (bool, string) {
		res := tryOnce(ctx, e.hc, r.url, "after")
		return res.status == http.StatusForbidden, fmt.Sprintf("%+v", res)
	})
}

// procStatus reads a field of /proc/PID/status in kB.
func procStatus(t testing.TB, pid int, field string) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("/proc/%d/status %s: %v", pid, field, err)
			}
			return n
		}
	}
	t.Fatalf("/proc/%d/status: no %s", pid, field)
	return 0
}

// TestClusterMetricsFlood: with records holding far more than the bound (64 of about
// 1 MiB each, as strangers' envelopes once made them), scrapes of /metrics, six at once,
// and passes of the reconciler, one a second, leave the replica's peak RSS (VmHWM)
// within 16 MiB of what it was before the records existed: a scrape reads no record,
// and the reconciler reads each one's verdict, not its bytes.
func TestClusterMetricsFlood(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	e, r := controlReplica(t, ctx, "--reconcile-every", "1s")
	pid := r.cmd.Process.Pid
	// A scrape that lists the records takes long; it is let finish, so that what it
	// costs shows in the peak.
	hc := &http.Client{Timeout: time.Minute}
	scrape := func() {
		errs := make(chan error, 6)
		for range 6 {
			go func() {
				resp, err := hc.Get(r.metrics)
				if err != nil {
					errs <- err
					return
				}
				exp, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err == nil && (resp.StatusCode != http.StatusOK || !strings.Contains(string(exp), "passage_control_nonces_issued_total ")) {
					err = fmt.Errorf("/metrics: %s\n%s", resp.Status, exp)
				}
				errs <- err
			}()
		}
		for range 6 {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
	}
	for range 3 {
		scrape()
	}
	before := procStatus(t, pid, "VmHWM")

	const records, raw = 64, 768 << 10 // base64 makes each envelope 1 MiB
	rc := restConfig(t, e.c)
	rc.QPS, rc.Burst = 50, 100
	dyn := dynamic.NewForConfigOrDie(rc)
	envelope := make([]byte, raw)
	rand.Read(envelope)
	for i := range records {
		name := fmt.Sprintf("flood-%03d", i)
		u := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": control.Group + "/" + control.Version, "kind": "PassageNode",
			"metadata": map[string]any{"name": name}, "spec": map[string]any{"node": name, "ekCert": base64.StdEncoding.EncodeToString(envelope)}}}
		if _, err := dyn.Resource(control.NodeResource).Create(ctx, u, metav1.CreateOptions{}); err != nil {
			t.Fatalf("record %s: %v", name, err)
		}
	}
	// The bytes are kept, not pruned by the schema.
	one, err := dyn.Resource(control.NodeResource).Get(ctx, "flood-000", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := json.Marshal(one.Object); len(b) < raw {
		t.Fatalf("a flood record is %d bytes: the envelope was not kept", len(b))
	}

	passes := func() int {
		resp, err := e.hc.Get(r.metrics)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		m, _ := io.ReadAll(resp.Body)
		var n int
		fmt.Sscan(strings.TrimPrefix(metricLine(m, `passage_control_reconcile_passes_total{result="ok"} `), `passage_control_reconcile_passes_total{result="ok"} `), &n)
		return n
	}
	since := passes()
	for range 5 {
		scrape()
	}
	// Two whole passes after the records were all there: the reconciler walked them.
	waitFor(t, ctx, time.Minute, "two reconcile passes over the flood", func() (bool, string) {
		n := passes()
		return n >= since+2, fmt.Sprintf("%d passes", n-since)
	})
	sameVerdicts(t, ctx, e.kubeconfig, records)
	after := procStatus(t, pid, "VmHWM")
	const boundKiB = 16 << 10
	t.Logf("replica VmHWM %d KiB before %d MiB of records, %d KiB after 30 scrapes (RSS now %d KiB)",
		before, records*raw*4/3>>20, after, procStatus(t, pid, "VmRSS"))
	if after-before > boundKiB {
		t.Fatalf("replica peak RSS grew %d KiB with %d MiB of records scraped, over the %d KiB bound", after-before, records*raw*4/3>>20, boundKiB)
	}
}
