package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/pciids"
)

func inspect(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	rc := cmdInspect(args, &out, &errb)
	return rc, out.String(), errb.String()
}

// jsonDoc mirrors the documented --json shape, so a renamed key fails here.
type jsonDoc struct {
	Devices []struct {
		BDF             string  `json:"bdf"`
		Vendor          string  `json:"vendor"`
		Device          string  `json:"device"`
		SubsystemVendor string  `json:"subsystem_vendor"`
		SubsystemDevice string  `json:"subsystem_device"`
		Class           string  `json:"class"`
		Parent          *string `json:"parent"`
		NUMANode        *int    `json:"numa_node"`
		IOMMUGroup      *int    `json:"iommu_group"`
		Driver          *string `json:"driver"`
		Link            *struct {
			Speed    string `json:"speed"`
			Width    int    `json:"width"`
			MaxSpeed string `json:"max_speed"`
			MaxWidth int    `json:"max_width"`
		} `json:"link"`
		ACS *struct {
			Cap      string `json:"cap"`
			Ctl      string `json:"ctl"`
			CapFlags string `json:"cap_flags"`
			CtlFlags string `json:"ctl_flags"`
		} `json:"acs"`
		ATS struct {
			Present bool `json:"present"`
			Enabled bool `json:"enabled"`
		} `json:"ats"`
		Problems   []string `json:"problems"`
		VendorName string   `json:"vendor_name"`
		DeviceName string   `json:"device_name"`
		Role       string   `json:"role"`
		Unit       *string  `json:"unit"`
	} `json:"devices"`
	Units []struct {
		ID         string   `json:"id"`
		GPU        string   `json:"gpu"`
		NICs       []string `json:"nics"`
		DataDirect []string `json:"data_direct"`
		NVMe       []string `json:"nvme"`
		NUMANode   int      `json:"numa_node"`
		Status     string   `json:"status"`
		Reasons    []string `json:"reasons"`
		Bridges    []string `json:"bridges"`
	} `json:"units"`
	Problems []string `json:"problems"`
}

func decodeJSON(t *testing.T, s string) jsonDoc {
	t.Helper()
	var doc jsonDoc
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("%v in %.300s", err, s)
	}
	return doc
}

func TestInspectJSON(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	rc, out, errs := inspect("--root", n.Root, "--json")
	if rc != 0 || errs != "" {
		t.Fatalf("rc %d stderr %q", rc, errs)
	}
	doc := decodeJSON(t, out)
	if len(doc.Devices) != 134 {
		t.Fatalf("%d devices", len(doc.Devices))
	}
	byBDF := map[string]int{}
	for i, d := range doc.Devices {
		byBDF[d.BDF] = i
	}
	gpu := doc.Devices[byBDF["0000:f2:00.0"]]
	if gpu.Vendor != "0x10de" || gpu.Device != "0x3182" || gpu.SubsystemVendor != "0x10de" || gpu.Class != "0x030200" ||
		gpu.Parent == nil || *gpu.Parent != "0000:f1:00.0" || gpu.NUMANode == nil || *gpu.NUMANode != 1 ||
		gpu.IOMMUGroup == nil || gpu.Driver == nil || *gpu.Driver != "nvidia" || gpu.ACS != nil || gpu.ATS.Present ||
		gpu.Link == nil || gpu.Link.Speed != "64GT/s" || gpu.Link.Width != 16 || gpu.Link.MaxSpeed != "64GT/s" {
		t.Errorf("gpu7 %+v", gpu)
	}
	dsp := doc.Devices[byBDF[n.Addr("cx-dsp-nic7").String()]]
	if dsp.ACS == nil || dsp.ACS.Cap != "0x005f" || dsp.ACS.Ctl != "0x001d" || dsp.ACS.CtlFlags != "SV RR CR UF" {
		t.Errorf("cx-dsp-nic7 ACS %+v", dsp.ACS)
	}
	nic := doc.Devices[byBDF[n.Addr("nic7.1").String()]]
	if !nic.ATS.Present || nic.ATS.Enabled {
		t.Errorf("nic7.1 ATS %+v", nic.ATS)
	}
	rp := doc.Devices[byBDF["0000:ea:02.0"]]
	if rp.Parent != nil || rp.Problems == nil || len(rp.Problems) != 0 {
		t.Errorf("root port parent %v problems %v", rp.Parent, rp.Problems)
	}

	// Roles and units from the b300 profile.
	if gpu.Role != "gpu" || gpu.Unit == nil || *gpu.Unit != "gpu7" {
		t.Errorf("gpu7 role %q unit %v", gpu.Role, gpu.Unit)
	}
	if nic.Role != "gpu-nic" || nic.Unit == nil || *nic.Unit != "gpu7" {
		t.Errorf("nic7.1 role %q unit %v", nic.Role, nic.Unit)
	}
	mgmt := doc.Devices[byBDF[n.Addr("mgmt0").String()]]
	if mgmt.Role != "mgmt-nic" || mgmt.Unit != nil {
		t.Errorf("mgmt0 role %q unit %v", mgmt.Role, mgmt.Unit)
	}
	if len(doc.Units) != 8 {
		t.Fatalf("%d units", len(doc.Units))
	}
	u7 := doc.Units[7]
	if u7.ID != "gpu7" || u7.GPU != "0000:f2:00.0" || len(u7.NICs) != 2 || len(u7.NVMe) != 1 || u7.NUMANode != 1 || u7.Status != "ready" {
		t.Errorf("unit 7 %+v", u7)
	}
}

func TestInspectTree(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	rc, out, _ := inspect("--root", n.Root)
	if rc != 0 {
		t.Fatalf("rc %d", rc)
	}
	// Names are the system database's (pciids' test holds them against lspci's).
	db, err := pciids.Open(pciids.DefaultPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"-[0000:ea]-\n \\-0000:ea:02.0-[eb-f4]  [0604]: " + db.Label(0x8086, 0x352a) + "  Root Port  LnkSta 32GT/s x16  ACSCtl SV RR CR UF (cap SV RR CR UF)",
		`\-0000:f2:00.0  [0302]: ` + db.Label(0x10de, 0x3182) + ` (sub 10de:2101)  Endpoint  LnkSta 64GT/s x16  ATS none  numa 1`,
		`+-0000:ef:00.0  [0200]: ` + db.Label(0x15b3, 0x1023) + ` (sub 15b3:0023)  Endpoint  LnkSta 64GT/s x16  ATS Enable-  numa 1`,
		"ACSCtl SV RR CR UF (cap SV TB RR CR UF DT)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("tree lacks %q", want)
		}
	}
	if got := strings.Count(out, "\n"); got != 134+10 {
		t.Errorf("%d lines, want 134 functions + 10 root buses", got)
	}
}

func TestInspectProblemsShown(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	cfg := filepath.Join(n.Root, "sys/bus/pci/devices", n.Addr("gpu0").String(), "config")
	b, _ := os.ReadFile(cfg)
	if err := os.WriteFile(cfg, b[:64], 0o644); err != nil {
		t.Fatal(err)
	}
	rc, out, _ := inspect("--root", n.Root)
	if rc != 1 || !strings.Contains(out, "! config space truncated to 64 bytes (not root?)") {
		t.Errorf("rc %d, problem not shown", rc)
	}
	_, out, _ = inspect("--root", n.Root, "--json")
	if !strings.Contains(out, `"config space truncated to 64 bytes (not root?)"`) {
		t.Error("problem not in the JSON")
	}
}

func TestSnapshotCommandRoundTrip(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	file := filepath.Join(t.TempDir(), "node.tar.gz")
	var out, errb bytes.Buffer
	if rc := cmdSnapshot([]string{"-o", file, "--root", n.Root}, &out, &errb); rc != 0 {
		t.Fatalf("rc %d: %s", rc, errb.String())
	}
	if !strings.Contains(out.String(), "134 functions, 0 problems") {
		t.Errorf("summary %q", out.String())
	}
	_, live, _ := inspect("--root", n.Root, "--json")
	rc, snap, errs := inspect("--snapshot", file, "--json")
	if rc != 0 || snap != live {
		t.Errorf("rc %d %s; snapshot JSON equal to live: %v", rc, errs, snap == live)
	}
}

func TestInspectLspciDump(t *testing.T) {
	file := lspciDump(t, pcitest.B300())
	rc, out, _ := inspect("--lspci-dump", file, "--json")
	doc := decodeJSON(t, out)
	if rc != 0 || len(doc.Devices) != 134 {
		t.Fatalf("rc %d, %d devices", rc, len(doc.Devices))
	}
	for _, d := range doc.Devices {
		if d.BDF == "0000:f2:00.0" && (d.Parent == nil || *d.Parent != "0000:f1:00.0" || d.NUMANode != nil || d.Driver != nil) {
			t.Errorf("gpu7 from the dump: parent %v numa %v driver %v", d.Parent, d.NUMANode, d.Driver)
		}
	}
}

func TestInspectBadInput(t *testing.T) {
	dir := t.TempDir()
	junk := filepath.Join(dir, "junk.tar.gz")
	os.WriteFile(junk, []byte("not a tarball"), 0o644)
	for _, args := range [][]string{
		{"--root", filepath.Join(dir, "none")},
		{"--snapshot", junk},
		{"--snapshot", filepath.Join(dir, "none.tar.gz")},
		{"--lspci-dump", filepath.Join(dir, "none.txt")},
		{"--root", dir, "--snapshot", junk},
		{"extra"},
		{"--bogus"},
	} {
		rc, out, errs := inspect(args...)
		if rc != 2 || out != "" {
			t.Errorf("%v: rc %d stdout %q", args, rc, out)
		}
		if args[0] != "--bogus" && (strings.Count(errs, "\n") != 1 || !strings.HasPrefix(errs, "passage inspect: ")) {
			t.Errorf("%v: stderr %q, want one line", args, errs)
		}
	}
	var out, errb bytes.Buffer
	if rc := cmdSnapshot(nil, &out, &errb); rc != 2 || !strings.Contains(errb.String(), "-o FILE is required") {
		t.Errorf("snapshot without -o: rc %d %q", rc, errb.String())
	}
	if rc := cmdSnapshot([]string{"-o", filepath.Join(dir, "x.tar.gz"), "--root", filepath.Join(dir, "none")}, &out, &errb); rc != 2 {
		t.Errorf("snapshot of a missing root: rc %d", rc)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("failed snapshot left files: %v", ents)
	}
}
