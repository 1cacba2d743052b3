package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
)

// lspciDump writes lspci -xxxx of the tree spec builds (the real lspci reading the
// synthetic sysfs) to a file.
func lspciDump(t *testing.T, spec pcitest.Spec) string {
	t.Helper()
	n := pcitest.New(t, spec)
	dump, err := exec.Command("lspci", "-D", "-xxxx", "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath()).Output()
	if err != nil {
		t.Fatalf("lspci (pciutils): %v", err)
	}
	file := filepath.Join(t.TempDir(), "dump.txt")
	if err := os.WriteFile(file, dump, 0o644); err != nil {
		t.Fatal(err)
	}
	return file
}

// TestPlanLspciDump: a dump carries no IOMMU groups. plan says so, as a fact about the
// input, and judges what a dump shows: on the reference node every unit is ready (no
// unit fails for an IOMMU the node may well have on); a port without ACS still fails its
// unit.
func TestPlanLspciDump(t *testing.T) {
	for _, c := range []struct {
		name   string
		spec   pcitest.Spec
		code   int
		failed string
	}{
		{"reference", pcitest.B300(), 0, ""},
		{"port-without-acs", b300With(func(s *pcitest.Spec) { s.Fn("gpu-dsp1").ACS = nil })(), 1, "gpu1"},
	} {
		file := lspciDump(t, c.spec)
		code, out, errs := runCmd(t, cmdPlan, "--lspci-dump", file)
		if code != c.code || strings.Contains(out+errs, "is the IOMMU on") ||
			!strings.Contains(out, "not judged: iommu groups: an lspci dump carries config space only, no IOMMU groups") {
			t.Errorf("%s: plan --lspci-dump: exit %d, want %d, saying groups are not judged and never asking for the IOMMU:\n%s\n%s", c.name, code, c.code, out, errs)
		}
		code, out, _ = runCmd(t, cmdPlan, "--lspci-dump", file, "--json")
		var doc struct {
			NotJudged []string `json:"not_judged"`
			Units     []struct {
				ID      string   `json:"id"`
				Status  string   `json:"status"`
				Reasons []string `json:"reasons"`
			} `json:"units"`
		}
		if err := json.Unmarshal([]byte(out), &doc); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if len(doc.NotJudged) != 1 || len(doc.Units) != 8 || code != c.code {
			t.Errorf("%s: exit %d, not_judged %q, %d units", c.name, code, doc.NotJudged, len(doc.Units))
		}
		for _, u := range doc.Units {
			want := "ready"
			if u.ID == c.failed {
				want = "failed"
			}
			if u.Status != want {
				t.Errorf("%s: %s %s %q, want %s", c.name, u.ID, u.Status, u.Reasons, want)
			}
		}
	}
}

// hostWithoutGPUs is the reference B300 node's host bus alone: its management NICs on
// their root ports, no GPU complex.
func hostWithoutGPUs() pcitest.Spec {
	s := pcitest.B300()
	s.Hosts = s.Hosts[:1]
	return s
}

// TestPlanProfileFindsNoUnits: the b300 profile on a host without GPUs says it found
// none of the units it is for and exits 1, in text and JSON, and apply does the same;
// it never reads as a node whose units all isolate.
func TestPlanProfileFindsNoUnits(t *testing.T) {
	root := pcitest.New(t, hostWithoutGPUs()).Root
	code, out, errs := runCmd(t, cmdPlan, "--root", root)
	if code != 1 || !strings.Contains(out, "no units: profile b300") || !strings.Contains(errs, "found none of the units it is for") ||
		strings.Contains(out, "isolate it") {
		t.Errorf("plan: exit %d, want 1 saying the profile found no unit:\n%s\n%s", code, out, errs)
	}
	code, out, _ = runCmd(t, cmdPlan, "--root", root, "--json")
	var doc struct {
		NoUnits string            `json:"no_units"`
		Units   []json.RawMessage `json:"units"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil || code != 1 || len(doc.Units) != 0 || !strings.Contains(doc.NoUnits, "profile b300") {
		t.Errorf("plan --json: exit %d, %v, no_units %q, %d units", code, err, doc.NoUnits, len(doc.Units))
	}
	code, out, _ = runCmd(t, cmdApply, "--root", root, "--dry-run")
	if code != 1 || !strings.Contains(out, "problem: profile b300") {
		t.Errorf("apply --dry-run: exit %d, want 1 naming the profile:\n%s", code, out)
	}
	// The node the profile is for exits 0.
	if code, _, errs := runCmd(t, cmdPlan, "--root", pcitest.New(t, pcitest.B300()).Root); code != 0 {
		t.Errorf("plan on the reference node: exit %d %s", code, errs)
	}
}
