package main

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

func runCmd(t *testing.T, f func([]string, io.Writer, io.Writer) int, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := f(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestPlanAndRenderCLI(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())

	code, out, errs := runCmd(t, cmdPlan, "--root", n.Root, "--profile", "b300", "--unit", "0,1")
	if code != 0 {
		t.Fatalf("plan: %d %s", code, errs)
	}
	for _, want := range []string{"gpu-nic", "mgmt-nic", "nvswitch-mgmt", "1x111x1@" + n.Addr("cx-dsp-nic0").String(), "guest matrix (units gpu0,gpu1"} {
		if !strings.Contains(out, want) {
			t.Errorf("plan output lacks %q", want)
		}
	}

	code, out, errs = runCmd(t, cmdPlan, "--root", n.Root, "--json", "--numa")
	if code != 0 {
		t.Fatalf("plan --json: %d %s", code, errs)
	}
	var doc struct {
		Units []struct {
			ID     string   `json:"id"`
			NICs   []string `json:"nics"`
			Status string   `json:"status"`
		} `json:"units"`
		GuestMatrix struct {
			Names []string   `json:"names"`
			Cells [][]string `json:"cells"`
		} `json:"guest_matrix"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Units) != 8 || len(doc.Units[7].NICs) != 2 || doc.Units[7].Status != "ready" {
		t.Errorf("units %+v", doc.Units)
	}
	// GPU0 row: NV18 to GPUs, PIX to its NICs (NIC0, NIC1), NODE to unit 1's, SYS to unit 4's.
	row := doc.GuestMatrix.Cells[0]
	if row[1] != "NV18" || row[8] != "PIX" || row[9] != "PIX" || row[10] != "NODE" || row[16] != "SYS" {
		t.Errorf("guest GPU0 row %v", row)
	}

	code, out, errs = runCmd(t, cmdRender, "--root", n.Root, "--format", "qemu", "--unit", "7")
	if code != 0 || !strings.Contains(out, "vfio-pci,host="+n.Addr("gpu7").String()) || strings.Contains(out, n.Addr("gpu6").String()) {
		t.Errorf("render qemu: %d %s\n%s", code, errs, out)
	}
	code, out, _ = runCmd(t, cmdRender, "--root", n.Root, "--format", "libvirt")
	if code != 0 || xml.Unmarshal([]byte(out), new(struct{})) != nil || strings.Count(out, "<hostdev ") != 32 {
		t.Errorf("render libvirt: %d\n%s", code, out)
	}
	code, out, _ = runCmd(t, cmdRender, "--root", n.Root, "--format", "nccl-xml")
	if code != 0 || !strings.Contains(out, `link_speed="64.0 GT/s PCIe"`) {
		t.Errorf("render nccl-xml: %d\n%s", code, out)
	}

	// Bad input: exit 2 with a one-line error (a --unit that is no unit name is a bad flag
	// value, TestPlanUnitFlag).
	for _, args := range [][]string{
		{"--root", n.Root, "--unit", "12"},
		{"--root", n.Root, "--profile", "nosuch"},
		{"--root", n.Root, "--lspci-dump", "x"},
		{"--root", filepath.Join(n.Root, "missing")},
	} {
		code, _, errs := runCmd(t, cmdPlan, args...)
		if code != 2 || strings.Count(strings.TrimSpace(errs), "\n") != 0 || errs == "" {
			t.Errorf("plan %v: exit %d, stderr %q", args, code, errs)
		}
	}
	if code, _, _ := runCmd(t, cmdRender, "--root", n.Root, "--format", "svg"); code != 2 {
		t.Errorf("render --format svg: exit %d", code)
	}
}

func TestPlanSnapshotAndProfileFile(t *testing.T) {
	n := pcitest.New(t, pcitest.B200())
	dir := t.TempDir()
	snap := filepath.Join(dir, "node.tar.gz")
	f, err := os.Create(snap)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pci.WriteSnapshot(f, n.Root); err != nil {
		t.Fatal(err)
	}
	f.Close()
	// An operator's profile: the B200 rules with every function required to be known,
	// written as JSON.
	prof := filepath.Join(dir, "b200-strict.json")
	js := `{"name": "b200-strict", "unlabeled_is_error": true, "nvlinks": 18, "rules": [
	  {"name": "gpu", "role": "gpu", "match": {"vendor": "10de", "device": "2901"}},
	  {"name": "nic", "role": "gpu-nic", "match": {"vendor": "15b3", "below": [{"vendor": "1000", "device": "c030"}]}},
	  {"name": "nvme", "role": "gpu-nvme", "match": {"class": "010802"}},
	  {"name": "mgmt", "role": "mgmt-nic", "match": {"vendor": "14e4"}},
	  {"name": "bridges", "role": "switch-port", "match": {"bridge": true}}
	]}`
	if err := os.WriteFile(prof, []byte(js), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, errs := runCmd(t, cmdPlan, "--snapshot", snap, "--profile", prof)
	// The Broadcom switch management endpoints match no rule: the strict profile fails.
	if code != 1 || !strings.Contains(errs, "no rule of profile b200-strict matches 1000:00b2") {
		t.Errorf("strict profile: exit %d %q", code, errs)
	}
	if !strings.Contains(out, "unlabeled") {
		t.Errorf("plan not printed with the unlabeled functions")
	}
	code, out, errs = runCmd(t, cmdPlan, "--snapshot", snap, "--profile", "b200")
	if code != 0 || !strings.Contains(out, "GPU0\t X \tNV18") {
		t.Errorf("b200 from snapshot: %d %s\n%s", code, errs, out)
	}
}
