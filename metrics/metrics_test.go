package metrics_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"gopkg.in/yaml.v3"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/metrics"
)

const rulesFile = "../monitoring/passage.rules.yml"

func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (image/deps.sh installs Debian's prometheus): %v", err)
	}
	return p
}

// degraded is the B300 manifest after a boot on which gpu1's CX-8 had no ATS (degraded,
// DT left off), gpu2's NIC port did not take its write (failed), and whose node
// identity carries the characters the format must escape.
func degraded() *manifest.Manifest {
	m := manifesttest.B300(9)
	m.Node.Hostname = "rack\"7\\n3\nx"
	u1 := &m.Units[1]
	u1.Status = manifest.StatusDegraded
	u1.Reasons = []string{"no ATS on 2 NIC functions: DT off"}
	u1.ATSFindings = []manifest.Finding{
		{Object: u1.Functions[1].BDF, Severity: "warning", Message: "no ATS capability"},
		{Object: u1.Functions[2].BDF, Severity: "warning", Message: "no ATS capability"},
	}
	u2 := &m.Units[2]
	u2.Status = manifest.StatusFailed
	u2.ACSChanges[2].Result = "failed: write: input/output error"
	m.Stages = []manifest.StageResult{
		{Name: "scan", Status: "ok", Duration: 51e6},
		{Name: "acs", Status: "degraded", Duration: 12e6},
		{Name: "vfio", Status: "failed", Duration: 58e6},
	}
	return m
}

// hostile is a manifest whose strings are not UTF-8 and which lists a unit, a function
// and a stage twice: what an unsigned payload, or one written by a broken signer, can be.
func hostile() *manifest.Manifest {
	m := manifesttest.B300(2)
	m.Node.Hostname, m.Node.DMISerial = "node\xff\xfe", "S\xc3("
	m.Units[1].Functions[0].DriverAfter = "vfio\x80"
	m.Units = append(m.Units, m.Units[0])
	m.Units[2].Functions[1] = m.Units[2].Functions[0]
	m.Stages = append(m.Stages, m.Stages[0])
	return m
}

// The text format admits each series once and UTF-8 only: a hostile manifest's
// exposition still parses, each series once, its bad bytes replaced.
func TestExpositionHostileManifest(t *testing.T) {
	text := render(t, metrics.Source{Manifest: hostile(), Signed: true})
	if !utf8.ValidString(text) {
		t.Errorf("exposition is not UTF-8")
	}
	seen := map[string]bool{}
	for _, l := range strings.Split(strings.TrimSpace(text), "\n") {
		if strings.HasPrefix(l, "#") {
			continue
		}
		series := l[:strings.LastIndexByte(l, ' ')]
		if seen[series] {
			t.Errorf("series twice: %s", series)
		}
		seen[series] = true
	}
	if !strings.Contains(text, "hostname=\"node\ufffd\"") {
		t.Errorf("hostname not replaced:\n%s", text)
	}
}

func render(t *testing.T, src metrics.Source) string {
	t.Helper()
	var b bytes.Buffer
	if err := metrics.Write(&b, src); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// live is every port of m reading what the manifest recorded, but for drifted.
func live(m *manifest.Manifest, drifted string) map[string]string {
	l := map[string]string{}
	for _, u := range m.Units {
		for _, c := range u.ACSChanges {
			l[c.Port] = c.After
		}
	}
	l[drifted] = "SrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-"
	return l
}

func TestPromtoolCheckMetrics(t *testing.T) {
	bin := promtool(t)
	for name, src := range map[string]metrics.Source{
		"healthy":          {Manifest: manifesttest.B300(1), Signed: true},
		"degraded":         {Manifest: degraded(), Signed: true},
		"degraded, drift":  {Manifest: degraded(), Signed: true, LiveACS: live(degraded(), degraded().Units[0].ACSChanges[0].Port)},
		"unsigned, no run": {Manifest: &manifest.Manifest{SchemaVersion: manifest.SchemaVersion}},
		"invalid UTF-8":    {Manifest: hostile(), Signed: true, Signer: "SHA256:x (\xffkey.pub)"},
	} {
		text := render(t, src)
		cmd := exec.Command(bin, "check", "metrics")
		cmd.Stdin = strings.NewReader(text)
		out, err := cmd.CombinedOutput()
		if err != nil || len(bytes.TrimSpace(out)) != 0 {
			t.Errorf("%s: promtool check metrics: %v\n%s\non:\n%s", name, err, out, text)
		}
	}
}

func TestValues(t *testing.T) {
	m := degraded()
	port := m.Units[0].ACSChanges[2].Port
	text := render(t, metrics.Source{Manifest: m, Signed: true, LiveACS: live(m, port)})
	for _, want := range []string{
		`passage_build_info{version="v1.4.0",revision="3f2a9c1d5e7b8a604f1c2d3e4b5a69788c9d0e1f",goversion="go1.26.0"} 1`,
		`passage_unit_status{unit="gpu0",status="ready"} 1`,
		`passage_unit_status{unit="gpu1",status="degraded"} 1`,
		`passage_unit_status{unit="gpu1",status="ready"} 0`,
		`passage_unit_status{unit="gpu2",status="failed"} 1`,
		`passage_unit_ats_missing_functions{unit="gpu1"} 2`,
		`passage_unit_ats_missing_functions{unit="gpu0"} 0`,
		`passage_acs_ports{unit="gpu2",result="failed"} 1`,
		`passage_acs_ports{unit="gpu2",result="unchanged"} 2`,
		`passage_acs_ports{unit="gpu0",result="applied"} 1`,
		`passage_acs_port_drifted{unit="gpu0",port="` + port + `"} 1`,
		`passage_acs_port_drifted{unit="gpu0",port="` + m.Units[0].ACSChanges[0].Port + `"} 0`,
		`passage_function_info{unit="gpu3",bdf="0000:82:00.0",role="gpu",driver="vfio-pci",vendor="0x10de",device="0x3182"} 1`,
		`passage_manifest_generation 9`,
		`passage_manifest_signed 1`,
		`passage_manifest_timestamp_seconds 1.7734804135897932e+09`,
		`passage_stage_status{stage="vfio",status="failed"} 1`,
		`passage_stage_status{stage="vfio",status="ok"} 0`,
		`passage_stage_duration_seconds{stage="acs"} 0.012`,
		`passage_boot_duration_seconds 0.121`,
		`hostname="rack\"7\\n3\nx"`,
		"# TYPE passage_unit_status gauge\n",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("exposition lacks %s", want)
		}
	}
	if t2 := render(t, metrics.Source{Manifest: m}); strings.Contains(t2, "passage_acs_port_drifted") || !strings.Contains(t2, "passage_manifest_signed 0") {
		t.Error("without a live view: a drift metric, or signed not 0")
	}
	if err := metrics.Write(&bytes.Buffer{}, metrics.Source{}); err == nil {
		t.Error("no manifest, no error")
	}
}

// TestAlertRules runs the repository's rule tests: each alert fires on the node it is
// for and stays quiet on a healthy one.
func TestAlertRules(t *testing.T) {
	bin := promtool(t)
	if out, err := exec.Command(bin, "check", "rules", rulesFile).CombinedOutput(); err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
	if out, err := exec.Command(bin, "test", "rules", "../monitoring/passage.rules.test.yml").CombinedOutput(); err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
}

var sampleLine = regexp.MustCompile(`^([a-z_]+)(?:\{(.*)\})? (\S+)$`)

// TestAlertsOnExposition feeds what Write renders, not hand-written series, to the
// rules: the degraded node's exposition fires the unit and ATS alerts for exactly its
// units, the healthy node's fires nothing. The rules are the repository's, with the
// annotations left out (their text is the repository test's business).
func TestAlertsOnExposition(t *testing.T) {
	bin := promtool(t)
	dir := t.TempDir()
	raw, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var rules map[string]any
	if err := yaml.Unmarshal(raw, &rules); err != nil {
		t.Fatal(err)
	}
	alerts := map[string]bool{}
	for _, g := range rules["groups"].([]any) {
		for _, r := range g.(map[string]any)["rules"].([]any) {
			rm := r.(map[string]any)
			delete(rm, "annotations")
			alerts[rm["alert"].(string)] = true
		}
	}
	stripped, _ := yaml.Marshal(rules)
	os.WriteFile(filepath.Join(dir, "rules.yml"), stripped, 0o644)

	series := func(instance, text string) []map[string]string {
		var out []map[string]string
		for _, l := range strings.Split(text, "\n") {
			m := sampleLine.FindStringSubmatch(l)
			if m == nil || m[1] == "passage_manifest_info" { // info's hostname needs no test
				continue
			}
			labels := `instance="` + instance + `"`
			if m[2] != "" {
				labels += "," + m[2]
			}
			out = append(out, map[string]string{"series": m[1] + "{" + labels + "}", "values": m[3] + "x30"})
		}
		return out
	}
	m := degraded()
	exp := func(name string, labels ...map[string]string) map[string]any {
		var ea []map[string]any
		for _, l := range labels {
			ea = append(ea, map[string]any{"exp_labels": l})
		}
		if ea == nil {
			ea = []map[string]any{}
		}
		return map[string]any{"eval_time": "30m", "alertname": name, "exp_alerts": ea}
	}
	healthy := render(t, metrics.Source{Manifest: manifesttest.B300(1), Signed: true, LiveACS: live(manifesttest.B300(1), "none")})
	bad := render(t, metrics.Source{Manifest: m, Signed: true, LiveACS: live(m, m.Units[3].ACSChanges[1].Port)})
	var quiet, loud []map[string]any
	for a := range alerts {
		quiet = append(quiet, exp(a))
	}
	loud = append(loud,
		exp("PassageUnitDegraded", map[string]string{"severity": "warning", "instance": "bad", "unit": "gpu1", "status": "degraded"}),
		exp("PassageUnitFailed", map[string]string{"severity": "critical", "instance": "bad", "unit": "gpu2", "status": "failed"}),
		exp("PassageATSMissing", map[string]string{"severity": "warning", "instance": "bad", "unit": "gpu1"}),
		exp("PassageACSDrift", map[string]string{"severity": "critical", "instance": "bad", "unit": "gpu3", "port": m.Units[3].ACSChanges[1].Port}),
	)
	doc := map[string]any{
		"rule_files":          []string{"rules.yml"},
		"evaluation_interval": "1m",
		"tests": []map[string]any{
			{"interval": "1m", "input_series": series("ok", healthy), "alert_rule_test": quiet},
			{"interval": "1m", "input_series": series("bad", bad), "alert_rule_test": loud},
		},
	}
	b, _ := yaml.Marshal(doc)
	os.WriteFile(filepath.Join(dir, "test.yml"), b, 0o644)
	out, err := exec.Command(bin, "test", "rules", filepath.Join(dir, "test.yml")).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool test rules on the exposition: %v\n%s", err, out)
	}

	// Every passage_ series an alert reads is one Write renders.
	for _, name := range regexp.MustCompile(`passage_[a-z_]+`).FindAllString(string(raw), -1) {
		if !strings.Contains(bad, "\n"+name+"{") && !strings.Contains(bad, "\n"+name+" ") {
			t.Errorf("the rules read %s, which the exposition does not have", name)
		}
	}
}
