package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/pciids/hwdbtest"
	"github.com/passage-boot/passage/vfiobind"
)

// namesFixture is a database in pci.ids format holding today's names of the B300's
// NIC; Debian 12's database predates it.
const namesFixture = "# fixture\n15b3  Mellanox Technologies\n\t1021  MT2910 Family [ConnectX-7]\n\t1023  CX8 Family [ConnectX-8]\n"

// The commands below read pci.ids alone (--hwdb none), so that only the fixture names;
// TestHwdbInCommands adds a hwdb.
func TestNamesInCommands(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	ids := filepath.Join(t.TempDir(), "pci.ids")
	os.WriteFile(ids, []byte(namesFixture), 0o644)
	nic := n.Addr("nic7.0").String()

	rc, out, errs := inspect("--root", n.Root, "--json", "--pci-ids", ids, "--hwdb", "none")
	if rc != 0 {
		t.Fatalf("rc %d %s", rc, errs)
	}
	named := 0
	for _, d := range decodeJSON(t, out).Devices {
		switch {
		case d.BDF == nic:
			if d.VendorName != "Mellanox Technologies" || d.DeviceName != "CX8 Family [ConnectX-8]" {
				t.Errorf("%s: vendor_name %q device_name %q", d.BDF, d.VendorName, d.DeviceName)
			}
			named++
		case d.Vendor != "0x15b3" && (d.VendorName != "" || d.DeviceName != ""):
			t.Errorf("%s (%s): named %q %q by a database that does not know its vendor", d.BDF, d.Vendor, d.VendorName, d.DeviceName)
		}
	}
	if named != 1 {
		t.Errorf("%s not in inspect --json", nic)
	}

	rc, out, _ = inspect("--root", n.Root, "--pci-ids", ids, "--hwdb", "none")
	if rc != 0 || !strings.Contains(out, nic+"  [0200]: Mellanox Technologies CX8 Family [ConnectX-8] [15b3:1023] (sub 15b3:0023)") ||
		!strings.Contains(out, "[10de:3182]") {
		t.Errorf("inspect tree rc %d without the NIC's name or the GPU's IDs:\n%.2000s", rc, out)
	}

	var pout, perr bytes.Buffer
	if rc := cmdPlan([]string{"--root", n.Root, "--pci-ids", ids, "--hwdb", "none"}, &pout, &perr); rc != 0 {
		t.Fatalf("plan rc %d %s", rc, perr.String())
	}
	if !strings.Contains(pout.String(), "Mellanox Technologies CX8 Family [ConnectX-8] [15b3:1023]") {
		t.Errorf("plan's function table names nothing:\n%.1500s", pout.String())
	}

	pout.Reset()
	if rc := cmdPlan([]string{"--root", n.Root, "--pci-ids", ids, "--hwdb", "none", "--json"}, &pout, &perr); rc != 0 {
		t.Fatalf("plan --json rc %d %s", rc, perr.String())
	}
	var plan struct {
		Functions []struct {
			Addr       string `json:"addr"`
			VendorName string `json:"vendor_name"`
			DeviceName string `json:"device_name"`
		} `json:"functions"`
	}
	if err := json.Unmarshal(pout.Bytes(), &plan); err != nil {
		t.Fatal(err)
	}
	for _, f := range plan.Functions {
		if f.Addr == nic && (f.VendorName != "Mellanox Technologies" || f.DeviceName != "CX8 Family [ConnectX-8]") {
			t.Errorf("plan --json %s: %q %q", f.Addr, f.VendorName, f.DeviceName)
		}
	}

	// apply names what it binds.
	k := simulatedKernel(t, n.Root)
	env := applyEnv{sysfs: func(string) vfiobind.Sysfs { return k }, modules: func(string, string) vfiobind.ModuleLoader { return k }}
	var aout, aerr bytes.Buffer
	if rc := runApply([]string{"--root", n.Root, "--pci-ids", ids, "--hwdb", "none", "--erase", "off"}, &aout, &aerr, env); rc != 0 {
		t.Fatalf("apply rc %d %s", rc, aerr.String())
	}
	if want := "  vfio gpu7: " + nic + " group "; !strings.Contains(aout.String(), want) ||
		!strings.Contains(aout.String(), "-> vfio-pci (Mellanox Technologies CX8 Family [ConnectX-8] [15b3:1023])") {
		t.Errorf("apply's vfio lines without the NIC's name:\n%s", aout.String())
	}

	// A database given explicitly must be there and be one.
	bad := filepath.Join(t.TempDir(), "bad.ids")
	os.WriteFile(bad, []byte("15b3\n"), 0o644)
	for _, f := range []string{bad, filepath.Join(t.TempDir(), "none")} {
		rc, out, errs := inspect("--root", n.Root, "--pci-ids", f)
		if rc != 2 || out != "" || strings.Count(errs, "\n") != 1 || !strings.Contains(errs, f) {
			t.Errorf("--pci-ids %s: rc %d stdout %d bytes stderr %q", f, rc, len(out), errs)
		}
	}
}

// TestHwdbInCommands: --hwdb FILE names what the pci.ids does not, and only that, as
// lspci asks udev's hwdb after pci.ids; a hwdb given explicitly must be there and be one.
func TestHwdbInCommands(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	ids := filepath.Join(t.TempDir(), "pci.ids")
	os.WriteFile(ids, []byte(namesFixture), 0o644)
	_, hwdb := hwdbtest.Build(t, map[string]string{"etc/udev/hwdb.d/20-test.hwdb": "" +
		"pci:v000010DE*\n ID_VENDOR_FROM_DATABASE=NVIDIA from hwdb\n\n" +
		"pci:v000010DEd00003182*\n ID_MODEL_FROM_DATABASE=B300 from hwdb\n\n" +
		"pci:v000015B3d00001023*\n ID_MODEL_FROM_DATABASE=not asked: pci.ids names it\n"})
	gpu, nic := n.Addr("gpu7").String(), n.Addr("nic7.0").String()
	rc, out, errs := inspect("--root", n.Root, "--json", "--pci-ids", ids, "--hwdb", hwdb)
	if rc != 0 {
		t.Fatalf("rc %d %s", rc, errs)
	}
	seen := 0
	for _, d := range decodeJSON(t, out).Devices {
		switch d.BDF {
		case gpu:
			if d.VendorName != "NVIDIA from hwdb" || d.DeviceName != "B300 from hwdb" {
				t.Errorf("%s: %q %q, want hwdb's names", d.BDF, d.VendorName, d.DeviceName)
			}
			seen++
		case nic:
			if d.VendorName != "Mellanox Technologies" || d.DeviceName != "CX8 Family [ConnectX-8]" {
				t.Errorf("%s: %q %q, want pci.ids' names", d.BDF, d.VendorName, d.DeviceName)
			}
			seen++
		}
	}
	if seen != 2 {
		t.Errorf("%s or %s not in inspect --json", gpu, nic)
	}
	var pout, perr bytes.Buffer
	if rc := cmdPlan([]string{"--root", n.Root, "--pci-ids", ids, "--hwdb", hwdb}, &pout, &perr); rc != 0 ||
		!strings.Contains(pout.String(), "NVIDIA from hwdb B300 from hwdb [10de:3182]") {
		t.Errorf("plan --hwdb rc %d without hwdb's GPU name:\n%.1500s", rc, pout.String())
	}
	bad := filepath.Join(t.TempDir(), "hwdb.bin")
	os.WriteFile(bad, []byte("not a hwdb"), 0o644)
	for _, f := range []string{bad, filepath.Join(t.TempDir(), "none")} {
		rc, out, errs := inspect("--root", n.Root, "--pci-ids", ids, "--hwdb", f)
		if rc != 2 || out != "" || strings.Count(errs, "\n") != 1 || !strings.Contains(errs, f) {
			t.Errorf("--hwdb %s: rc %d stdout %d bytes stderr %q", f, rc, len(out), errs)
		}
	}
}
