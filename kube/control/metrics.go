package control

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"sort"
	"sync"
	"time"
)

// Metrics are one replica's counters, kept in the process: sum them across replicas. A
// scrape reads nothing from the API. The fleet's records by verdict are not here: the
// verdict is in each record's status, so counting them means reading every record whole
// on every scrape (an informer would hold them all, whole, in every replica), which is
// what let a scrape take a replica's memory. `kubectl get passagenodes` shows verdicts,
// and the API server's apiserver_storage_objects{resource="passagenodes.passage-boot.github.io"}
// counts the records. Written in the Prometheus text format by hand: the exposition is
// small, and promtool check metrics judges it.
type Metrics struct {
	mu        sync.Mutex
	nonces    int64
	enrolls   int64
	refusals  map[string]int64
	verdicts  map[string]int64
	durations []float64 // bucket counts of nonce-to-verdict seconds, by bucketBounds
	durSum    float64
	durCount  int64
	// Limit's: requests in its Handler now, its slots, requests shed by ShedFull or
	// ShedDeadline.
	inFlight, slots int64
	sheds           map[string]int64
	// Reconcile's and the Reconciler's: passes by result, and the pools the last
	// finished pass left tainted.
	passes  map[string]int64
	tainted int64
	// Reconciler's: its judgements by result; its queue's length, the pools settling
	// and whether its caches are watching, read at each scrape (nil: no Reconciler).
	judgements map[string]int64
	queued     func() (ready, settling int)
	watching   func() bool
	// Approver's: the kubelet's certificate requests judged, by result.
	csrs map[string]int64
}

// bucketBounds are the nonce-to-verdict histogram's upper bounds, seconds.
var bucketBounds = []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300}

// NewMetrics makes empty counters.
func NewMetrics() *Metrics {
	m := &Metrics{refusals: map[string]int64{}, verdicts: map[string]int64{}, durations: make([]float64, len(bucketBounds)),
		sheds: map[string]int64{ShedFull: 0, ShedDeadline: 0}, passes: map[string]int64{"ok": 0, "error": 0}, csrs: map[string]int64{},
		judgements: map[string]int64{}}
	for _, r := range csrResults {
		m.csrs[r] = 0
	}
	for _, r := range judgements {
		m.judgements[r] = 0
	}
	return m
}

func (m *Metrics) setSlots(n int) {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.slots = int64(n)
	m.mu.Unlock()
}

func (m *Metrics) enter() {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.inFlight++
	m.mu.Unlock()
}

func (m *Metrics) leave() {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.inFlight--
	m.mu.Unlock()
}

func (m *Metrics) shed(reason string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.sheds[reason]++
	m.mu.Unlock()
}

func (m *Metrics) reconciled(tainted int, err error) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		m.passes["error"]++
		return
	}
	m.passes["ok"]++
	m.tainted = int64(tainted)
}

func (m *Metrics) judged(result string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.judgements[result]++
	m.mu.Unlock()
}

func (m *Metrics) watchReconciler(queued func() (ready, settling int), watching func() bool) {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.queued, m.watching = queued, watching
	m.mu.Unlock()
}

func (m *Metrics) csr(result string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.csrs[result]++
	m.mu.Unlock()
}

func (m *Metrics) issued() {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.nonces++
	m.mu.Unlock()
}

func (m *Metrics) enrolled() {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.enrolls++
	m.mu.Unlock()
}

func (m *Metrics) refused(check string) {
	if m == nil {
		return
	}
	if check == "" {
		check = "other"
	}
	m.mu.Lock()
	m.refusals[labelValue(check)]++
	m.mu.Unlock()
}

func (m *Metrics) verdict(v string, d time.Duration) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.verdicts[v]++
	s := d.Seconds()
	for i, b := range bucketBounds {
		if s <= b {
			m.durations[i]++
		}
	}
	m.durSum += s
	m.durCount++
}

// Write writes the exposition. It is made under the lock and written after: a slow
// reader holds up no request's counting.
func (m *Metrics) Write(w io.Writer) error {
	var b bytes.Buffer
	m.write(&b)
	_, err := w.Write(b.Bytes())
	return err
}

func (m *Metrics) write(w io.Writer) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	p("# HELP passage_control_nonces_issued_total Nonces this replica issued.\n# TYPE passage_control_nonces_issued_total counter\n")
	p("passage_control_nonces_issued_total %d\n", m.nonces)
	p("# HELP passage_control_enrolments_total TPMs this replica enrolled (activation answers accepted).\n# TYPE passage_control_enrolments_total counter\n")
	p("passage_control_enrolments_total %d\n", m.enrolls)
	p("# HELP passage_control_verdicts_total Attestation verdicts this replica reached.\n# TYPE passage_control_verdicts_total counter\n")
	for _, v := range []string{VerdictVerified, VerdictFailed} {
		p("passage_control_verdicts_total{verdict=%q} %d\n", v, m.verdicts[v])
	}
	p("# HELP passage_control_refusals_total Requests this replica refused, by the refused check.\n# TYPE passage_control_refusals_total counter\n")
	for _, r := range sortedKeys(m.refusals) {
		p("passage_control_refusals_total{reason=%q} %d\n", r, m.refusals[r])
	}
	p("# HELP passage_control_nonce_to_verdict_seconds Time from a nonce's issue to the verdict on the attestation made with it.\n# TYPE passage_control_nonce_to_verdict_seconds histogram\n")
	for i, b := range bucketBounds {
		p("passage_control_nonce_to_verdict_seconds_bucket{le=\"%g\"} %g\n", b, m.durations[i])
	}
	p("passage_control_nonce_to_verdict_seconds_bucket{le=\"+Inf\"} %d\n", m.durCount)
	p("passage_control_nonce_to_verdict_seconds_sum %g\n", m.durSum)
	p("passage_control_nonce_to_verdict_seconds_count %d\n", m.durCount)
	p("# HELP passage_control_requests_in_flight Requests in the exchange now, those answered at their deadline and not yet finished included.\n# TYPE passage_control_requests_in_flight gauge\n")
	p("passage_control_requests_in_flight %d\n", m.inFlight)
	p("# HELP passage_control_requests_in_flight_limit Requests that may do API work at once (--max-in-flight).\n# TYPE passage_control_requests_in_flight_limit gauge\n")
	p("passage_control_requests_in_flight_limit %d\n", m.slots)
	p("# HELP passage_control_requests_shed_total Requests answered 503 with Retry-After by the bounds: full (every slot held, not read) or deadline (not finished in time).\n# TYPE passage_control_requests_shed_total counter\n")
	for _, r := range sortedKeys(m.sheds) {
		p("passage_control_requests_shed_total{reason=%q} %d\n", r, m.sheds[r])
	}
	p("# HELP passage_control_reconcile_passes_total Passes of this replica's reconciler over every published pool (rules made to follow verdicts; from its caches, or listing while they are not watching), by result: error is a listing pass that could not finish every pool.\n# TYPE passage_control_reconcile_passes_total counter\n")
	for _, r := range sortedKeys(m.passes) {
		p("passage_control_reconcile_passes_total{result=%q} %d\n", r, m.passes[r])
	}
	p("# HELP passage_control_reconcile_tainted_pools Published pools the last finished pass left tainted (their generation not verified).\n# TYPE passage_control_reconcile_tainted_pools gauge\n")
	p("passage_control_reconcile_tainted_pools %d\n", m.tainted)
	p("# HELP passage_control_reconcile_judgements_total Pools this replica's reconciler judged on an event or a pass, by result: follows (its cached rule is what its cached verdict says: nothing read or written), written (mended), unchanged (read and found right), unpublished (no slices: not judged), error (the API failed: judged again with backoff).\n# TYPE passage_control_reconcile_judgements_total counter\n")
	for _, r := range sortedKeys(m.judgements) {
		p("passage_control_reconcile_judgements_total{result=%q} %d\n", r, m.judgements[r])
	}
	if m.queued != nil {
		ready, settling := m.queued()
		p("# HELP passage_control_reconcile_queue_depth Pools queued to be judged now (not those settling or backing off after an error).\n# TYPE passage_control_reconcile_queue_depth gauge\n")
		p("passage_control_reconcile_queue_depth %d\n", ready)
		p("# HELP passage_control_reconcile_settling_pools Pools whose rule differs from their verdict, waiting this replica's settle before it writes.\n# TYPE passage_control_reconcile_settling_pools gauge\n")
		p("passage_control_reconcile_settling_pools %d\n", settling)
	}
	if m.watching != nil {
		watching := 0
		if m.watching() {
			watching = 1
		}
		p("# HELP passage_control_reconcile_watching 1 while this replica judges pools from its watched caches of the slices, records and rules; 0 while they are not listed or a watch failed within the last period, when each pass lists them.\n# TYPE passage_control_reconcile_watching gauge\n")
		p("passage_control_reconcile_watching %d\n", watching)
	}
	p("# HELP passage_control_csr_total Kubelet client certificate requests this replica judged, by result: approved, or why it left one pending (not-kubelet-client, requester, no-record, not-verified, key-mismatch; error: the API failed, tried again).\n# TYPE passage_control_csr_total counter\n")
	for _, r := range sortedKeys(m.csrs) {
		p("passage_control_csr_total{result=%q} %d\n", r, m.csrs[r])
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Handler serves /metrics: the counters, nothing read from the API.
func (m *Metrics) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		m.Write(w)
	})
}
