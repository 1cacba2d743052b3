package stages

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"
)

func ok(context.Context, *State, *Result) error { return nil }

func fail(context.Context, *State, *Result) error { return errors.New("boom") }

func degrade(_ context.Context, _ *State, r *Result) error {
	r.Degrade("half done")
	return nil
}

func skip(context.Context, *State, *Result) error { return Skip("not configured") }

func statuses(rs []Result) map[string]Status {
	m := map[string]Status{}
	for _, r := range rs {
		m[r.Name] = r.Status
	}
	return m
}

func TestFailurePolicy(t *testing.T) {
	type fn = func(context.Context, *State, *Result) error
	tests := []struct {
		name   string
		stages []Stage
		want   map[string]Status
	}{
		{"all ok", []Stage{{Name: "a", Run: ok}, {Name: "b", Needs: []string{"a"}, Run: ok}},
			map[string]Status{"a": OK, "b": OK}},
		{"failure does not stop unrelated stages", []Stage{{Name: "a", Run: fail}, {Name: "b", Run: ok}, {Name: "manifest", Run: ok}},
			map[string]Status{"a": Failed, "b": OK, "manifest": OK}},
		{"network failed skips publish", []Stage{
			{Name: "network", Run: fail}, {Name: "manifest", Run: ok}, {Name: "publish", Needs: []string{"network", "manifest"}, Run: ok}},
			map[string]Status{"network": Failed, "manifest": OK, "publish": Skipped}},
		{"degraded dependency still runs", []Stage{{Name: "a", Run: degrade}, {Name: "b", Needs: []string{"a"}, Run: ok}},
			map[string]Status{"a": Degraded, "b": OK}},
		{"skip propagates", []Stage{{Name: "net", Run: skip}, {Name: "publish", Needs: []string{"net"}, Run: ok}, {Name: "handoff", Run: ok}},
			map[string]Status{"net": Skipped, "publish": Skipped, "handoff": OK}},
		{"skip propagates transitively", []Stage{{Name: "a", Run: fail}, {Name: "b", Needs: []string{"a"}, Run: ok}, {Name: "c", Needs: []string{"b"}, Run: ok}},
			map[string]Status{"a": Failed, "b": Skipped, "c": Skipped}},
		{"error after degrade is failed", []Stage{{Name: "a", Run: fn(func(_ context.Context, _ *State, r *Result) error {
			r.Degrade("x")
			return errors.New("then broke")
		})}}, map[string]Status{"a": Failed}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rn := &Runner{Stages: tt.stages, Timeout: time.Second}
			rs, err := rn.Run(context.Background(), &State{})
			if err != nil {
				t.Fatal(err)
			}
			if got := statuses(rs); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("statuses = %v, want %v", got, tt.want)
			}
			for _, r := range rs {
				if (r.Status == Failed || r.Status == Skipped) && r.Err == nil {
					t.Errorf("stage %s %s without a reason", r.Name, r.Status)
				}
			}
		})
	}
}

func TestSkipReasonNamesDependency(t *testing.T) {
	rn := &Runner{Stages: []Stage{{Name: "network", Run: fail}, {Name: "publish", Needs: []string{"network"}, Run: ok}}}
	rs, _ := rn.Run(context.Background(), &State{})
	if msg := rs[1].Err.Error(); !strings.Contains(msg, "network") || !strings.Contains(msg, "failed") {
		t.Errorf("skip reason %q does not name the failed dependency", msg)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name   string
		stages []Stage
		want   string
	}{
		{"later dependency", []Stage{{Name: "a", Needs: []string{"b"}, Run: ok}, {Name: "b", Run: ok}}, "stage a: needs b"},
		{"duplicate", []Stage{{Name: "a", Run: ok}, {Name: "a", Run: ok}}, "stage a: defined twice"},
		{"no run", []Stage{{Name: "a"}}, "stage a: no Run"},
		{"no name", []Stage{{Run: ok}}, "stage 0: no name"},
	}
	for _, tt := range tests {
		rn := &Runner{Stages: tt.stages}
		_, err := rn.Run(context.Background(), &State{})
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: err = %v, want %q", tt.name, err, tt.want)
		}
	}
}

func TestPanicRecovered(t *testing.T) {
	var nilMap map[string]int
	rn := &Runner{Stages: []Stage{
		{Name: "scan", Run: func(context.Context, *State, *Result) error { panic("bad config space") }},
		{Name: "decide", Run: func(context.Context, *State, *Result) error { nilMap["x"] = 1; return nil }},
		{Name: "manifest", Run: ok},
	}}
	rs, err := rn.Run(context.Background(), &State{})
	if err != nil {
		t.Fatal(err)
	}
	if got := statuses(rs); !reflect.DeepEqual(got, map[string]Status{"scan": Failed, "decide": Failed, "manifest": OK}) {
		t.Fatalf("statuses = %v", got)
	}
	if !strings.Contains(rs[0].Err.Error(), "panic: bad config space") {
		t.Errorf("scan err = %v", rs[0].Err)
	}
	if !strings.Contains(rs[1].Err.Error(), "nil map") {
		t.Errorf("decide err = %v", rs[1].Err)
	}
}

func TestDeadlines(t *testing.T) {
	block := make(chan struct{})
	defer close(block)
	rn := &Runner{
		Timeout: 20 * time.Millisecond,
		Grace:   20 * time.Millisecond,
		Stages: []Stage{
			{Name: "polite", Run: func(ctx context.Context, _ *State, _ *Result) error {
				<-ctx.Done()
				return ctx.Err()
			}},
			{Name: "ignores", Run: func(context.Context, *State, *Result) error {
				<-block // never honours ctx: the runner must abandon it
				return nil
			}},
			{Name: "late-nil", Timeout: 10 * time.Millisecond, Run: func(ctx context.Context, _ *State, _ *Result) error {
				<-ctx.Done()
				return nil // returned nil but past its deadline: partial work
			}},
			{Name: "manifest", Run: ok},
		},
	}
	rs, err := rn.Run(context.Background(), &State{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Status{"polite": Failed, "ignores": Failed, "late-nil": Failed, "manifest": OK}
	if got := statuses(rs); !reflect.DeepEqual(got, want) {
		t.Fatalf("statuses = %v, want %v", got, want)
	}
	if !errors.Is(rs[0].Err, context.DeadlineExceeded) {
		t.Errorf("polite err = %v", rs[0].Err)
	}
	if !strings.Contains(rs[1].Err.Error(), "abandoned") {
		t.Errorf("ignores err = %v", rs[1].Err)
	}
	if !strings.Contains(rs[2].Err.Error(), "deadline 10ms exceeded") {
		t.Errorf("late-nil err = %v", rs[2].Err)
	}
}

func TestAlwaysRunsAfterCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var sawLive bool
	rn := &Runner{Stages: []Stage{
		{Name: "a", Run: func(context.Context, *State, *Result) error { cancel(); return nil }},
		{Name: "b", Run: ok},
		{Name: "manifest", Always: true, Run: func(ctx context.Context, st *State, _ *Result) error {
			if got := statuses(st.Results()); !reflect.DeepEqual(got, map[string]Status{"a": OK, "b": Skipped}) {
				t.Errorf("results seen by manifest = %v", got)
			}
			sawLive = ctx.Err() == nil
			return nil
		}},
	}}
	rs, _ := rn.Run(ctx, &State{})
	if got := statuses(rs); !reflect.DeepEqual(got, map[string]Status{"a": OK, "b": Skipped, "manifest": OK}) {
		t.Errorf("statuses = %v", got)
	}
	if !sawLive {
		t.Error("the Always stage got a cancelled context")
	}
}

func TestUnitsFailedExcluded(t *testing.T) {
	st := &State{}
	var bound []string
	rn := &Runner{Stages: []Stage{
		{Name: "decide", Run: func(_ context.Context, st *State, _ *Result) error {
			st.SetUnits([]Unit{{ID: "gpu0", GPU: "0000:03:00.0", NICs: []string{"0000:04:00.0"}},
				{ID: "gpu1", GPU: "0000:13:00.0"}, {ID: "gpu2", GPU: "0000:23:00.0"}})
			return nil
		}},
		{Name: "check", Run: func(_ context.Context, st *State, r *Result) error {
			if err := st.Mark("gpu1", Failed, "ats: no ATS on 0000:14:00.0"); err != nil {
				return err
			}
			if err := st.Mark("gpu2", Degraded, "ats: no DT"); err != nil {
				return err
			}
			// A unit's status never improves, and a reason it holds is not recorded twice.
			if err := st.Mark("gpu1", Degraded, ""); err != nil {
				return err
			}
			if err := st.Mark("gpu1", Failed, "ats: no ATS on 0000:14:00.0"); err != nil {
				return err
			}
			if err := st.Mark("gpu2", Degraded, "acs: no DT on 0000:12:00.0"); err != nil {
				return err
			}
			r.Degrade("2 units affected")
			return st.Mark("gpu9", Failed, "x")
		}},
		{Name: "vfio", Needs: []string{"decide"}, Run: func(_ context.Context, st *State, _ *Result) error {
			for _, u := range st.Eligible() {
				bound = append(bound, u.ID)
			}
			return nil
		}},
	}}
	rs, _ := rn.Run(context.Background(), st)
	if rs[1].Status != Failed || !strings.Contains(rs[1].Err.Error(), "unit gpu9") {
		t.Errorf("marking an unknown unit: %v %v", rs[1].Status, rs[1].Err)
	}
	if !reflect.DeepEqual(bound, []string{"gpu0", "gpu2"}) {
		t.Errorf("vfio acted on %v, want gpu0 gpu2", bound)
	}
	us := st.Units()
	if us[1].Status != Failed || !reflect.DeepEqual(us[1].Reasons, []string{"ats: no ATS on 0000:14:00.0"}) {
		t.Errorf("gpu1 = %+v", us[1])
	}
	if us[2].Status != Degraded || !reflect.DeepEqual(us[2].Reasons, []string{"ats: no DT", "acs: no DT on 0000:12:00.0"}) {
		t.Errorf("gpu2 = %+v", us[2])
	}
	if us[0].Status != OK || len(us[0].Reasons) != 0 {
		t.Errorf("gpu0 = %+v", us[0])
	}
	if id, ok := st.UnitOf("0000:04:00.0"); !ok || id != "gpu0" {
		t.Errorf("UnitOf NIC = %q %v", id, ok)
	}
	if got := Summary(rs, us); got != Failed {
		t.Errorf("Summary = %v", got)
	}
	if got := Summary(rs[:1], us[:1]); got != OK {
		t.Errorf("Summary ok = %v", got)
	}
	if got := Summary([]Result{{Status: Skipped}}, []Unit{{Status: Degraded}}); got != Degraded {
		t.Errorf("Summary degraded = %v", got)
	}
}

func TestJSONLinesAndConsole(t *testing.T) {
	var log, con bytes.Buffer
	tick := time.Unix(0, 0)
	rn := &Runner{
		Console: &con, Log: &log,
		// Each call to the clock advances 250ms: every stage lasts exactly 250ms.
		Now: func() time.Time { tick = tick.Add(250 * time.Millisecond); return tick },
		Stages: []Stage{
			{Name: "acs", Run: func(_ context.Context, _ *State, r *Result) error {
				r.Findingf("bridge %s: DT not advertised", "0000:01:00.0")
				r.Changef("acs %s: ACSCtl 0x%04x -> 0x%04x", "0000:02:00.0", 0x1d, 0x5d)
				return nil
			}},
			{Name: "network", Run: fail},
			{Name: "publish", Needs: []string{"network"}, Run: ok},
		},
	}
	if _, err := rn.Run(context.Background(), &State{}); err != nil {
		t.Fatal(err)
	}
	logged := append([]byte(nil), log.Bytes()...)
	var got []map[string]any
	sc := bufio.NewScanner(&log)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		got = append(got, m)
	}
	if len(got) != 3 {
		t.Fatalf("%d log lines, want 3", len(got))
	}
	if got[0]["type"] != "stage" || got[0]["name"] != "acs" || got[0]["status"] != "ok" || got[0]["duration_ms"] != 250.0 {
		t.Errorf("line 0 = %v", got[0])
	}
	if ch := got[0]["changes"].([]any); len(ch) != 1 || ch[0] != "acs 0000:02:00.0: ACSCtl 0x001d -> 0x005d" {
		t.Errorf("changes = %v", ch)
	}
	if got[1]["error"] != "boom" || got[1]["status"] != "failed" {
		t.Errorf("line 1 = %v", got[1])
	}
	if got[2]["status"] != "skipped" || !strings.Contains(got[2]["error"].(string), "needs network") {
		t.Errorf("line 2 = %v", got[2])
	}
	c := con.String()
	for _, want := range []string{
		"passage: acs       ok         0.250s  (1 findings, 1 changes)\n",
		"passage:   - bridge 0000:01:00.0: DT not advertised\n",
		"passage:   + acs 0000:02:00.0: ACSCtl 0x001d -> 0x005d\n",
		"passage: network   failed     0.250s\npassage:   ! boom\n",
		"passage: publish   skipped    0.000s\n",
	} {
		if !strings.Contains(c, want) {
			t.Errorf("console lacks %q:\n%s", want, c)
		}
	}

	var ub bytes.Buffer
	units := []Unit{{ID: "gpu0", GPU: "0000:03:00.0", NICs: []string{"0000:04:00.0", "0000:04:00.1"}, Status: Degraded, Reasons: []string{"no ATS", "no DT"}}}
	if err := WriteUnitsJSON(&ub, units); err != nil {
		t.Fatal(err)
	}
	var u map[string]any
	if err := json.Unmarshal(ub.Bytes(), &u); err != nil {
		t.Fatal(err)
	}
	if u["type"] != "unit" || u["id"] != "gpu0" || u["status"] != "degraded" || len(u["nics"].([]any)) != 2 {
		t.Errorf("unit line = %v", u)
	}
	// ReadStages gives the stage lines back in order, passing over the unit line.
	recs, err := ReadStages(io.MultiReader(bytes.NewReader(logged), bytes.NewReader(ub.Bytes())))
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 3 || recs[0].Name != "acs" || recs[0].DurationMS != 250 || len(recs[0].Changes) != 1 ||
		recs[1].Status != Failed || recs[1].Error != "boom" || recs[2].Name != "publish" || recs[2].Status != Skipped {
		t.Errorf("ReadStages = %+v", recs)
	}
	if _, err := ReadStages(strings.NewReader("{\"type\":\"stage\"}\nnot json\n")); err == nil || !strings.Contains(err.Error(), "log line 2") {
		t.Errorf("a malformed line: %v, want an error naming line 2", err)
	}
	var tb bytes.Buffer
	if err := WriteUnitTable(&tb, units); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(tb.String()), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "UNIT") ||
		strings.Join(strings.Fields(lines[1]), " ") != "gpu0 0000:03:00.0 0000:04:00.0,0000:04:00.1 degraded no ATS (+1 more)" {
		t.Errorf("unit table:\n%s", tb.String())
	}

	// An ok unit reads "ready" on the console, as in the manifest.
	tb.Reset()
	if err := WriteUnitTable(&tb, []Unit{{ID: "gpu1", GPU: "0000:13:00.0", Status: OK}}); err != nil {
		t.Fatal(err)
	}
	if got := strings.Fields(strings.Split(strings.TrimSpace(tb.String()), "\n")[1]); len(got) != 4 || got[3] != "ready" {
		t.Errorf("ok unit row %q", got)
	}
}

// TestUnitsJSONWords: log.jsonl's unit lines say ready, degraded or failed, as the
// manifest and the console do.
func TestUnitsJSONWords(t *testing.T) {
	var b bytes.Buffer
	if err := WriteUnitsJSON(&b, []Unit{{ID: "gpu0", Status: OK}, {ID: "gpu1", Status: Degraded}, {ID: "gpu2", Status: Failed}}); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		var u struct{ Type, ID, Status string }
		if err := json.Unmarshal([]byte(line), &u); err != nil {
			t.Fatal(err)
		}
		got = append(got, u.Type+" "+u.ID+" "+u.Status)
	}
	if strings.Join(got, ", ") != "unit gpu0 ready, unit gpu1 degraded, unit gpu2 failed" {
		t.Errorf("unit lines: %v", got)
	}
}

// TestVerboseConsole: passage.debug prints a stage's whole error (a panic's stack), the
// plain console its first line.
func TestVerboseConsole(t *testing.T) {
	for _, verbose := range []bool{false, true} {
		var con bytes.Buffer
		rn := &Runner{Stages: []Stage{{Name: "scan", Run: func(context.Context, *State, *Result) error { panic("bad config space") }}},
			Console: &con, Verbose: verbose}
		if _, err := rn.Run(context.Background(), &State{}); err != nil {
			t.Fatal(err)
		}
		errLines := strings.Count(con.String(), "passage:   ! ")
		if verbose && (errLines < 3 || !strings.Contains(con.String(), "goroutine")) || !verbose && errLines != 1 {
			t.Errorf("verbose %v: %d error lines:\n%s", verbose, errLines, con.String())
		}
	}
}
