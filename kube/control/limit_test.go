package control_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/kube/control"
)

// tryClient is a boot's try: an answer that does not come within it is no answer.
var tryClient = &http.Client{Timeout: 10 * time.Second}

type reply struct {
	status     int
	retryAfter string
	body       string
	err        error
}

func do(method, url, ctype string, body []byte) reply {
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		return reply{err: err}
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := tryClient.Do(req)
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), body: string(b)}
}

// checkUnavailable: a 503 the boot can act on, answered within its try, with a
// Retry-After of whole seconds within the spread.
func checkUnavailable(t *testing.T, what string, r reply) {
	t.Helper()
	if r.err != nil {
		t.Fatalf("%s: no answer within a boot's try: %v", what, r.err)
	}
	s, err := strconv.Atoi(r.retryAfter)
	lo, hi := int(control.DefaultRetryAfter/time.Second), int((control.DefaultRetryAfter+control.DefaultRetrySpread)/time.Second)
	if r.status != http.StatusServiceUnavailable || err != nil || s < lo || s > hi {
		t.Fatalf("%s: %d, Retry-After %q, %q; want 503 with Retry-After %d..%d", what, r.status, r.retryAfter, r.body, lo, hi)
	}
}

// gate is a handler that blocks until released, ignoring its request's context as a
// hung API call would, and says when a request entered it.
type gate struct {
	entered chan string
	release chan struct{}
}

func newGate() *gate { return &gate{entered: make(chan string, 16), release: make(chan struct{})} }

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g.entered <- r.Method
	<-g.release
	w.Header().Set("Content-Type", "text/plain")
	io.WriteString(w, "done\n")
}

func (g *gate) wait(t *testing.T, n int) {
	t.Helper()
	for range n {
		select {
		case <-g.entered:
		case <-time.After(time.Minute):
			t.Fatalf("fewer than %d requests reached the handler", n)
		}
	}
}

func exposition(t *testing.T, m *control.Metrics) string {
	t.Helper()
	var b bytes.Buffer
	if err := m.Write(&b); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func wantMetrics(t *testing.T, m *control.Metrics, want ...string) {
	t.Helper()
	e := exposition(t, m)
	for _, w := range want {
		if !strings.Contains(e, w+"\n") {
			t.Errorf("metrics lack %q:\n%s", w, e)
		}
	}
}

// TestLimitSheds: with every slot held, one more request is answered 503 with
// Retry-After without reaching the handler; an exempt one still reaches it; the held
// ones finish as they would have.
func TestLimitSheds(t *testing.T) {
	g := newGate()
	m := control.NewMetrics()
	l := control.NewLimit(g, 2, time.Hour, m)
	l.Exempt = func(r *http.Request) bool { return r.Method == http.MethodGet }
	ts := httptest.NewServer(l)
	defer ts.Close()
	held := make(chan reply, 2)
	for range 2 {
		go func() { held <- do(http.MethodPost, ts.URL, control.AttestationType, []byte("{}")) }()
	}
	g.wait(t, 2)
	if !l.Saturated() {
		t.Fatalf("2 requests in 2 slots: not saturated")
	}
	wantMetrics(t, m, "passage_control_requests_in_flight 2", "passage_control_requests_in_flight_limit 2")
	for i := range 3 {
		r := do(http.MethodPost, ts.URL, control.AttestationType, []byte("{}"))
		checkUnavailable(t, "a third request", r)
		if !strings.Contains(r.body, "busy") {
			t.Errorf("shed answer %q does not say busy", r.body)
		}
		if len(g.entered) != 0 {
			t.Fatalf("shed request %d reached the handler", i)
		}
	}
	exempt := make(chan reply, 1)
	go func() { exempt <- do(http.MethodGet, ts.URL, "", nil) }()
	g.wait(t, 1)
	close(g.release)
	for range 2 {
		if r := <-held; r.err != nil || r.status != http.StatusOK || r.body != "done\n" || r.retryAfter != "" {
			t.Errorf("a held request: %+v, want 200 done", r)
		}
	}
	if r := <-exempt; r.err != nil || r.status != http.StatusOK {
		t.Errorf("the exempt request at the bound: %+v, want 200", r)
	}
	if l.Held() != 0 {
		t.Errorf("slots held after every request finished: %d", l.Held())
	}
	wantMetrics(t, m, `passage_control_requests_shed_total{reason="full"} 3`, `passage_control_requests_shed_total{reason="deadline"} 0`,
		"passage_control_requests_in_flight 0")
}

// TestLimitDeadline: a handler that never returns (a hung API call that ignores its
// context) is answered 503 with Retry-After at the deadline, and keeps its slot until it
// does return: the bound is on the work held, not on the answers pending.
func TestLimitDeadline(t *testing.T) {
	g := newGate()
	m := control.NewMetrics()
	l := control.NewLimit(g, 1, 100*time.Millisecond, m)
	ts := httptest.NewServer(l)
	defer ts.Close()
	checkUnavailable(t, "a request past its deadline", do(http.MethodPost, ts.URL, control.AttestationType, []byte("{}")))
	g.wait(t, 1)
	if l.Held() != 1 {
		t.Fatalf("the abandoned request holds %d slots, want 1", l.Held())
	}
	r := do(http.MethodPost, ts.URL, control.AttestationType, []byte("{}"))
	checkUnavailable(t, "a request while the abandoned one holds the slot", r)
	if !strings.Contains(r.body, "busy") {
		t.Errorf("answer %q: want busy (the slot is held)", r.body)
	}
	wantMetrics(t, m, `passage_control_requests_shed_total{reason="deadline"} 1`, `passage_control_requests_shed_total{reason="full"} 1`,
		"passage_control_requests_in_flight 1")
	close(g.release)
	for i := 0; l.Held() != 0; i++ {
		if i > 600 {
			t.Fatal("the slot was not given back after the handler returned")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if r := do(http.MethodPost, ts.URL, control.AttestationType, []byte("{}")); r.status != http.StatusOK {
		t.Errorf("after the handler returned: %+v, want 200", r)
	}
}

// TestLimitAnswers: what the handler answers in time passes unchanged, but a 503 gains
// a Retry-After when it has none.
func TestLimitAnswers(t *testing.T) {
	for _, tc := range []struct {
		name       string
		h          http.HandlerFunc
		status     int
		retryAfter string // "spread": within the default spread
		body       string
	}{
		{"202", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusAccepted) }, 202, "", ""},
		{"204", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }, 204, "", ""},
		{"200 body", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Kept", "1")
			io.WriteString(w, "verdict")
		}, 200, "", "verdict"},
		{"403", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "nonce: spent", http.StatusForbidden) }, 403, "", "nonce: spent\n"},
		{"503 bare", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "store", http.StatusServiceUnavailable) }, 503, "spread", "store\n"},
		{"503 own", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Retry-After", "60")
			w.WriteHeader(http.StatusServiceUnavailable)
		}, 503, "60", ""},
	} {
		ts := httptest.NewServer(control.NewLimit(tc.h, 1, time.Minute, control.NewMetrics()))
		r := do(http.MethodPost, ts.URL, control.EnvelopeType, nil)
		ts.Close()
		if tc.retryAfter == "spread" {
			checkUnavailable(t, tc.name, r)
			r.retryAfter = "spread"
		}
		if r.err != nil || r.status != tc.status || r.retryAfter != tc.retryAfter || r.body != tc.body {
			t.Errorf("%s: %+v, want %d, Retry-After %q, %q", tc.name, r, tc.status, tc.retryAfter, tc.body)
		}
	}
}

// TestLimitHungAPI: the exchange itself over an API whose every call hangs (ignoring
// its context, as a stopped API server's TCP peer does) answers 503 with Retry-After
// within the deadline, the API's words kept out of the answer.
func TestLimitHungAPI(t *testing.T) {
	hung := make(chan struct{})
	defer close(hung)
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schemaGVR]string{control.NodeResource: "PassageNodeList"})
	dyn.PrependReactor("*", "*", func(k8stesting.Action) (bool, runtime.Object, error) {
		<-hung
		return true, nil, io.ErrUnexpectedEOF
	})
	m := control.NewMetrics()
	keys, err := control.NewKeys(bytes.Repeat([]byte("k"), control.MinKey))
	if err != nil {
		t.Fatal(err)
	}
	srv := &control.Server{Store: &control.Store{Client: dyn}, Taints: &control.Taints{Client: kubefake.NewClientset()}, Keys: keys, Metrics: m}
	l := control.NewLimit(srv, 4, 200*time.Millisecond, m)
	ts := httptest.NewServer(l)
	defer ts.Close()
	// An attestation past every check made without the API: its record's read hangs.
	nonce, err := keys.Nonce(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	att, _ := json.Marshal(attest.Attestation{Format: attest.Format, Nonce: nonce, Envelope: unsignedEnvelope(t, "b300-a")})
	r := do(http.MethodPost, ts.URL, control.AttestationType, att)
	checkUnavailable(t, "an attestation with the API hung", r)
	if !strings.Contains(r.body, "no answer within 200ms") {
		t.Errorf("answer %q: want it to say the deadline passed", r.body)
	}
	wantMetrics(t, m, `passage_control_requests_shed_total{reason="deadline"} 1`)
}

// TestMetricsExposition: the counters with the bounds' series are what promtool
// accepts.
func TestMetricsExposition(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not installed (image/deps.sh installs it): %v", err)
	}
	g := newGate()
	m := control.NewMetrics()
	l := control.NewLimit(g, 1, time.Hour, m)
	ts := httptest.NewServer(l)
	defer ts.Close()
	held := make(chan reply, 1)
	go func() { held <- do(http.MethodPost, ts.URL, control.AttestationType, nil) }()
	g.wait(t, 1)
	checkUnavailable(t, "over the bound", do(http.MethodPost, ts.URL, control.AttestationType, nil))
	close(g.release)
	<-held
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	out := rec.Body.String()
	for _, w := range []string{`passage_control_requests_shed_total{reason="full"} 1`, "passage_control_requests_in_flight_limit 1",
		"passage_control_nonces_issued_total 0"} {
		if !strings.Contains(out, w+"\n") {
			t.Errorf("metrics lack %q:\n%s", w, out)
		}
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool check metrics: %v\n%s\n%s", err, b, out)
	}
}
