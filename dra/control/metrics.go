package control

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sort"
	"sync"
	"time"
)

// Metrics are one replica's counters, and at scrape time the records' verdicts read from
// the API (so every replica reports the same nodes by verdict; sum the counters across
// replicas). Written in the Prometheus text format by hand: the exposition is small, and
// promtool check metrics judges it.
type Metrics struct {
	mu        sync.Mutex
	nonces    int64
	enrolls   int64
	refusals  map[string]int64
	verdicts  map[string]int64
	durations []float64 // bucket counts of nonce-to-verdict seconds, by bucketBounds
	durSum    float64
	durCount  int64
}

// bucketBounds are the nonce-to-verdict histogram's upper bounds, seconds.
var bucketBounds = []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300}

// NewMetrics makes empty counters.
func NewMetrics() *Metrics {
	return &Metrics{refusals: map[string]int64{}, verdicts: map[string]int64{}, durations: make([]float64, len(bucketBounds))}
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

// Write writes the exposition; nodes, when not nil, are the records to count by verdict.
func (m *Metrics) Write(w io.Writer, nodes []*Node) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	if nodes != nil {
		by := map[string]int{VerdictUnverified: 0, VerdictVerified: 0, VerdictFailed: 0}
		for _, n := range nodes {
			v := n.Status.Verdict
			if v == "" {
				v = VerdictUnverified
			}
			by[v]++
		}
		p("# HELP passage_control_nodes Node records by their verdict.\n# TYPE passage_control_nodes gauge\n")
		for _, v := range sortedKeys(by) {
			p("passage_control_nodes{verdict=%q} %d\n", v, by[v])
		}
	}
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
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Handler serves /metrics: the counters and the records listed from the API (a list
// that fails leaves the gauge out, the counters are still served).
func (m *Metrics) Handler(s *Store) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
		defer cancel()
		nodes, err := s.ListNodes(ctx)
		if err != nil {
			nodes = nil
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		m.Write(w, nodes)
	})
}
