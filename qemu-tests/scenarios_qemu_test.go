//go:build qemu

package qemutest

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
)

// testKey makes an ed25519 pair for one test; the private half goes into the image.
func testKey(t *testing.T) (priv string, v *manifest.PublicKeyVerifier) {
	t.Helper()
	priv, pub, err := manifest.GenerateKey(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	v, err = manifest.LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	return priv, v
}

// bootPassage boots the real image (passage boot as the uinit) and returns the run and
// the manifest, verified with the ed25519 key the image carried.
func bootPassage(t *testing.T, o Options) (*Run, *manifest.Manifest) {
	t.Helper()
	priv, v := testKey(t)
	o.Build = buildDir(t)
	o.Key = priv
	if o.WorkDir == "" {
		o.WorkDir = filepath.Join(t.TempDir(), "work")
	}
	// The ed25519 key signs: the TPM-key path is checked by its own test.
	o.Append = append([]string{"passage.tpm=off"}, o.Append...)
	run, err := Boot(context.Background(), o)
	if run != nil {
		// The suite's note wants boot-to-manifest per scenario.
		fmt.Printf("%s: topology %s: QEMU start to PASSAGE-DONE %v (wall %v); guest: uinit %.3f s, manifest %.3f s, handoff %.3f s\n",
			t.Name(), o.Topology.Name(), run.WallDone, run.Wall,
			run.Markers["uinit-start"], run.Markers["manifest-written"], run.Markers["handoff"])
		t.Logf("console: %s\n%s", run.Console, run.Timeline())
	}
	if err != nil {
		t.Fatal(err)
	}
	if run.Done == "" {
		t.Fatalf("no PASSAGE-DONE (console %s)", run.Console)
	}
	env, ok := run.Files["manifest.dsse.json"]
	if !ok {
		t.Fatalf("no manifest.dsse.json from the guest; files: %v", keys(run.Files))
	}
	ver, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatalf("manifest does not verify with the image's ed25519 key: %v", err)
	}
	return run, ver.Manifest
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func stage(m *manifest.Manifest, name string) *manifest.StageResult {
	for i := range m.Stages {
		if m.Stages[i].Name == name {
			return &m.Stages[i]
		}
	}
	return nil
}

func unitWith(m *manifest.Manifest, bdf string) *manifest.Unit {
	for i := range m.Units {
		for _, f := range m.Units[i].Functions {
			if f.BDF == bdf {
				return &m.Units[i]
			}
		}
	}
	return nil
}

var passthroughRoles = []string{"gpu", "gpu-nic", "gpu-nvme"}

// checkBound: every passthrough function of the unit is on vfio-pci in an IOMMU group.
func checkBound(t *testing.T, u *manifest.Unit) {
	t.Helper()
	n := 0
	for _, f := range u.Functions {
		if !slices.Contains(passthroughRoles, f.Role) {
			continue
		}
		n++
		if f.DriverAfter != "vfio-pci" || f.IOMMUGroup < 0 {
			t.Errorf("unit %s: %s (%s) driver %q group %d, want vfio-pci in a group", u.ID, f.BDF, f.Role, f.DriverAfter, f.IOMMUGroup)
		}
	}
	if n < 4 {
		t.Errorf("unit %s: %d passthrough functions, want GPU + 2 NIC PFs + NVMe", u.ID, n)
	}
}

// nicPorts are the "port above the NICs" of the default topology (README.md).
var nicPorts = map[string]string{"0000:05:00.0": "0000:06:00.0", "0000:0e:00.0": "0000:0f:00.0"}

func acsChange(m *manifest.Manifest, port string) *manifest.ACSChange {
	for _, u := range m.Units {
		for i := range u.ACSChanges {
			if u.ACSChanges[i].Port == port {
				return &u.ACSChanges[i]
			}
		}
	}
	return nil
}

// Scenario 1: a clean boot of the default topology.
func TestScenario1CleanBoot(t *testing.T) {
	run, m := bootPassage(t, Options{})
	if run.Done != "ok" {
		t.Errorf("PASSAGE-DONE %s, want ok", run.Done)
	}
	if len(m.Units) != 2 {
		t.Fatalf("%d units, want 2", len(m.Units))
	}
	for i := range m.Units {
		u := &m.Units[i]
		if u.Status != manifest.StatusReady {
			t.Errorf("unit %s: %s %v, want ready", u.ID, u.Status, u.Reasons)
		}
		checkBound(t, u)
	}
	for port, nic := range nicPorts {
		c := acsChange(m, port)
		if c == nil {
			t.Errorf("no ACS change for %s (port above %s)", port, nic)
			continue
		}
		if !strings.Contains(c.After, "DirectTrans+") || !strings.HasPrefix(c.Result, "applied") && c.Result != "unchanged" {
			t.Errorf("ACS %s: after %q result %q, want DirectTrans+ read back", port, c.After, c.Result)
		}
	}
	if s := stage(m, "network"); s == nil || s.Status != "ok" {
		t.Errorf("network stage %+v, want ok (DHCP lease from QEMU's user network)", s)
	}
	if m.KernelRelease == "" || !strings.Contains(m.KernelCmdline, "passage.profile=qemu") {
		t.Errorf("kernel %q cmdline %q", m.KernelRelease, m.KernelCmdline)
	}
}

// Scenario 2: two boots on the same disk and TPM state.
func TestScenario2Reprovisioning(t *testing.T) {
	dir := t.TempDir()
	disk := filepath.Join(dir, "disk.img")
	if err := NewDisk(disk, 64); err != nil {
		t.Fatal(err)
	}
	o := Options{
		Disk:     disk,
		TPMState: filepath.Join(dir, "tpm"),
		Append: []string{"passage.out=/dev/vda:/passage",
			"passage.host_modules=e1000e,virtio_pci,virtio_blk,crc32c_generic,ext4"},
	}
	o.WorkDir = filepath.Join(dir, "boot1")
	_, m1 := bootPassage(t, o)
	o.WorkDir = filepath.Join(dir, "boot2")
	run2, m2 := bootPassage(t, o)
	if m2.Generation <= m1.Generation {
		t.Errorf("generation %d then %d (%s), want an increase", m1.Generation, m2.Generation, m2.GenerationSource)
	}
	if m1.BootID == m2.BootID {
		t.Errorf("same boot id %s twice", m1.BootID)
	}
	layout := func(m *manifest.Manifest) string {
		var b strings.Builder
		for _, u := range m.Units {
			fmt.Fprintf(&b, "%s:", u.ID)
			for _, f := range u.Functions {
				fmt.Fprintf(&b, " %s=%s", f.BDF, f.Role)
			}
			b.WriteString("\n")
		}
		return b.String()
	}
	if l1, l2 := layout(m1), layout(m2); l1 != l2 {
		t.Errorf("unit layout changed:\n%s\nthen\n%s", l1, l2)
	}
	for i := range m2.Units {
		checkBound(t, &m2.Units[i])
	}
	if run2.Done == "failed" {
		t.Errorf("second boot PASSAGE-DONE failed")
	}
	// The disk keeps the latest manifest (read without mounting).
	onDisk, err := ReadDiskFile(disk, "/passage/manifest.dsse.json")
	if err != nil {
		t.Fatal(err)
	}
	if string(onDisk) != string(run2.Files["manifest.dsse.json"]) {
		t.Errorf("disk manifest (%d bytes) is not the second boot's (%d bytes)", len(onDisk), len(run2.Files["manifest.dsse.json"]))
	}
}

// Scenario 3: one NIC stand-in without ATS.
func TestScenario3ATSMissing(t *testing.T) {
	_, m := bootPassage(t, Options{Topology: Topology{ATSOff: true}})
	bad := unitWith(m, "0000:0f:00.1")
	if bad == nil {
		t.Fatal("no unit holds 0000:0f:00.1 (the ats=off PF)")
	}
	if bad.Status != manifest.StatusDegraded {
		t.Errorf("unit %s: %s %v, want degraded", bad.ID, bad.Status, bad.Reasons)
	}
	if c := acsChange(m, "0000:0e:00.0"); c != nil && strings.Contains(c.After, "DirectTrans+") {
		t.Errorf("DT set above the NIC without ATS: %+v", c)
	}
	for i := range m.Units {
		u := &m.Units[i]
		if u.ID != bad.ID && u.Status != manifest.StatusReady {
			t.Errorf("unit %s: %s %v, want ready", u.ID, u.Status, u.Reasons)
		}
	}
}

// Scenario 4: lockdown=integrity refuses config writes; vfio binding still works.
func TestScenario4Lockdown(t *testing.T) {
	_, m := bootPassage(t, Options{Append: []string{"lockdown=integrity"}})
	for i := range m.Units {
		u := &m.Units[i]
		if u.Status != manifest.StatusDegraded {
			t.Errorf("unit %s: %s, want degraded", u.ID, u.Status)
		}
		why := strings.Join(u.Reasons, "; ")
		if !strings.Contains(why, "pci=config_acs=") || !strings.Contains(why, "6.11") {
			t.Errorf("unit %s reasons %q: want the pci=config_acs= advice naming Linux 6.11", u.ID, why)
		}
		checkBound(t, u)
	}
	for port := range nicPorts {
		if c := acsChange(m, port); c == nil || !strings.HasPrefix(c.Result, "failed") {
			t.Errorf("ACS %s under lockdown: %+v, want a failed write", port, c)
		}
	}
}

// Scenario 5: a passthrough stand-in sharing an IOMMU group with a management NIC,
// and a passthrough device below a port without ACS.
func TestScenario5Isolation(t *testing.T) {
	_, m := bootPassage(t, Options{
		Topology: Topology{SharedGroup: true, NoACSPort: true},
		Append:   []string{"passage.host_modules=e1000e,e1000"},
	})
	refused := unitWith(m, "0000:14:01.0")
	if refused == nil {
		t.Fatal("no unit holds 0000:14:01.0 (the e1000 behind the pcie-pci-bridge)")
	}
	if refused.Status != manifest.StatusFailed {
		t.Errorf("unit %s: %s %v, want failed (refused)", refused.ID, refused.Status, refused.Reasons)
	}
	for _, f := range refused.Functions {
		if f.DriverAfter == "vfio-pci" || f.DriverAfter != f.DriverBefore {
			t.Errorf("refused unit %s: %s driver %q -> %q, want untouched", refused.ID, f.BDF, f.DriverBefore, f.DriverAfter)
		}
	}
	var vfioChanges []string
	if s := stage(m, "vfio"); s != nil {
		vfioChanges = s.Changes
	}
	for _, c := range vfioChanges {
		if strings.Contains(c, "0000:14:02.0") {
			t.Errorf("vfio stage touched the management NIC: %s", c)
		}
	}
	// The NVMe below the xio3130-downstream port: the audit names the port or device.
	all := fmt.Sprint(m.Units, m.Stages)
	if !strings.Contains(all, "0000:0c:02.0") {
		t.Errorf("nothing in the manifest flags 0000:0c:02.0 (no ACS above unit 1's NVMe 0000:15:00.0)")
	}
	// The other unit is unaffected.
	if u := unitWith(m, "0000:09:00.0"); u == nil || u.Status != manifest.StatusReady {
		t.Errorf("unit with GPU 0000:09:00.0: %+v, want ready", u)
	}
}
