package plugin

import (
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// The families Config.MetricsFile holds.
const (
	// hookExportFailures is what the hook-dir log line counts.
	hookExportFailures = "passage_dra_hook_export_failures_total"
	// turnaroundUnits are the released units by turnaround state.
	turnaroundUnits = "passage_dra_turnaround_units"
	// recycles are the turnaround's recycles by outcome: returned (verified and offered
	// again), failed (a try), quarantined (the last try).
	recycles = "passage_dra_recycles_total"
	// recycleSeconds is each step of the recycles that returned (Steps).
	recycleSeconds = "passage_dra_recycle_step_seconds"
)

// Outcomes are the recycles' outcomes.
var Outcomes = []string{"returned", "failed", "quarantined"}

// stepBuckets are the step histogram's upper bounds in seconds: a reset is milliseconds,
// an NVMe format seconds, a sanitize up to hours.
var stepBuckets = []float64{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 7200}

// turnMetrics are the turnaround's counters and histograms.
type turnMetrics struct {
	mu       sync.Mutex
	outcomes map[string]uint64
	steps    map[string]*histogram
}

type histogram struct {
	counts []uint64 // per bucket, not cumulative
	sum    float64
	n      uint64
}

func (m *turnMetrics) init() {
	m.outcomes = map[string]uint64{}
	m.steps = map[string]*histogram{}
	for _, s := range Steps {
		m.steps[s] = &histogram{counts: make([]uint64, len(stepBuckets))}
	}
}

// outcome counts one recycle's outcome and, for one that returned, its steps' times.
func (m *turnMetrics) outcome(o string, times map[string]time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.outcomes[o]++
	for s, d := range times {
		h := m.steps[s]
		if h == nil {
			continue
		}
		v := d.Seconds()
		h.sum += v
		h.n++
		if i := sort.SearchFloat64s(stepBuckets, v); i < len(stepBuckets) {
			h.counts[i]++
		}
	}
}

// Recycles is how many recycles ended with the outcome since the plugin started.
func (d *Driver) Recycles(outcome string) uint64 {
	d.turn.m.mu.Lock()
	defer d.turn.m.mu.Unlock()
	return d.turn.m.outcomes[outcome]
}

func fnum(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }

// writeMetrics writes the plugin's metrics into Config.MetricsFile in the text
// exposition format (0.0.4) node_exporter's textfile collector reads, as passage's boot
// writes passage.prom: the plugin serves no HTTP of its own. A file that cannot be
// written is logged; the counters carry on in memory. d.mu is held (or d not yet shared).
func (d *Driver) writeMetrics() {
	p := d.cfg.MetricsFile
	if p == "" {
		return
	}
	b := fmt.Appendf(nil, "# HELP %s Exports to the hook dir (the verified manifest for passage-hook) that failed since the plugin started.\n# TYPE %s counter\n%s %d\n",
		hookExportFailures, hookExportFailures, hookExportFailures, d.exportFailures.Load())
	if d.cfg.Turnaround != nil {
		b = fmt.Appendf(b, "# HELP %s Released units by turnaround state (withheld, recycling, verifying, quarantined).\n# TYPE %s gauge\n", turnaroundUnits, turnaroundUnits)
		count := map[string]int{}
		for _, s := range d.units.Units {
			count[s.State]++
		}
		for _, s := range States {
			b = fmt.Appendf(b, "%s{state=%q} %d\n", turnaroundUnits, s, count[s])
		}
		m := &d.turn.m
		m.mu.Lock()
		b = fmt.Appendf(b, "# HELP %s Recycles of released units by outcome (returned: verified and offered again; failed: a try; quarantined: the last try).\n# TYPE %s counter\n", recycles, recycles)
		for _, o := range Outcomes {
			b = fmt.Appendf(b, "%s{outcome=%q} %d\n", recycles, o, m.outcomes[o])
		}
		b = fmt.Appendf(b, "# HELP %s Time of each step of the recycles that returned (erase, reset, sign, attest, verify, publish).\n# TYPE %s histogram\n", recycleSeconds, recycleSeconds)
		for _, s := range Steps {
			h := m.steps[s]
			var cum uint64
			for i, le := range stepBuckets {
				cum += h.counts[i]
				b = fmt.Appendf(b, "%s_bucket{step=%q,le=%q} %d\n", recycleSeconds, s, fnum(le), cum)
			}
			b = fmt.Appendf(b, "%s_bucket{step=%q,le=\"+Inf\"} %d\n%s_sum{step=%q} %s\n%s_count{step=%q} %d\n",
				recycleSeconds, s, h.n, recycleSeconds, s, fnum(h.sum), recycleSeconds, s, h.n)
		}
		m.mu.Unlock()
	}
	if err := manifest.WriteAtomic(filepath.Dir(p), filepath.Base(p), b); err != nil {
		d.logf("metrics: %v", err)
	}
}
