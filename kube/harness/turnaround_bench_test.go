//go:build cluster

package harness_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/internal/simnode"
)

// BenchmarkTurnaround times a released unit's way back, one release per iteration on
// TestClusterTurnaround's node (make turnaround-bench; -benchtime Nx sets the releases):
// a pod holding a unit whose NVMe holds a tenant's data is deleted (the kubelet's
// unprepare), and a waiting pod is given that unit again, judged by the same watches.
// It prints p50 and p99 of the whole (deletion to allocation, the watch's stamps) and
// of each step the plugin's log gives per recycle (erase, reset, sign, attest, verify,
// publish), the rest being the plugin noticing the release and the scheduler. The
// NVMe is simnode's: its Format NVM costs what PASSAGE_TURN_FORMAT says (a duration,
// each admin command's latency; default none), so the erase's share is reported apart.
func BenchmarkTurnaround(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	var latency time.Duration
	if s := os.Getenv("PASSAGE_TURN_FORMAT"); s != "" {
		var err error
		if latency, err = time.ParseDuration(s); err != nil {
			b.Fatalf("PASSAGE_TURN_FORMAT %q: %v", s, err)
		}
	}
	e := newTurnEnv(b, ctx)
	pods := e.newPods(b, ctx, 8)
	units := e.bound(b, ctx, pods)
	for _, u := range units {
		if err := simnode.SetLatency(e.rig.Root, e.nvme(u), latency); err != nil {
			b.Fatal(err)
		}
	}
	w := e.watchOffers(b, ctx)
	var whole []time.Duration
	for i := 0; b.Loop(); i++ {
		holder := pods[i%len(pods)]
		unit := units[holder]
		e.tenant(b, unit, true)
		waiting := e.newPods(b, ctx, 1)
		e.release(b, ctx, w, []string{holder})
		got := e.bound(b, ctx, waiting)
		if got[waiting[0]] != unit {
			b.Fatalf("%s got %s, want the released %s", waiting[0], got[waiting[0]], unit)
		}
		whole = append(whole, w.returned(b, unit)[unit])
		pods[i%len(pods)] = waiting[0]
		units[waiting[0]] = unit
	}
	b.StopTimer()
	steps := stepTimes(b, e.n.log)
	if len(steps["erase"]) != len(whole) {
		b.Fatalf("%d recycles in the plugin's log, %d releases", len(steps["erase"]), len(whole))
	}
	var rest []time.Duration
	for i, d := range whole {
		r := d
		for _, s := range plugin.Steps {
			r -= steps[s][i]
		}
		rest = append(rest, r)
	}
	p50, p99 := quantiles(whole)
	b.ReportMetric(p50.Seconds(), "p50-s")
	b.ReportMetric(p99.Seconds(), "p99-s")
	var t strings.Builder
	fmt.Fprintf(&t, "\nturnaround of one released unit, %d releases one at a time (simulated NVMe format latency per admin command: %v)\n", len(whole), latency)
	fmt.Fprintf(&t, "%-28s %10s %10s\n", "", "p50", "p99")
	row := func(name string, ds []time.Duration) {
		a, z := quantiles(ds)
		fmt.Fprintf(&t, "%-28s %10s %10s\n", name, a.Round(time.Millisecond), z.Round(time.Millisecond))
	}
	row("deletion to allocation", whole)
	for _, s := range plugin.Steps {
		row("  "+s, steps[s])
	}
	row("  rest (notice, scheduler)", rest)
	m, err := os.ReadFile(e.metrics)
	if err != nil {
		b.Fatal(err)
	}
	fmt.Fprintf(&t, "plugin histogram (passage_dra_recycle_step_seconds): %s\n", histogramMeans(m))
	fmt.Print(t.String())
}

// backLine is the plugin's log line of a recycle that returned (plugin.stepLine).
var backLine = regexp.MustCompile(`turnaround gpu\d+: back in generation \d+ \((.*)\)`)

// stepTimes are the steps of each recycle that returned, in log order.
func stepTimes(b *testing.B, log string) map[string][]time.Duration {
	b.Helper()
	data, err := os.ReadFile(log)
	if err != nil {
		b.Fatal(err)
	}
	out := map[string][]time.Duration{}
	for _, m := range backLine.FindAllSubmatch(data, -1) {
		for _, part := range strings.Split(string(m[1]), ", ") {
			name, v, ok := strings.Cut(part, " ")
			d, err := time.ParseDuration(v)
			if !ok || err != nil {
				b.Fatalf("plugin log: step %q: %v", part, err)
			}
			out[name] = append(out[name], d)
		}
	}
	return out
}

// quantiles are the p50 and p99 of ds (nearest rank).
func quantiles(ds []time.Duration) (p50, p99 time.Duration) {
	if len(ds) == 0 {
		return 0, 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	rank := func(q float64) time.Duration {
		i := int(q*float64(len(s))+0.999999) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return rank(0.50), rank(0.99)
}

// histogramMeans are the mean of each step from the plugin's histogram (its _sum over
// its _count).
func histogramMeans(m []byte) string {
	var parts []string
	for _, s := range plugin.Steps {
		var sum float64
		var n int
		for _, l := range bytes.Split(m, []byte("\n")) {
			fmt.Sscanf(string(l), `passage_dra_recycle_step_seconds_sum{step="`+s+`"} %g`, &sum)
			fmt.Sscanf(string(l), `passage_dra_recycle_step_seconds_count{step="`+s+`"} %d`, &n)
		}
		if n > 0 {
			parts = append(parts, fmt.Sprintf("%s %v", s, time.Duration(sum/float64(n)*float64(time.Second)).Round(time.Millisecond)))
		}
	}
	return "mean " + strings.Join(parts, ", ")
}
