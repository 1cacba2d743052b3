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
