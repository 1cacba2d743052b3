package perfcheck

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
)

// Thresholds are the largest losses (guest below host, in percent) the verdict accepts.
// A guest faster than the host never fails.
type Thresholds struct {
	LargestPct     float64 `json:"largest_pct"`     // busbw at each collective's largest message
	Large8MiBPct   float64 `json:"large_8mib_pct"`  // busbw at every message >= 8 MiB
	NVBandwidthPct float64 `json:"nvbandwidth_pct"` // nvbandwidth host->device and device->host
	// SmallPct is the loss that makes a message below 8 MiB worth naming (outlier or
	// repeated); small messages never fail the verdict: they are latency-bound and noisy.
	SmallPct float64 `json:"small_pct"`
}

// DefaultThresholds are the operators' acceptance figures for a B300 node (B300.md,
// "What good measured like", with headroom over the measured losses).
var DefaultThresholds = Thresholds{LargestPct: 0.5, Large8MiBPct: 1, NVBandwidthPct: 2, SmallPct: 1}

// Large8MiB is where the ">= 8 MiB" summary starts.
const Large8MiB = 8 << 20

// busbwResolution is the step nccl-tests prints busbw with (%6.2f): a smaller
// difference is rounding, not a loss.
const busbwResolution = 0.01

// Options selects what Compare compares.
type Options struct {
	Thresholds Thresholds
	// InPlace compares the in-place busbw columns; the default is out-of-place, which is
	// what nccl-tests' own summaries and most published tables quote.
	InPlace bool
}

// Report is the full host-vs-guest comparison; --json prints it as is.
type Report struct {
	Host        string              `json:"host"`
	Guest       string              `json:"guest"`
	Column      string              `json:"column"` // "out-of-place" or "in-place"
	Thresholds  Thresholds          `json:"thresholds"`
	Collectives []CollectiveReport  `json:"collectives"`
	NVBandwidth []NVBTestcaseReport `json:"nvbandwidth"`
	Summary     Summary             `json:"summary"`
	Findings    []Finding           `json:"findings"`
	Pass        bool                `json:"pass"`
}

// Severity of a finding: only Fail changes the verdict.
type Severity string

const (
	Fail Severity = "fail"
	Warn Severity = "warn"
	Info Severity = "info"
)

// Finding is one sentence of the verdict.
type Finding struct {
	Severity Severity `json:"severity"`
	Subject  string   `json:"subject"` // collective, testcase or file
	Message  string   `json:"message"`
}

// Point is one message size of one collective.
type Point struct {
	Size         int64    `json:"size"`
	HostSamples  Samples  `json:"host_samples"`    // busbw of each round, GB/s
	GuestSamples Samples  `json:"guest_samples"`   // busbw of each round, GB/s
	Host         *float64 `json:"host,omitempty"`  // median busbw; nil when no round had a value
	Guest        *float64 `json:"guest,omitempty"` // median busbw
	DeltaPct     *float64 `json:"delta_pct,omitempty"`
	// Class is "outlier" for a small-message loss no neighbouring size repeats,
	// "repeated" for one a neighbour repeats, "" otherwise.
	Class string `json:"class,omitempty"`
}

// CollectiveReport compares one collective's rounds.
type CollectiveReport struct {
	Name        string   `json:"name"`
	HostRounds  int      `json:"host_rounds"`
	GuestRounds int      `json:"guest_rounds"`
	Points      []Point  `json:"points"`
	Largest     *Worst   `json:"largest,omitempty"`    // the largest message; nil when it cannot be judged (a Fail says why)
	Worst8MiB   *Worst   `json:"worst_8mib,omitempty"` // worst delta over messages >= 8 MiB
	Outliers    []Worst  `json:"outliers,omitempty"`
	Repeated    []Worst  `json:"repeated,omitempty"`
	AvgBusBW    *Compare `json:"avg_busbw,omitempty"` // median of the "# Avg bus bandwidth" footers
}

// Worst names one point and its delta.
type Worst struct {
	Collective string  `json:"collective"`
	Size       int64   `json:"size"`
	DeltaPct   float64 `json:"delta_pct"`
	Host       float64 `json:"host"`
	Guest      float64 `json:"guest"`
}

// Compare is a host/guest pair of medians.
type Compare struct {
	Host     float64 `json:"host"`
	Guest    float64 `json:"guest"`
	DeltaPct float64 `json:"delta_pct"`
}

// NVBTestcaseReport compares one nvbandwidth testcase.
type NVBTestcaseReport struct {
	Name         string  `json:"name"`
	Unit         string  `json:"unit"`
	HostSamples  Samples `json:"host_samples"`
	GuestSamples Samples `json:"guest_samples"`
	// Basis is "sum" when both sides measured as many GPUs (the SUM lines compare), or
	// "per-gpu mean" when the guest sees a different number of GPUs than the host.
	Basis    string   `json:"basis"`
	Host     *float64 `json:"host,omitempty"`
	Guest    *float64 `json:"guest,omitempty"`
	DeltaPct *float64 `json:"delta_pct,omitempty"`
	// WorstCell is the matrix cell (row,column) with the worst median delta, when both
	// sides printed matrices of one shape: a single GPU behind a bad IOMMU path hides in
	// a sum.
	WorstCell      string   `json:"worst_cell,omitempty"`
	WorstCellDelta *float64 `json:"worst_cell_delta_pct,omitempty"`
	Checked        bool     `json:"checked"` // counts for the verdict (H2D/D2H memcpy)
}

// Summary is what the operators read first.
type Summary struct {
	Largest   *Worst             `json:"largest,omitempty"`    // worst delta at a largest message
	Worst8MiB *Worst             `json:"worst_8mib,omitempty"` // worst delta over >= 8 MiB
	Outliers  []Worst            `json:"outliers,omitempty"`   // small-message losses not repeated
	Repeated  []Worst            `json:"repeated,omitempty"`   // small-message losses a neighbour repeats
	H2D       *NVBTestcaseReport `json:"h2d,omitempty"`
	D2H       *NVBTestcaseReport `json:"d2h,omitempty"`
}

// checkedNVB are the nvbandwidth testcases the verdict holds to NVBandwidthPct: the
// unidirectional host<->device copies, the paths the IOMMU sits on. Bidirectional and
// all-to-host variants are shown but vary too much run to run to judge on.
var checkedNVB = map[string]bool{
	"host_to_device_memcpy_ce": true, "device_to_host_memcpy_ce": true,
	"host_to_device_memcpy_sm": true, "device_to_host_memcpy_sm": true,
}

// Samples are per-round values; a round whose value was nan is NaN here and null in JSON.
type Samples []float64

// MarshalJSON writes NaN and infinities as null: JSON has no such numbers.
func (s Samples) MarshalJSON() ([]byte, error) {
	b := []byte{'['}
	for i, v := range s {
		if i > 0 {
			b = append(b, ',')
		}
		if math.IsNaN(v) || math.IsInf(v, 0) {
			b = append(b, "null"...)
			continue
		}
		b = strconv.AppendFloat(b, v, 'g', -1, 64)
	}
	return append(b, ']'), nil
}

func median(xs []float64) (float64, bool) {
	var v []float64
	for _, x := range xs {
		if !math.IsNaN(x) && !math.IsInf(x, 0) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return 0, false
	}
	sort.Float64s(v)
	n := len(v)
	if n%2 == 1 {
		return v[n/2], true
	}
	return (v[n/2-1] + v[n/2]) / 2, true
}

func deltaPct(host, guest float64) (float64, bool) {
	if host <= 0 {
		return 0, false
	}
	d := (guest - host) / host * 100
	if math.IsNaN(d) || math.IsInf(d, 0) {
		return 0, false
	}
	return d, true
}

func ptr(f float64) *float64 { return &f }

// CompareSides builds the report. It never fails: everything it cannot compare becomes
// a finding.
func CompareSides(host, guest *Side, opt Options) *Report {
	rep := &Report{Host: host.Dir, Guest: guest.Dir, Thresholds: opt.Thresholds, Column: "out-of-place"}
	if opt.InPlace {
		rep.Column = "in-place"
	}
	add := func(sev Severity, subj, format string, a ...any) {
		rep.Findings = append(rep.Findings, Finding{sev, subj, fmt.Sprintf(format, a...)})
	}
	for _, side := range []*Side{host, guest} {
		checkRuns(side, add)
	}

	names := map[string]bool{}
	for n := range host.NCCL {
		names[n] = true
	}
	for n := range guest.NCCL {
		names[n] = true
	}
	for _, n := range orderedCollectives(names) {
		h, g := host.NCCL[n], guest.NCCL[n]
		switch {
		case len(h) == 0:
			add(Fail, n, "guest has %s results but the host has none to compare with", n)
			continue
		case len(g) == 0:
			add(Fail, n, "host has %s results but the guest has none", n)
			continue
		}
		rep.Collectives = append(rep.Collectives, compareCollective(n, h, g, opt, add))
	}
	rep.NVBandwidth = compareNVB(host.NVBandwidth, guest.NVBandwidth, opt.Thresholds, add)

	s := &rep.Summary
	for i := range rep.Collectives {
		c := &rep.Collectives[i]
		if c.Largest != nil && (s.Largest == nil || c.Largest.DeltaPct < s.Largest.DeltaPct) {
			s.Largest = c.Largest
		}
		if c.Worst8MiB != nil && (s.Worst8MiB == nil || c.Worst8MiB.DeltaPct < s.Worst8MiB.DeltaPct) {
			s.Worst8MiB = c.Worst8MiB
		}
		s.Outliers = append(s.Outliers, c.Outliers...)
		s.Repeated = append(s.Repeated, c.Repeated...)
	}
	for i := range rep.NVBandwidth {
		t := &rep.NVBandwidth[i]
		if !t.Checked || t.DeltaPct == nil {
			continue
		}
		dst := &s.H2D
		if strings.HasPrefix(t.Name, "device_to_host") {
			dst = &s.D2H
		}
		if *dst == nil || *t.DeltaPct < *(*dst).DeltaPct {
			*dst = t
		}
	}
	rep.Pass = true
	for _, f := range rep.Findings {
		if f.Severity == Fail {
			rep.Pass = false
		}
	}
	return rep
}

func orderedCollectives(names map[string]bool) []string {
	var out []string
	for _, c := range collectives {
		if names[c] {
			out = append(out, c)
			delete(names, c)
		}
	}
	var rest []string
	for n := range names {
		rest = append(rest, n)
	}
	sort.Strings(rest)
	return append(out, rest...)
}

// checkRuns turns what the parsers noticed about each file into findings.
func checkRuns(side *Side, add func(Severity, string, string, ...any)) {
	for _, n := range orderedCollectives(keys(side.NCCL)) {
		for _, r := range side.NCCL[n] {
			switch {
			case r.Aborted != "":
				add(Fail, r.File, "run aborted at line %d: %s", r.AbortedLine, r.Aborted)
			case r.Truncated:
				add(Warn, r.File, "no \"# Avg bus bandwidth\" footer: the output is cut short; its %d rows are used", len(r.Rows))
			}
			if r.OutOfBounds != nil && *r.OutOfBounds != 0 {
				add(Fail, r.File, "nccl-tests reports %d out-of-bounds values", *r.OutOfBounds)
			}
			for _, row := range r.Rows {
				for _, side := range []struct {
					n string
					v NCCLResult
				}{{"out-of-place", row.OutOfPlace}, {"in-place", row.InPlace}} {
					if !math.IsNaN(side.v.Wrong) && side.v.Wrong > 0 {
						add(Fail, r.File, "line %d: %s %s has %g wrong elements: the data is corrupt, the bandwidth means nothing", row.Line, sizeString(row.Size), side.n, side.v.Wrong)
					}
				}
			}
		}
	}
	for _, r := range side.NVBandwidth {
		switch {
		case r.Aborted != "":
			add(Fail, r.File, "nvbandwidth aborted at line %d: %s", r.AbortedLine, r.Aborted)
		case r.Truncated:
			add(Warn, r.File, "nvbandwidth output ends inside a testcase: cut short")
		}
	}
}

func keys[V any](m map[string]V) map[string]bool {
	out := map[string]bool{}
	for k := range m {
		out[k] = true
	}
	return out
}

func samplesBySize(runs []*NCCLRun, inPlace bool) map[int64]Samples {
	out := map[int64]Samples{}
	for _, r := range runs {
		for _, row := range r.Rows {
			v := row.OutOfPlace
			if inPlace {
				v = row.InPlace
			}
			b := math.NaN()
			if v.Valid() {
				b = v.BusBW
			}
			out[row.Size] = append(out[row.Size], b)
		}
	}
	return out
}

func compareCollective(name string, h, g []*NCCLRun, opt Options, add func(Severity, string, string, ...any)) CollectiveReport {
	th := opt.Thresholds
	c := CollectiveReport{Name: name, HostRounds: len(h), GuestRounds: len(g)}
	if len(h) != len(g) {
		add(Warn, name, "host has %d rounds, guest %d", len(h), len(g))
	}
	hs, gs := samplesBySize(h, opt.InPlace), samplesBySize(g, opt.InPlace)
	sizes := map[int64]bool{}
	for s := range hs {
		sizes[s] = true
	}
	for s := range gs {
		sizes[s] = true
	}
	var order []int64
	for s := range sizes {
		order = append(order, s)
	}
	sort.Slice(order, func(i, j int) bool { return order[i] < order[j] })
	var onlyHost, onlyGuest []string
	for _, s := range order {
		p := Point{Size: s, HostSamples: hs[s], GuestSamples: gs[s]}
		if p.HostSamples == nil {
			p.HostSamples = Samples{}
			onlyGuest = append(onlyGuest, sizeString(s))
		}
		if p.GuestSamples == nil {
			p.GuestSamples = Samples{}
			onlyHost = append(onlyHost, sizeString(s))
		}
		if m, ok := median(p.HostSamples); ok {
			p.Host = ptr(m)
		}
		if m, ok := median(p.GuestSamples); ok {
			p.Guest = ptr(m)
		}
		if p.Host != nil && p.Guest != nil {
			if d, ok := deltaPct(*p.Host, *p.Guest); ok {
				p.DeltaPct = ptr(d)
			}
		}
		c.Points = append(c.Points, p)
	}
	if len(onlyHost) > 0 {
		add(Warn, name, "sizes measured on the host only: %s", strings.Join(onlyHost, ", "))
	}
	if len(onlyGuest) > 0 {
		add(Warn, name, "sizes measured in the guest only: %s", strings.Join(onlyGuest, ", "))
	}
	// NaN busbw values are dropped before the medians; a figure without at least one
	// valid round on each side is no comparison.
	for i := range c.Points {
		p := c.Points[i]
		if len(p.HostSamples) > 0 && len(p.GuestSamples) > 0 && (p.Host == nil || p.Guest == nil) {
			add(Warn, name, "%s: no valid busbw on the %s", sizeString(p.Size), map[bool]string{true: "host", false: "guest"}[p.Host == nil])
		}
	}

	topOK := checkLargest(name, c.Points, h, g, opt.InPlace, add)

	var cmp []int // indexes of points with a delta
	for i, p := range c.Points {
		if p.DeltaPct != nil {
			cmp = append(cmp, i)
		}
	}
	if len(cmp) == 0 {
		add(Fail, name, "no message size has a busbw on both sides")
		return c
	}
	worst := func(i int) *Worst {
		p := c.Points[i]
		return &Worst{Collective: name, Size: p.Size, DeltaPct: *p.DeltaPct, Host: *p.Host, Guest: *p.Guest}
	}
	// The largest message is the largest size either side measured, never a smaller one
	// standing in for it: checkLargest has failed the verdict when it has no delta.
	if top := len(c.Points) - 1; topOK && c.Points[top].DeltaPct != nil {
		c.Largest = worst(top)
		if c.Largest.DeltaPct < -th.LargestPct {
			add(Fail, name, "largest message %s: busbw %.2f -> %.2f GB/s, %+.2f%% (limit -%g%%)", sizeString(c.Largest.Size), c.Largest.Host, c.Largest.Guest, c.Largest.DeltaPct, th.LargestPct)
		}
	}
	for _, i := range cmp {
		p := c.Points[i]
		if p.Size < Large8MiB {
			continue
		}
		if c.Worst8MiB == nil || *p.DeltaPct < c.Worst8MiB.DeltaPct {
			c.Worst8MiB = worst(i)
		}
		if *p.DeltaPct < -th.Large8MiBPct {
			add(Fail, name, "%s: busbw %.2f -> %.2f GB/s, %+.2f%% (limit -%g%% for >= 8 MiB)", sizeString(p.Size), *p.Host, *p.Guest, *p.DeltaPct, th.Large8MiBPct)
		}
	}
	// A small message is noisy: one size losing is noise unless the size next to it
	// loses about as much, which is what a real per-message cost (an extra IOMMU walk,
	// a slower doorbell) looks like. "About as much" is at least half: an 8% dip next
	// to a 1% one is a dip, not a trend.
	loses := func(k int) bool {
		if k < 0 || k >= len(cmp) {
			return false
		}
		p := c.Points[cmp[k]]
		return *p.DeltaPct < -th.SmallPct && *p.Host-*p.Guest > busbwResolution
	}
	repeats := func(k, n int) bool {
		if !loses(k) || !loses(n) {
			return false
		}
		a, b := -*c.Points[cmp[k]].DeltaPct, -*c.Points[cmp[n]].DeltaPct
		return math.Min(a, b) >= math.Max(a, b)/2
	}
	for k, i := range cmp {
		p := &c.Points[i]
		if p.Size >= Large8MiB || !loses(k) {
			continue
		}
		w := *worst(i)
		if repeats(k, k-1) || repeats(k, k+1) {
			p.Class = "repeated"
			c.Repeated = append(c.Repeated, w)
		} else {
			p.Class = "outlier"
			c.Outliers = append(c.Outliers, w)
		}
	}
	if len(c.Repeated) > 0 {
		var s []string
		for _, w := range c.Repeated {
			s = append(s, fmt.Sprintf("%s %+.1f%%", sizeString(w.Size), w.DeltaPct))
		}
		add(Warn, name, "small messages lose in neighbouring sizes (not noise): %s", strings.Join(s, ", "))
	}
	for _, w := range c.Outliers {
		add(Info, name, "small-message outlier %s %+.1f%%, not repeated by a neighbouring size", sizeString(w.Size), w.DeltaPct)
	}

	var ha, ga []float64
	for _, r := range h {
		if r.AvgBusBW != nil {
			ha = append(ha, *r.AvgBusBW)
		}
	}
	for _, r := range g {
		if r.AvgBusBW != nil {
			ga = append(ga, *r.AvgBusBW)
		}
	}
	hm, ok1 := median(ha)
	gm, ok2 := median(ga)
	if ok1 && ok2 {
		if d, ok := deltaPct(hm, gm); ok {
			c.AvgBusBW = &Compare{Host: hm, Guest: gm, DeltaPct: d}
		}
	}
	return c
}

// checkLargest holds a collective to its largest message: the largest size either side
// measured (points are in size order) must be in every round of both sides with a
// finite busbw, and the two medians must compare. Otherwise the loss there is unknown,
// and judging the next smaller size instead would let a guest that failed (nan),
// overflowed (inf) or stopped (no row) at the largest message pass; each such gap is a
// Fail naming the size, the side and the file. It reports whether the largest message
// can be judged.
func checkLargest(name string, points []Point, h, g []*NCCLRun, inPlace bool, add func(Severity, string, string, ...any)) bool {
	if len(points) == 0 {
		return false
	}
	top := points[len(points)-1]
	size := sizeString(top.Size)
	ok := true
	for _, side := range []struct {
		name    string
		runs    []*NCCLRun
		samples Samples
	}{{"host", h, top.HostSamples}, {"guest", g, top.GuestSamples}} {
		if len(side.samples) == 0 {
			other := map[string]string{"host": "guest", "guest": "host"}[side.name]
			add(Fail, name, "largest message %s is missing on the %s (the %s measured it): the verdict is held to the largest message, not a smaller one", size, side.name, other)
			ok = false
			continue
		}
		for _, r := range side.runs {
			rows := 0
			for _, row := range r.Rows {
				if row.Size != top.Size {
					continue
				}
				rows++
				v := row.OutOfPlace
				if inPlace {
					v = row.InPlace
				}
				if !v.Valid() {
					add(Fail, name, "largest message %s: %s line %d: %s busbw is %s, not a measurement", size, r.File, row.Line, side.name, busbwString(v.BusBW))
					ok = false
				}
			}
			if rows == 0 {
				add(Fail, name, "largest message %s: %s (%s) has no row for it: the round stopped short of it or ran to a smaller -e", size, r.File, side.name)
				ok = false
			}
		}
	}
	if ok && top.DeltaPct == nil {
		add(Fail, name, "largest message %s: busbw %s -> %s GB/s cannot be compared", size, fmtPtr(top.Host, "%.2f"), fmtPtr(top.Guest, "%.2f"))
		ok = false
	}
	return ok
}

// busbwString prints a busbw the way a finding quotes a bad one: nan, +Inf, -3.
func busbwString(v float64) string {
	if math.IsNaN(v) {
		return "nan"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

func compareNVB(host, guest []*NVBRun, th Thresholds, add func(Severity, string, string, ...any)) []NVBTestcaseReport {
	type acc struct {
		tcs []NVBTestcase
	}
	collect := func(runs []*NVBRun) (map[string]*acc, []string) {
		m := map[string]*acc{}
		var order []string
		for _, r := range runs {
			for _, t := range r.Testcases {
				if t.Status != "" {
					continue
				}
				if _, ok := t.Value(); !ok {
					continue
				}
				if m[t.Name] == nil {
					m[t.Name] = &acc{}
					order = append(order, t.Name)
				}
				m[t.Name].tcs = append(m[t.Name].tcs, t)
			}
		}
		return m, order
	}
	hm, horder := collect(host)
	gm, gorder := collect(guest)
	order := append([]string{}, horder...)
	for _, n := range gorder {
		if hm[n] == nil {
			order = append(order, n)
		}
	}
	if len(host) == 0 && len(guest) == 0 {
		add(Warn, "nvbandwidth", "no nvbandwidth results on either side: host<->device copies not verified")
		return nil
	}
	var out []NVBTestcaseReport
	for _, n := range order {
		h, g := hm[n], gm[n]
		if h == nil || g == nil {
			sev := Info
			if checkedNVB[n] {
				sev = Fail
			}
			where := "host"
			if h == nil {
				where = "guest"
			}
			add(sev, n, "measured on the %s only", where)
			continue
		}
		r := NVBTestcaseReport{Name: n, Unit: "GB/s", Checked: checkedNVB[n], Basis: "sum"}
		hc, gc := cellCount(h.tcs), cellCount(g.tcs)
		if hc != gc {
			r.Basis = "per-gpu mean"
		}
		value := func(t NVBTestcase) float64 {
			v, _ := t.Value()
			if r.Basis == "sum" {
				return v
			}
			if n := len(t.Cells()); n > 0 {
				return v / float64(n)
			}
			return math.NaN()
		}
		for _, t := range h.tcs {
			r.HostSamples = append(r.HostSamples, value(t))
		}
		for _, t := range g.tcs {
			r.GuestSamples = append(r.GuestSamples, value(t))
		}
		hv, ok1 := median(r.HostSamples)
		gv, ok2 := median(r.GuestSamples)
		if ok1 {
			r.Host = ptr(hv)
		}
		if ok2 {
			r.Guest = ptr(gv)
		}
		if ok1 && ok2 {
			if d, ok := deltaPct(hv, gv); ok {
				r.DeltaPct = ptr(d)
			}
		}
		worstCell(&r, h.tcs, g.tcs)
		if r.Checked {
			switch {
			case r.DeltaPct == nil:
				add(Fail, n, "no comparable value on both sides")
			case *r.DeltaPct < -th.NVBandwidthPct:
				add(Fail, n, "%.2f -> %.2f %s (%s), %+.2f%% (limit -%g%%)", hv, gv, r.Unit, r.Basis, *r.DeltaPct, th.NVBandwidthPct)
			}
		}
		out = append(out, r)
	}
	for _, want := range []string{"host_to_device", "device_to_host"} {
		found := false
		for _, r := range out {
			if r.Checked && strings.HasPrefix(r.Name, want) {
				found = true
			}
		}
		if !found && (len(host) > 0 || len(guest) > 0) {
			add(Warn, "nvbandwidth", "no %s_memcpy testcase on both sides", want)
		}
	}
	return out
}

// cellCount is the number of valid cells of a testcase's first run, the GPU count for
// host<->device testcases.
func cellCount(ts []NVBTestcase) int {
	if len(ts) == 0 {
		return 0
	}
	return len(ts[0].Cells())
}

func worstCell(r *NVBTestcaseReport, h, g []NVBTestcase) {
	shape := func(ts []NVBTestcase) (int, int, bool) {
		if len(ts) == 0 || len(ts[0].Matrix) == 0 {
			return 0, 0, false
		}
		rows, cols := len(ts[0].Matrix), len(ts[0].Matrix[0])
		for _, t := range ts {
			if len(t.Matrix) != rows {
				return 0, 0, false
			}
			for _, row := range t.Matrix {
				if len(row) != cols {
					return 0, 0, false
				}
			}
		}
		return rows, cols, true
	}
	hr, hcn, ok1 := shape(h)
	gr, gcn, ok2 := shape(g)
	if !ok1 || !ok2 || hr != gr || hcn != gcn {
		return
	}
	for i := 0; i < hr; i++ {
		for j := 0; j < hcn; j++ {
			var hv, gv []float64
			for _, t := range h {
				hv = append(hv, t.Matrix[i][j])
			}
			for _, t := range g {
				gv = append(gv, t.Matrix[i][j])
			}
			a, ok1 := median(hv)
			b, ok2 := median(gv)
			if !ok1 || !ok2 {
				continue
			}
			d, ok := deltaPct(a, b)
			if !ok {
				continue
			}
			if r.WorstCellDelta == nil || d < *r.WorstCellDelta {
				r.WorstCellDelta = ptr(d)
				r.WorstCell = fmt.Sprintf("row %d, column %d", i, j)
			}
		}
	}
}

// sizeString prints a message size the way operators say it: 8 B, 128 KiB, 8 GiB.
func sizeString(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	v := n
	for v >= 1024 && v%1024 == 0 && i < len(units)-1 {
		v /= 1024
		i++
	}
	return fmt.Sprintf("%d %s", v, units[i])
}
