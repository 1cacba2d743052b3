//go:build qemu

package qemutest

import (
	"encoding/json"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pciids"
	"github.com/passage-boot/passage/topology"
)

// checkFleet checks what a fleet's monitoring gets from a boot: the textfile the boot
// left beside the manifest (promtool accepts it; it says what the manifest says), and
// the names the image's pci.ids subset gives in the guest (inspect --json, run by the
// preflight uinit): those of the devices the profiles know, as the build machine's
// database has them, and none for the others.
func checkFleet(t *testing.T, run *Run, m *manifest.Manifest) {
	t.Helper()
	prom := run.Files["passage.prom"]
	if len(prom) == 0 {
		t.Fatal("no passage.prom beside the manifest")
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (image/deps.sh installs prometheus): %v", err)
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(string(prom))
	if out, err := cmd.CombinedOutput(); err != nil || len(strings.TrimSpace(string(out))) != 0 {
		t.Errorf("promtool check metrics on the guest's passage.prom: %v %s", err, out)
	}
	for _, u := range m.Units {
		want := `passage_unit_status{unit="` + u.ID + `",status="` + u.Status + `"} 1`
		if !strings.Contains(string(prom), want+"\n") {
			t.Errorf("passage.prom lacks %s", want)
		}
		missing := 0
		for _, f := range u.ATSFindings {
			if f.Severity == "warning" {
				missing++
			}
		}
		if want := `passage_unit_ats_missing_functions{unit="` + u.ID + `"} ` + strconv.Itoa(missing); !strings.Contains(string(prom), want+"\n") {
			t.Errorf("passage.prom lacks %s", want)
		}
	}
	if want := "passage_manifest_generation " + strconv.FormatUint(m.Generation, 10) + "\n"; !strings.Contains(string(prom), want) {
		t.Errorf("passage.prom lacks %s", want)
	}

	full, err := pciids.Open(pciids.DefaultPath)
	if err != nil {
		t.Fatal(err)
	}
	var profiles []*topology.Profile
	for _, n := range topology.Builtins() {
		p, err := topology.Builtin(n)
		if err != nil {
			t.Fatal(err)
		}
		profiles = append(profiles, p)
	}
	want := pciids.ProfileWants(profiles)
	var doc struct {
		Devices []struct {
			BDF        string `json:"bdf"`
			Vendor     string `json:"vendor"`
			Device     string `json:"device"`
			VendorName string `json:"vendor_name"`
			DeviceName string `json:"device_name"`
		} `json:"devices"`
	}
	if err := json.Unmarshal(run.Files["preflight-inspect.json"], &doc); err != nil {
		t.Fatalf("preflight-inspect.json: %v (exit: %s)", err, run.Files["preflight-inspect.exit"])
	}
	named := 0
	for _, d := range doc.Devices {
		v, _ := strconv.ParseUint(strings.TrimPrefix(d.Vendor, "0x"), 16, 16)
		dev, _ := strconv.ParseUint(strings.TrimPrefix(d.Device, "0x"), 16, 16)
		vn, dn := full.Names(uint16(v), uint16(dev))
		w := want[uint16(v)]
		switch {
		case w == nil:
			vn, dn = "", ""
		case !w.AllDevices && !w.Devices[uint16(dev)]:
			dn = ""
		}
		if d.VendorName != vn || d.DeviceName != dn {
			t.Errorf("guest %s (%s:%s): named %q %q, want %q %q", d.BDF, d.Vendor, d.Device, d.VendorName, d.DeviceName, vn, dn)
		}
		if dn != "" {
			named++
		}
	}
	if named == 0 || len(doc.Devices) == 0 {
		t.Errorf("%d of the guest's %d functions named", named, len(doc.Devices))
	}
}
