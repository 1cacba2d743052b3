package perfcheck

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"testing/fstest"
)

func loadB300(t *testing.T) (host, guest *Side) {
	t.Helper()
	var err error
	if host, err = Load(os.DirFS("testdata/b300/host"), "host"); err != nil {
		t.Fatal(err)
	}
	if guest, err = Load(os.DirFS("testdata/b300/guest"), "guest"); err != nil {
		t.Fatal(err)
	}
	return host, guest
}

func defaultOpts() Options { return Options{Thresholds: DefaultThresholds} }

func findingsOf(rep *Report, sev Severity) []Finding {
	var out []Finding
	for _, f := range rep.Findings {
		if f.Severity == sev {
			out = append(out, f)
		}
	}
	return out
}

func collective(t *testing.T, rep *Report, name string) CollectiveReport {
	t.Helper()
	for _, c := range rep.Collectives {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no %s in report", name)
	return CollectiveReport{}
}

func TestLoadLayouts(t *testing.T) {
	host, guest := loadB300(t)
	for _, side := range []*Side{host, guest} {
		if len(side.NCCL) != 5 {
			t.Errorf("%s: %d collectives", side.Dir, len(side.NCCL))
		}
		for _, c := range collectives[:5] {
			if n := len(side.NCCL[c]); n != 3 {
				t.Errorf("%s %s: %d rounds, want 3", side.Dir, c, n)
			}
		}
		if len(side.NVBandwidth) != 3 {
			t.Errorf("%s: %d nvbandwidth files", side.Dir, len(side.NVBandwidth))
		}
	}
	// flat host layout keeps name order; guest round directories too
	if f := host.NCCL["alltoall"][2].File; f != "host/alltoall_perf.3.txt" {
		t.Errorf("host alltoall round 3 = %s", f)
	}
	if f := guest.NCCL["alltoall"][0].File; f != "guest/round1/alltoall_perf.log" {
		t.Errorf("guest alltoall round 1 = %s", f)
	}
}

func TestLoadErrors(t *testing.T) {
	good, _ := os.ReadFile("testdata/b300/host/all_reduce_perf.1.txt")
	malformed, _ := os.ReadFile("testdata/nccl/malformed_alltoall.txt")
	tests := []struct {
		name string
		fs   fstest.MapFS
		want string
	}{
		{"empty", fstest.MapFS{}, "h: no nccl-tests or nvbandwidth results"},
		{"stray file", fstest.MapFS{"all_reduce.txt": {Data: good}, "notes.md": {Data: []byte("x\n")}}, "h/notes.md: neither nccl-tests nor nvbandwidth"},
		{"name and content disagree", fstest.MapFS{"alltoall_perf.1.txt": {Data: good}}, "h/alltoall_perf.1.txt: file is named for alltoall but holds all_reduce_perf output"},
		{"no collective", fstest.MapFS{"round1.txt": {Data: malformed[:bytes.Index(malformed, []byte("       32768"))]}}, "h/round1.txt: nccl-tests output, but neither"},
		{"malformed row", fstest.MapFS{"r1/alltoall.txt": {Data: malformed}}, "h/r1/alltoall.txt:7:"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Load(tc.fs, "h")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
	// hidden files and directories are not results
	side, err := Load(fstest.MapFS{"all_reduce.txt": {Data: good}, ".notes": {Data: []byte("x")}, ".git/config": {Data: []byte("x")}}, "h")
	if err != nil || len(side.NCCL["all_reduce"]) != 1 {
		t.Fatalf("hidden files: %v", err)
	}
}

// medianOf recomputes a point from the parsed files, independently of CompareSides.
func medianOf(t *testing.T, runs []*NCCLRun, size int64) float64 {
	t.Helper()
	var v []float64
	for _, r := range runs {
		for _, row := range r.Rows {
			if row.Size == size {
				v = append(v, row.OutOfPlace.BusBW)
			}
		}
	}
	if len(v) != 3 {
		t.Fatalf("size %d: %d samples", size, len(v))
	}
	sort.Float64s(v)
	return v[1]
}

func TestCompareB300Passes(t *testing.T) {
	host, guest := loadB300(t)
	rep := CompareSides(host, guest, defaultOpts())
	if !rep.Pass || len(findingsOf(rep, Fail)) > 0 || len(findingsOf(rep, Warn)) > 0 {
		t.Fatalf("pass=%v findings=%+v", rep.Pass, rep.Findings)
	}
	if len(rep.Collectives) != 5 || rep.Collectives[0].Name != "all_reduce" {
		t.Fatalf("collectives %+v", rep.Collectives)
	}
	// every delta is (guest - host) / host of medians taken from the files
	for _, c := range rep.Collectives {
		for _, p := range c.Points {
			h, g := medianOf(t, host.NCCL[c.Name], p.Size), medianOf(t, guest.NCCL[c.Name], p.Size)
			if *p.Host != h || *p.Guest != g {
				t.Fatalf("%s %d: medians %v/%v, want %v/%v", c.Name, p.Size, *p.Host, *p.Guest, h, g)
			}
			if h == 0 {
				if p.DeltaPct != nil {
					t.Fatalf("%s %d: delta against 0 GB/s", c.Name, p.Size)
				}
				continue
			}
			if want := (g - h) / h * 100; math.Abs(*p.DeltaPct-want) > 1e-9 {
				t.Fatalf("%s %d: delta %v, want %v", c.Name, p.Size, *p.DeltaPct, want)
			}
		}
		if c.Largest == nil || c.Largest.Size != 8<<30 {
			t.Errorf("%s: largest %+v", c.Name, c.Largest)
		}
	}
	s := rep.Summary
	// the summary is the minimum over collectives
	for _, c := range rep.Collectives {
		if c.Largest.DeltaPct < s.Largest.DeltaPct || c.Worst8MiB.DeltaPct < s.Worst8MiB.DeltaPct {
			t.Errorf("%s is worse than the summary", c.Name)
		}
		for _, p := range c.Points {
			if p.Size >= Large8MiB && p.DeltaPct != nil && *p.DeltaPct < c.Worst8MiB.DeltaPct {
				t.Errorf("%s %d worse than worst_8mib", c.Name, p.Size)
			}
		}
	}
	if s.Largest.DeltaPct >= 0 || s.Largest.DeltaPct < -DefaultThresholds.LargestPct {
		t.Errorf("largest %+v", s.Largest)
	}
	// the alltoall 128 KiB dip is the outlier B300.md describes
	a2a := collective(t, rep, "alltoall")
	var found bool
	for _, o := range s.Outliers {
		if o.Collective == "alltoall" && o.Size == 128<<10 {
			found = o.DeltaPct < -5
		}
	}
	if !found || len(a2a.Repeated) != 0 {
		t.Errorf("alltoall 128 KiB outlier not flagged: outliers %+v repeated %+v", s.Outliers, a2a.Repeated)
	}
	if s.H2D == nil || s.H2D.Name != "host_to_device_memcpy_ce" || s.D2H == nil || s.D2H.Name != "device_to_host_memcpy_ce" {
		t.Fatalf("h2d %+v d2h %+v", s.H2D, s.D2H)
	}
	if *s.D2H.DeltaPct > -1 || *s.D2H.DeltaPct < -2 || s.D2H.Basis != "sum" {
		t.Errorf("d2h %+v", *s.D2H)
	}
}

func TestCompareThresholds(t *testing.T) {
	host, guest := loadB300(t)
	base := CompareSides(host, guest, defaultOpts())
	worst := base.Summary.Largest.DeltaPct // negative
	w8 := base.Summary.Worst8MiB.DeltaPct
	d2h := *base.Summary.D2H.DeltaPct

	// limits just above and just below each measured loss flip the verdict
	tests := []struct {
		name string
		th   Thresholds
		pass bool
		subj string
	}{
		{"largest just inside", Thresholds{-worst + 0.001, 100, 100, 1}, true, ""},
		{"largest just crossed", Thresholds{-worst - 0.001, 100, 100, 1}, false, base.Summary.Largest.Collective},
		{">=8MiB just crossed", Thresholds{100, -w8 - 0.001, 100, 1}, false, base.Summary.Worst8MiB.Collective},
		{"nvbandwidth just crossed", Thresholds{100, 100, -d2h - 0.001, 1}, false, "device_to_host_memcpy_ce"},
		{"nvbandwidth just inside", Thresholds{100, 100, -d2h + 0.001, 1}, true, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep := CompareSides(host, guest, Options{Thresholds: tc.th})
			if rep.Pass != tc.pass {
				t.Fatalf("pass = %v, findings %+v", rep.Pass, rep.Findings)
			}
			if !tc.pass {
				f := findingsOf(rep, Fail)
				if len(f) == 0 || f[0].Subject != tc.subj {
					t.Errorf("fail findings %+v, want subject %s", f, tc.subj)
				}
			}
		})
	}
}

// scaleGuest returns a copy of side where busbw of the rows >= from of one collective
// is multiplied by k in every round.
func scaleNCCL(side *Side, coll string, from int64, k float64) *Side {
	out := &Side{Dir: side.Dir, NCCL: map[string][]*NCCLRun{}, NVBandwidth: side.NVBandwidth}
	for c, runs := range side.NCCL {
		for _, r := range runs {
			cp := *r
			cp.Rows = append([]NCCLRow(nil), r.Rows...)
			if c == coll {
				for i := range cp.Rows {
					if cp.Rows[i].Size >= from {
						cp.Rows[i].OutOfPlace.BusBW *= k
					}
				}
			}
			out.NCCL[c] = append(out.NCCL[c], &cp)
		}
	}
	return out
}

func TestCompareFailures(t *testing.T) {
	host, guest := loadB300(t)
	t.Run("IOMMU-bound guest loses 3% on large messages", func(t *testing.T) {
		rep := CompareSides(host, scaleNCCL(guest, "reduce_scatter", 8<<20, 0.97), defaultOpts())
		if rep.Pass {
			t.Fatal("passed")
		}
		f := findingsOf(rep, Fail)
		// the largest message and every size from 8 MiB to 8 GiB (6 sizes)
		if len(f) != 7 {
			t.Errorf("%d fail findings: %+v", len(f), f)
		}
		if rep.Summary.Largest.Collective != "reduce_scatter" || rep.Summary.Largest.DeltaPct > -2.5 {
			t.Errorf("summary largest %+v", rep.Summary.Largest)
		}
	})
	t.Run("in-place column is compared on request", func(t *testing.T) {
		// the loss was put in the out-of-place column only
		rep := CompareSides(host, scaleNCCL(guest, "reduce_scatter", 8<<20, 0.97), Options{Thresholds: DefaultThresholds, InPlace: true})
		if !rep.Pass || rep.Column != "in-place" {
			t.Fatalf("pass=%v column=%s %+v", rep.Pass, rep.Column, findingsOf(rep, Fail))
		}
	})
	t.Run("collective missing in the guest", func(t *testing.T) {
		g := scaleNCCL(guest, "", 0, 1)
		delete(g.NCCL, "sendrecv")
		rep := CompareSides(host, g, defaultOpts())
		f := findingsOf(rep, Fail)
		if rep.Pass || len(f) != 1 || f[0].Subject != "sendrecv" {
			t.Fatalf("findings %+v", f)
		}
	})
	t.Run("small-message loss repeated by a neighbour", func(t *testing.T) {
		rep := CompareSides(host, scaleNCCL(guest, "all_gather", 0, 0.9), Options{Thresholds: Thresholds{100, 100, 100, 1}})
		c := collective(t, rep, "all_gather")
		if len(c.Repeated) == 0 || len(c.Outliers) != 0 {
			t.Fatalf("repeated %+v outliers %+v", c.Repeated, c.Outliers)
		}
		if !rep.Pass || len(findingsOf(rep, Warn)) != 1 {
			t.Errorf("small messages must warn, not fail: %+v", rep.Findings)
		}
	})
	t.Run("aborted, truncated, wrong", func(t *testing.T) {
		g := scaleNCCL(guest, "", 0, 1)
		g.NCCL["all_gather"] = append(g.NCCL["all_gather"], parseNCCLFile(t, "testdata/nccl/aborted_all_gather.txt"))
		g.NCCL["all_reduce"] = append(g.NCCL["all_reduce"], parseNCCLFile(t, "testdata/nccl/truncated_all_reduce.txt"))
		g.NCCL["reduce_scatter"] = append(g.NCCL["reduce_scatter"], parseNCCLFile(t, "testdata/nccl/wrong_reduce_scatter.txt"))
		rep := CompareSides(host, g, defaultOpts())
		var msgs []string
		for _, f := range rep.Findings {
			msgs = append(msgs, string(f.Severity)+" "+f.Subject+": "+f.Message)
		}
		all := strings.Join(msgs, "\n")
		for _, want := range []string{
			"fail aborted_all_gather.txt: run aborted at line 25",
			"warn truncated_all_reduce.txt: no \"# Avg bus bandwidth\" footer",
			"fail wrong_reduce_scatter.txt: nccl-tests reports 2 out-of-bounds values",
			"fail wrong_reduce_scatter.txt: line 19: 4 MiB in-place has 10000 wrong elements",
			"fail wrong_reduce_scatter.txt: line 21: 64 MiB out-of-place has 12 wrong elements",
			"warn all_reduce: host has 3 rounds, guest 4",
		} {
			if !strings.Contains(all, want) {
				t.Errorf("missing %q in\n%s", want, all)
			}
		}
		if rep.Pass {
			t.Error("passed")
		}
	})
}

func nvbSide(t *testing.T, dir string, files ...string) *Side {
	s := &Side{Dir: dir, NCCL: map[string][]*NCCLRun{}}
	for _, f := range files {
		s.NVBandwidth = append(s.NVBandwidth, parseNVBFile(t, f))
	}
	return s
}

func TestCompareNVBandwidth(t *testing.T) {
	hostFiles := []string{"testdata/b300/host/nvbandwidth.1.txt", "testdata/b300/host/nvbandwidth.2.txt", "testdata/b300/host/nvbandwidth.3.txt"}
	host := nvbSide(t, "host", hostFiles...)
	t.Run("guest with one GPU compares per-GPU means", func(t *testing.T) {
		guest := nvbSide(t, "guest", "testdata/nvbandwidth/waived.txt")
		rep := CompareSides(host, guest, defaultOpts())
		h2d := rep.Summary.H2D
		if h2d == nil || h2d.Basis != "per-gpu mean" || h2d.WorstCell != "" {
			t.Fatalf("h2d %+v", h2d)
		}
		// per-GPU host mean: the median SUM over 8 cells, per round
		var means []float64
		for _, r := range host.NVBandwidth {
			v, _ := r.Testcases[0].Value()
			means = append(means, v/8)
		}
		sort.Float64s(means)
		if math.Abs(*h2d.Host-means[1]) > 1e-9 || *h2d.Guest != 57.08 {
			t.Errorf("host %v guest %v, want %v 57.08", *h2d.Host, *h2d.Guest, means[1])
		}
	})
	t.Run("a D2H testcase only on the host fails", func(t *testing.T) {
		guest := nvbSide(t, "guest", "testdata/nvbandwidth/truncated.txt")
		rep := CompareSides(host, guest, defaultOpts())
		var subjects []string
		for _, f := range findingsOf(rep, Fail) {
			subjects = append(subjects, f.Subject)
		}
		if rep.Pass || !strings.Contains(strings.Join(subjects, ","), "device_to_host_memcpy_ce") {
			t.Fatalf("fail findings %v", subjects)
		}
	})
	t.Run("aborted nvbandwidth fails", func(t *testing.T) {
		guest := nvbSide(t, "guest", "testdata/nvbandwidth/aborted.txt")
		rep := CompareSides(host, guest, defaultOpts())
		f := findingsOf(rep, Fail)
		if rep.Pass || len(f) == 0 || !strings.Contains(f[0].Message, "CUDA_ERROR_ILLEGAL_ADDRESS") {
			t.Fatalf("findings %+v", rep.Findings)
		}
	})
	t.Run("worst cell finds one slow GPU", func(t *testing.T) {
		guest := nvbSide(t, "guest", hostFiles...)
		for _, r := range guest.NVBandwidth {
			for i := range r.Testcases {
				if r.Testcases[i].Name == "device_to_host_memcpy_ce" {
					m := append([]float64(nil), r.Testcases[i].Matrix[0]...)
					m[5] *= 0.9
					r.Testcases[i].Matrix = [][]float64{m}
				}
			}
		}
		rep := CompareSides(host, guest, defaultOpts())
		d := rep.Summary.D2H
		if d.WorstCell != "row 0, column 5" || math.Abs(*d.WorstCellDelta+10) > 1e-9 || *d.DeltaPct != 0 {
			t.Fatalf("d2h %+v cell %v", d, *d.WorstCellDelta)
		}
	})
}

func TestReportJSON(t *testing.T) {
	host, guest := loadB300(t)
	g := scaleNCCL(guest, "", 0, 1)
	g.NCCL["sendrecv"] = append(g.NCCL["sendrecv"], parseNCCLFile(t, "testdata/nccl/nan_sendrecv.txt"))
	rep := CompareSides(host, g, defaultOpts())
	data, err := json.Marshal(rep)
	if err != nil {
		t.Fatalf("marshal with nan samples: %v", err)
	}
	var back Report
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	if back.Pass != rep.Pass || len(back.Collectives) != 5 || back.Summary.Largest.DeltaPct != rep.Summary.Largest.DeltaPct {
		t.Errorf("round trip lost data")
	}
	if !bytes.Contains(data, []byte(`"guest_samples":[null]`)) {
		t.Errorf("nan sample is not null in JSON")
	}
}

func TestWriteHTML(t *testing.T) {
	host, guest := loadB300(t)
	rep := CompareSides(host, scaleNCCL(guest, "all_reduce", 1<<30, 0.95), defaultOpts())
	var buf bytes.Buffer
	if err := WriteHTML(&buf, rep); err != nil {
		t.Fatal(err)
	}
	page := buf.String()
	svgs := regexp.MustCompile(`(?s)<svg .*?</svg>`).FindAllString(page, -1)
	if len(svgs) != len(rep.Collectives) {
		t.Fatalf("%d plots for %d collectives", len(svgs), len(rep.Collectives))
	}
	for i, s := range svgs {
		// well-formed XML, two lines (host and guest)
		dec := xml.NewDecoder(strings.NewReader(s))
		polylines := 0
		for {
			tok, err := dec.Token()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("plot %d is not well-formed: %v", i, err)
			}
			if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "polyline" {
				polylines++
			}
		}
		if polylines != 2 {
			t.Errorf("plot %d: %d polylines", i, polylines)
		}
	}
	for _, bad := range []string{"<script", "src=", "href=", "@import", "url("} {
		if strings.Contains(page, bad) {
			t.Errorf("page has %q: it must not load anything", bad)
		}
	}
	if !strings.Contains(page, `class="FAIL"`) || !strings.Contains(page, "all_reduce") {
		t.Error("verdict or collective missing")
	}
}

func TestRunWritesReports(t *testing.T) {
	dir := t.TempDir()
	htmlFile := filepath.Join(dir, "r.html")
	var out bytes.Buffer
	rep, err := Run(Config{HostDir: "testdata/b300/host", GuestDir: "testdata/b300/guest", Options: defaultOpts(), HTMLFile: htmlFile}, &out)
	if err != nil || !rep.Pass {
		t.Fatalf("err=%v pass=%v", err, rep != nil && rep.Pass)
	}
	if !strings.HasSuffix(out.String(), "verdict: PASS\n") || !strings.Contains(out.String(), "small-message outlier 128 KiB") {
		t.Errorf("text report:\n%s", out.String())
	}
	if st, err := os.Stat(htmlFile); err != nil || st.Size() == 0 {
		t.Errorf("html: %v", err)
	}
	out.Reset()
	if _, err := Run(Config{HostDir: "testdata/b300/host", GuestDir: "testdata/b300/guest", Options: defaultOpts(), JSON: true}, &out); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(out.Bytes(), &back); err != nil || !back.Pass {
		t.Errorf("json: %v", err)
	}
	if _, err := Run(Config{HostDir: "testdata/b300/host", GuestDir: "testdata/nope"}, io.Discard); err == nil {
		t.Error("missing guest dir accepted")
	}
	if _, err := Run(Config{HostDir: "testdata/b300/host/nvbandwidth.1.txt", GuestDir: "testdata/b300/guest"}, io.Discard); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("file as dir: %v", err)
	}
}
