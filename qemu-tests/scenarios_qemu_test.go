//go:build qemu

package qemutest

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/stages"
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
// the manifest, verified with the ed25519 key the image carried. The TPM is there
// (passage.tpm=auto): the envelope carries the TPM key's signature too.
func bootPassage(t *testing.T, o Options) (*Run, *manifest.Manifest) {
	t.Helper()
	priv, v := testKey(t)
	if o.Build == "" {
		o.Build = buildDir(t)
	}
	o.Key = priv
	if o.WorkDir == "" {
		o.WorkDir = filepath.Join(t.TempDir(), "work")
	}
	if o.Name == "" {
		o.Name = t.Name()
	}
	if o.Timeout == 0 {
		// Another engineer's QEMU may share the two cores: generous, still bounded.
		o.Timeout = 4 * time.Minute
	}
	run, err := Boot(context.Background(), o)
	if run != nil {
		t.Logf("console: %s\n%s", run.Console, run.Timeline())
		t.Logf("%s", run.TimingLine(o.Name))
	}
	if err != nil {
		if run != nil {
			t.Fatalf("%v; the console's end:\n%s", err, consoleTail(run.Console, 80))
		}
		t.Fatal(err)
	}
	if run.Done == "" {
		t.Fatalf("no PASSAGE-DONE (console %s); its end:\n%s", run.Console, consoleTail(run.Console, 60))
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

// readback is the guest's fresh scan after its stages (stages/boot.Readback).
type readback struct {
	Functions []struct {
		BDF        string `json:"bdf"`
		IDs        string `json:"ids"`
		Driver     string `json:"driver"`
		IOMMUGroup int    `json:"iommu_group"`
		VFIODev    string `json:"vfio_dev"`
		ACSCtl     string `json:"acs_ctl"`
	} `json:"functions"`
	Leases []string `json:"leases"`
}

func readbackOf(t *testing.T, run *Run) *readback {
	t.Helper()
	var rb readback
	if err := json.Unmarshal(run.Files["readback.json"], &rb); err != nil {
		t.Fatalf("readback.json from the guest: %v", err)
	}
	if len(rb.Functions) == 0 {
		t.Fatal("readback.json lists no function")
	}
	return &rb
}

func (rb *readback) acsCtl(t *testing.T, bdf string) uint16 {
	t.Helper()
	for _, f := range rb.Functions {
		if f.BDF == bdf {
			v, err := strconv.ParseUint(strings.TrimPrefix(f.ACSCtl, "0x"), 16, 16)
			if err != nil {
				t.Fatalf("readback %s: ACSCtl %q: %v", bdf, f.ACSCtl, err)
			}
			return uint16(v)
		}
	}
	t.Fatalf("readback has no %s", bdf)
	return 0
}

// consoleTail is the end of a console log without the base64 of file blocks: the
// temp dir holding it is gone once the test ends.
func consoleTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	var keep []string
	for _, l := range strings.Split(string(b), "\n") {
		if t := strings.TrimSpace(l); len(t) == 76 && !strings.ContainsAny(t, " :") {
			continue
		}
		keep = append(keep, l)
	}
	if len(keep) > n {
		keep = keep[len(keep)-n:]
	}
	return strings.Join(keep, "\n")
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

// logStages reads every stage's result from log.jsonl, in the order they ran: the record
// of the stages that come after the manifest (network, publish).
func logStages(t *testing.T, run *Run) []stages.ResultRecord {
	t.Helper()
	out, err := stages.ReadStages(bytes.NewReader(run.Files["log.jsonl"]))
	if err != nil {
		t.Fatalf("log.jsonl: %v", err)
	}
	if len(out) == 0 {
		t.Fatalf("log.jsonl from the guest has no stage line; files: %v", keys(run.Files))
	}
	return out
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

// mgmtNIC is the e1000e management NIC of every topology (README.md).
const mgmtNIC = "0000:01:00.0"

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

// ACS Control bits (pci_regs.h PCI_ACS_*): the kernel's isolation default and DT.
const (
	acsIsolation = 0x001d // SV RR CR UF
	acsDT        = 0x0040
)

// Scenario 1: a clean boot of the default topology, signed by the TPM and the key file,
// measured into PCR 13.
func TestScenario1CleanBoot(t *testing.T) {
	// On the default kernel and on 6.1, which the fleet still runs.
	for _, k := range []string{"6.12", "6.1"} {
		t.Run(k, func(t *testing.T) {
			run, m := bootPassage(t, Options{Build: kernelBuild(t, k), KeepTPM: true, Append: []string{"passage.tpm=on"}})
			if run.Done != "ok" {
				t.Errorf("PASSAGE-DONE %s, want ok", run.Done)
			}
			if len(m.Units) != 2 {
				t.Fatalf("%d units, want 2", len(m.Units))
			}
			checkImageBuild(t, m)
			rb := readbackOf(t, run)
			vfioDev := map[string]string{}
			drivers := map[string]string{}
			for _, f := range rb.Functions {
				vfioDev[f.BDF], drivers[f.BDF] = f.VFIODev, f.Driver
			}
			for i := range m.Units {
				u := &m.Units[i]
				if u.Status != manifest.StatusReady {
					t.Errorf("unit %s: %s %v, want ready", u.ID, u.Status, u.Reasons)
				}
				checkBound(t, u)
				// The guest's own sysfs, read after the stages: vfio-pci and the group's node.
				for _, f := range u.Functions {
					want := fmt.Sprintf("/dev/vfio/%d", f.IOMMUGroup)
					if drivers[f.BDF] != "vfio-pci" || vfioDev[f.BDF] != want {
						t.Errorf("%s: guest reads driver %q, %q; want vfio-pci and %s", f.BDF, drivers[f.BDF], vfioDev[f.BDF], want)
					}
				}
				if u.ACSChanges == nil || len(u.ATSFindings) != 2 {
					t.Errorf("unit %s: ACS changes %v, ATS findings %v", u.ID, u.ACSChanges, u.ATSFindings)
				}
			}
			for port, nic := range nicPorts {
				c := acsChange(m, port)
				if c == nil {
					t.Errorf("no ACS change for %s (port above %s)", port, nic)
					continue
				}
				if !strings.Contains(c.After, "DirectTrans+") || c.Result != "applied" {
					t.Errorf("ACS %s: after %q result %q, want DirectTrans+ applied and read back", port, c.After, c.Result)
				}
				// An independent read of the port's config space in the guest, after binding.
				if ctl := rb.acsCtl(t, port); ctl != acsIsolation|acsDT {
					t.Errorf("guest reads ACSCtl %#04x on %s, want %#04x (SV RR CR UF DT)", ctl, port, acsIsolation|acsDT)
				}
			}
			// Every other port on the units' paths keeps isolation and has no DT.
			for i := range m.Units {
				for _, c := range m.Units[i].ACSChanges {
					if _, nicPort := nicPorts[c.Port]; nicPort {
						continue
					}
					if ctl := rb.acsCtl(t, c.Port); ctl != acsIsolation {
						t.Errorf("guest reads ACSCtl %#04x on %s (%s), want %#04x", ctl, c.Port, c.Result, acsIsolation)
					}
				}
			}
			// The management NIC: on its host driver, with QEMU's DHCP lease.
			if d := drivers[mgmtNIC]; d != "e1000e" {
				t.Errorf("management NIC %s: driver %q, want e1000e", mgmtNIC, d)
			}
			if !slices.ContainsFunc(rb.Leases, func(l string) bool { return strings.Contains(l, "10.0.2.15/24") }) {
				t.Errorf("leases %q, want 10.0.2.15/24 from QEMU's user network", rb.Leases)
			}
			// The manifest is written before the network comes up (the command line names
			// the node): it carries the stages up to hostname and nothing of network or
			// publish, whose results are in log.jsonl.
			var inManifest []string
			for _, s := range m.Stages {
				inManifest = append(inManifest, s.Name)
			}
			if want := []string{"modules", "scan", "decide", "acs", "erase", "vfio", "host", "hostname"}; !slices.Equal(inManifest, want) {
				t.Errorf("manifest stages %v, want %v (network and publish come after the manifest)", inManifest, want)
			}
			logged := map[string]stages.ResultRecord{}
			var order []string
			for _, s := range logStages(t, run) {
				logged[s.Name] = s
				order = append(order, s.Name)
			}
			if want := slices.Concat(inManifest, []string{"manifest", "network", "publish", "push"}); !slices.Equal(order, want) {
				t.Errorf("log.jsonl stages %v, want %v", order, want)
			}
			net := logged["network"]
			if net.Status != stages.OK || !slices.ContainsFunc(net.Changes, func(c string) bool { return strings.Contains(c, "10.0.2.15/24") }) {
				t.Errorf("log.jsonl network stage %+v, want ok with QEMU's DHCP lease", net)
			}
			// The host stage started setting the leased interface up in the background, through
			// the kernel's netlink, and the network stage reports that it came up.
			if len(net.Changes) > 0 {
				iface, _, _ := strings.Cut(net.Changes[0], " ")
				if h := logged["host"]; !slices.ContainsFunc(h.Changes, func(c string) bool { return strings.HasPrefix(c, "link-up of "+iface+" started") }) {
					t.Errorf("log.jsonl host stage changes %q, want %s's early link-up started", h.Changes, iface)
				}
				if !slices.ContainsFunc(net.Findings, func(f string) bool { return strings.HasPrefix(f, "early link-up "+iface+": up in") }) {
					t.Errorf("log.jsonl network findings %q, want %s's early link-up done", net.Findings, iface)
				}
			}
			if m.KernelRelease == "" || !strings.Contains(m.KernelCmdline, "passage.profile=qemu") {
				t.Errorf("kernel %q cmdline %q", m.KernelRelease, m.KernelCmdline)
			}
			if g := m.GuestPlan; g == nil || len(g.MatrixLabels) != 6 || g.ExpectedGuest[0][2] != "PIX" {
				t.Errorf("guest plan %+v, want 2 GPUs + 4 NICs with GPU0-NIC0 PIX", g)
			}
			if m.GenerationSource != manifest.GenerationTPMNV || m.Generation == 0 {
				t.Errorf("generation %d from %s, want the TPM NV counter", m.Generation, m.GenerationSource)
			}

			// The TPM itself, reopened after QEMU is gone: its key verifies the same envelope and
			// PCR 13 is the replay of the event log whose last event is this manifest.
			k, stop, err := OpenTPM(run.TPMState)
			if err != nil {
				t.Fatal(err)
			}
			defer stop()
			defer k.Close()
			tv, err := manifest.NewVerifier(k.Public())
			if err != nil {
				t.Fatal(err)
			}
			ver, err := manifest.Verify(run.Files["manifest.dsse.json"], tv, manifest.VerifyOptions{})
			if err != nil {
				t.Fatalf("manifest does not verify with the TPM's key: %v", err)
			}
			// The hypervisor's side: render the guest from this manifest alone and boot it.
			pemPub, err := manifest.MarshalPublicKey(k.Public())
			if err != nil {
				t.Fatal(err)
			}
			tpmPub := filepath.Join(t.TempDir(), "tpm.pub")
			if err := os.WriteFile(tpmPub, pemPub, 0o644); err != nil {
				t.Fatal(err)
			}
			logName := "manifest.dsse.json" + manifest.EventLogSuffix
			evlog, err := manifest.ParseEventLog(run.Files[logName])
			if err != nil {
				t.Fatalf("%s: %v", logName, err)
			}
			if n := len(evlog.Events); n == 0 || evlog.Events[n-1].PayloadDigest != ver.Digest || evlog.BootID != m.BootID {
				t.Fatalf("event log %+v does not end with manifest %s of boot %s", evlog, ver.Digest, m.BootID)
			}
			replay, err := evlog.Replay()
			if err != nil {
				t.Fatal(err)
			}
			if len(replay) == 0 {
				t.Fatal("event log replays no bank")
			}
			for bank, want := range replay {
				got, err := k.ReadPCR(bank)
				if err != nil {
					t.Fatal(err)
				}
				if hex.EncodeToString(got) != want {
					t.Errorf("PCR %d %s = %x, event log replay %s", evlog.PCR, bank, got, want)
				}
			}
			guestFromManifest(t, run, tpmPub)
		})
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
	if m2.Generation <= m1.Generation || m1.GenerationSource != manifest.GenerationTPMNV || m2.GenerationSource != manifest.GenerationTPMNV {
		t.Errorf("generation %d (%s) then %d (%s), want an increase of the TPM NV counter",
			m1.Generation, m1.GenerationSource, m2.Generation, m2.GenerationSource)
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

// checkPreflight compares what plan and apply --dry-run decided on the guest's /sys
// before the boot (internal/preflight) with what the boot then did: every unit's status
// and reasons equal the manifest's, and each command's exit code follows the verdict.
func checkPreflight(t *testing.T, run *Run, m *manifest.Manifest) {
	t.Helper()
	boot := map[string]string{}
	failed := false
	for _, u := range m.Units {
		boot[u.ID] = u.Status + ": " + strings.Join(u.Reasons, "; ")
		failed = failed || u.Status == manifest.StatusFailed
	}
	for _, name := range []string{"preflight-plan", "preflight-dryrun"} {
		var doc struct {
			Units []struct {
				ID      string   `json:"id"`
				Status  string   `json:"status"`
				Reasons []string `json:"reasons"`
			} `json:"units"`
		}
		if err := json.Unmarshal(run.Files[name+".json"], &doc); err != nil {
			t.Errorf("%s.json from the guest: %v (exit: %s)", name, err, run.Files[name+".exit"])
			continue
		}
		if len(doc.Units) != len(boot) {
			t.Errorf("%s: %d units, the boot %d", name, len(doc.Units), len(boot))
		}
		for _, u := range doc.Units {
			if got := u.Status + ": " + strings.Join(u.Reasons, "; "); got != boot[u.ID] {
				t.Errorf("%s decided %s %q; the boot's manifest says %q", name, u.ID, got, boot[u.ID])
			}
		}
		want := "0"
		if failed {
			want = "1"
		}
		if code, _, _ := strings.Cut(string(run.Files[name+".exit"]), "\n"); code != want {
			t.Errorf("%s exit %s, want %s (a unit failed: %v): %s", name, code, want, failed, run.Files[name+".exit"])
		}
	}
}

// Scenario 3: one NIC stand-in without ATS.
func TestScenario3ATSMissing(t *testing.T) {
	run, m := bootPassage(t, Options{Topology: Topology{ATSOff: true}, Overlay: []OverlayFile{preflightUinit(t)}})
	checkPreflight(t, run, m)
	checkFleet(t, run, m)
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

// Scenario 4: lockdown=integrity refuses config writes; vfio binding still works. Without
// a plan on the command line every unit is degraded with the pci=config_acs= advice, on
// 6.1 and on 6.12 alike.
func TestScenario4Lockdown(t *testing.T) {
	for _, k := range []string{"6.12", "6.1"} {
		t.Run(k, func(t *testing.T) {
			run, m := bootPassage(t, Options{Build: kernelBuild(t, k), Append: []string{"lockdown=integrity"}})
			rb := readbackOf(t, run)
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
				// apply's word for a write the kernel refuses (manifest/SCHEMA.md), then why.
				if c := acsChange(m, port); c == nil || !strings.HasPrefix(c.Result, "locked down: ") {
					t.Errorf("ACS %s under lockdown: %+v, want a refused write (locked down)", port, c)
				}
				if ctl := rb.acsCtl(t, port); ctl != acsIsolation {
					t.Errorf("guest reads ACSCtl %#04x on %s under lockdown, want the kernel's %#04x", ctl, port, acsIsolation)
				}
			}
		})
	}
}

// plans caches planFor's saved plans by topology: one reference boot per topology.
var plans sync.Map

// planFor is the saved plan `passage plan --out` writes on a node of topology topo booted
// directly, without lockdown: the reference node an operator plans a SKU's image on.
func planFor(t *testing.T, topo Topology) []byte {
	t.Helper()
	if b, ok := plans.Load(topo.Name()); ok {
		return b.([]byte)
	}
	run, _ := bootPassage(t, Options{Topology: topo, Overlay: []OverlayFile{preflightUinit(t)},
		Append: []string{"passage.net=off"}, Name: t.Name() + " (reference node " + topo.Name() + ")"})
	b := run.Files["preflight-plan.saved.json"]
	if len(b) == 0 {
		t.Fatalf("the reference boot saved no plan (plan --out: %s)", run.Files["preflight-saveplan.exit"])
	}
	plans.Store(topo.Name(), b)
	return b
}

// checkPlanVerified holds a boot whose command line carried the node's own plan to what
// a locked-down 6.12 does with it: the kernel programmed every listed port (its log
// says so), passage read each back as verified and wrote none, every unit is ready and
// bound, and the manifest names the plan and says the node matched it.
func checkPlanVerified(t *testing.T, run *Run, m *manifest.Manifest, plan []byte) {
	t.Helper()
	if run.Done != "ok" {
		t.Errorf("PASSAGE-DONE %s, want ok", run.Done)
	}
	for i := range m.Units {
		u := &m.Units[i]
		if u.Status != manifest.StatusReady {
			t.Errorf("unit %s: %s %q, want ready: the kernel set every port", u.ID, u.Status, u.Reasons)
		}
		for _, c := range u.ACSChanges {
			if !strings.HasPrefix(c.Result, "verified") {
				t.Errorf("unit %s: ACS %s: %s, want verified", u.ID, c.Port, c.Result)
			}
		}
		checkBound(t, u)
	}
	rb := readbackOf(t, run)
	for port := range nicPorts {
		if ctl := rb.acsCtl(t, port); ctl != acsIsolation|acsDT {
			t.Errorf("guest reads ACSCtl %#04x on %s, want %#04x set by the kernel", ctl, port, acsIsolation|acsDT)
		}
	}
	ip := m.ImagePlan
	if ip == nil || ip.Digest != decision.PlanDigest(plan) || !ip.Matched || !strings.HasPrefix(ip.Kernel, "configured ") {
		t.Errorf("manifest image_plan %+v, want digest %s, matched, configured by the kernel", ip, decision.PlanDigest(plan))
	}
}

// Scenario 4 with the plan: a 6.12 kernel booted with the reference node's plan and
// lockdown=integrity programs ACS itself; passage verifies instead of writing. 6.1
// ignores pci=config_acs=: passage, locked out of config space too, finds every port
// short of the plan, and every unit is degraded with the advice, still bound.
func TestScenario4LockdownPlanned(t *testing.T) {
	plan := planFor(t, Topology{})
	for _, k := range []string{"6.12", "6.1"} {
		t.Run(k, func(t *testing.T) {
			run, m := bootPassage(t, Options{Build: kernelBuild(t, k), Append: []string{"lockdown=integrity"}, Plan: plan})
			if k == "6.12" {
				checkPlanVerified(t, run, m, plan)
				return
			}
			if run.Done != "degraded" {
				t.Errorf("PASSAGE-DONE %s, want degraded (6.1 ignores pci=config_acs=)", run.Done)
			}
			for i := range m.Units {
				u := &m.Units[i]
				why := strings.Join(u.Reasons, "; ")
				if u.Status != manifest.StatusDegraded || !strings.Contains(why, "mismatch") || !strings.Contains(why, "ignores pci=config_acs=") {
					t.Errorf("unit %s: %s %q, want degraded: mismatch, 6.1 ignores the argument", u.ID, u.Status, why)
				}
				checkBound(t, u)
			}
		})
	}
}

// Scenario 5: a passthrough stand-in sharing an IOMMU group with a management NIC,
// and a passthrough device below a port without ACS.
func TestScenario5Isolation(t *testing.T) {
	run, m := bootPassage(t, Options{
		Topology: Topology{SharedGroup: true, NoACSPort: true},
		Append:   []string{"passage.host_modules=e1000e,e1000"},
		Overlay:  []OverlayFile{preflightUinit(t)},
	})
	checkPreflight(t, run, m)
	refused := unitWith(m, "0000:14:01.0")
	if refused == nil {
		t.Fatal("no unit holds 0000:14:01.0 (the e1000 behind the pcie-pci-bridge)")
	}
	if why := strings.Join(refused.Reasons, "; "); refused.Status != manifest.StatusFailed || !strings.Contains(why, "0000:14:02.0") {
		t.Errorf("unit %s: %s %q, want failed, refused for sharing a group with 0000:14:02.0", refused.ID, refused.Status, why)
	}
	// Refused: passage binds nothing of it and writes nothing for it. The host driver
	// loaded later (e1000, for the management NIC sharing the group) may claim it: it
	// stays a host device.
	for _, f := range refused.Functions {
		if f.DriverAfter == "vfio-pci" {
			t.Errorf("refused unit %s: %s on vfio-pci", refused.ID, f.BDF)
		}
	}
	// Its ports are left as they are: the decision failed the unit before the acs stage
	// wrote anything (apply reports them skipped, and the port without ACS as such).
	if len(refused.ACSChanges) == 0 {
		t.Errorf("refused unit %s: no ACS record", refused.ID)
	}
	for _, c := range refused.ACSChanges {
		if !strings.HasPrefix(c.Result, "skipped") && !strings.HasPrefix(c.Result, "no ACS capability") {
			t.Errorf("refused unit %s: ACS %s %q, want skipped", refused.ID, c.Port, c.Result)
		}
	}
	var vfioChanges []string
	if s := stage(m, "vfio"); s != nil {
		vfioChanges = s.Changes
	}
	for _, c := range vfioChanges {
		for _, bdf := range []string{"0000:14:01.0", "0000:14:02.0"} {
			if strings.Contains(c, bdf) {
				t.Errorf("vfio stage touched %s: %s", bdf, c)
			}
		}
	}
	// The management NIC behind the bridge keeps its host driver, and the first one too.
	rb := readbackOf(t, run)
	for _, f := range rb.Functions {
		if f.BDF == "0000:14:02.0" && f.Driver != "e1000" || f.BDF == mgmtNIC && f.Driver != "e1000e" {
			t.Errorf("management NIC %s: driver %q", f.BDF, f.Driver)
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

// TestEmergencyPoweroff: a verdict with a failed unit (a NIC stand-in without ATS under
// passage.ats=require) takes passage.emergency=poweroff instead of the handoff, after the
// manifest is signed and written. The handoff asked for is hold: without the emergency
// the guest would never power off, and the boot would run into its timeout.
func TestEmergencyPoweroff(t *testing.T) {
	run, m := bootPassage(t, Options{Topology: Topology{ATSOff: true},
		Append: []string{"passage.ats=require", "passage.handoff=hold", "passage.emergency=poweroff", "passage.emergency_on=failed"}})
	bad := unitWith(m, "0000:0f:00.1")
	if bad == nil || bad.Status != manifest.StatusFailed {
		t.Fatalf("unit of the NIC without ATS: %+v, want failed", bad)
	}
	if run.ExitErr != nil {
		t.Errorf("QEMU did not end by the guest's power-off: %v", run.ExitErr)
	}
	con, err := os.ReadFile(run.Console)
	if err != nil {
		t.Fatal(err)
	}
	why := "units failed: " + bad.ID + " (passage.emergency_on=failed)"
	for _, want := range []string{
		"passage: handoff hold not taken: " + why,
		"passage: emergency (" + why + "): poweroff (passage.emergency=poweroff)",
	} {
		if !strings.Contains(string(con), want) {
			t.Errorf("console lacks %q; its end:\n%s", want, consoleTail(run.Console, 30))
		}
	}
	if run.Markers["handoff"] < run.Markers["manifest-written"] {
		t.Errorf("emergency before the manifest: markers %v", run.Markers)
	}
	// The kernel log holds passage's lines: at the default console log level the kernel
	// echoes its err-level records ("[ 26.9] passage: boot failed") after passage's own.
	for _, l := range []string{"boot failed", "handoff hold not taken: " + why} {
		if !regexp.MustCompile(`(?m)^\[ *[0-9]+\.[0-9]+\] passage: ` + regexp.QuoteMeta(l) + `$`).Match(con) {
			t.Errorf("the kernel log did not get %q; the console's end:\n%s", l, consoleTail(run.Console, 30))
		}
	}
}

// TestEmergencyShell: with passage.emergency=shell a verdict with a failed unit leaves
// the operator at the image's shell on the serial console, after the manifest is
// written, and that shell answers every line typed at a person's pace. The test is the
// operator: once the console announces the shell it presses Enter (every 2 s) until a
// prompt shows, as one does at a console one has just attached to, then types each line
// of the session a key at a time with a typist's gaps between keys, ends it with Enter
// (CR, what a terminal sends), and waits for that line's answer before typing the next.
// It never retypes, and waits on nothing a person would not see (no echo, no redraw).
// One line it abandons with Ctrl-C, as a person does: the line must not run, and the
// shell (and passage, whose end would panic the kernel) must answer the next one.
// A line left unanswered ends the boot and fails the test. The kernel's log, read with
// the image's dmesg, must hold every stage's summary line as passage mirrored it there
// ("passage: scan ok ...").
func TestEmergencyShell(t *testing.T) {
	const (
		announced = ": shell (passage.emergency=shell)"
		begin     = "dmesg-begin"
		end       = "dmesg-end"
	)
	const (
		enter     = '\r'
		interrupt = 0x03 // Ctrl-C
		abandoned = "not-run"
	)
	type step struct {
		line   string
		key    byte                // Enter, or Ctrl-C to abandon the line
		answer func(l string) bool // the console line that answers it (nil: none)
		within time.Duration       // after its Enter
	}
	session := []step{
		{"echo ok", enter, func(l string) bool { return l == "ok" }, 20 * time.Second},
		{"cat /proc/cmdline", enter, func(l string) bool {
			return strings.Contains(l, "passage.emergency=shell") && !strings.Contains(l, "cat /proc/cmdline")
		}, 20 * time.Second},
		{"echo " + abandoned, interrupt, nil, 0},
		{"echo after-ctrl-c", enter, func(l string) bool { return l == "after-ctrl-c" }, 20 * time.Second},
		{"echo " + begin + "; dmesg; echo " + end, enter, func(l string) bool { return l == end }, time.Minute},
		{"echo bye", enter, func(l string) bool { return l == "bye" }, 20 * time.Second},
	}
	// A typist's gaps between keys (about 170 ms a key, some 70 words a minute).
	gaps := []time.Duration{140, 210, 120, 180, 260, 150, 190, 130}
	var (
		mu       sync.Mutex
		atShell  bool
		current  = -1 // the step whose Enter was pressed and whose answer is awaited
		inDmesg  bool
		dmesg    []string
		ran      bool // the abandoned line
		failure  string
		timings  []string
		prompt   = make(chan struct{})
		answered = make([]chan struct{}, len(session))
	)
	for i := range answered {
		answered[i] = make(chan struct{})
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fail := func(format string, a ...any) {
		mu.Lock()
		failure = fmt.Sprintf(format, a...)
		mu.Unlock()
		cancel()
	}
	pause := func(d time.Duration) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(d):
			return true
		}
	}
	operator := func(kb io.Writer) {
		if !pause(2 * time.Second) { // reading the announcement
			return
		}
		woken := false
		for i := 0; i < 30 && !woken; i++ {
			if _, err := kb.Write([]byte{'\r'}); err != nil {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-prompt:
				woken = true
			case <-time.After(2 * time.Second):
			}
		}
		if !woken {
			fail("pressed Enter for a minute: no prompt")
			return
		}
		for i, s := range session {
			if !pause(time.Second) { // reading the last answer
				return
			}
			start := time.Now()
			for k := 0; k < len(s.line); k++ {
				if _, err := kb.Write([]byte{s.line[k]}); err != nil {
					return
				}
				if !pause(gaps[k%len(gaps)] * time.Millisecond) {
					return
				}
			}
			mu.Lock()
			current = i
			mu.Unlock()
			pressed := time.Now()
			if _, err := kb.Write([]byte{s.key}); err != nil {
				return
			}
			if s.answer == nil {
				mu.Lock()
				timings = append(timings, fmt.Sprintf("%q: typed in %v, abandoned with Ctrl-C", s.line, pressed.Sub(start).Round(time.Millisecond)))
				mu.Unlock()
				continue
			}
			select {
			case <-ctx.Done():
				return
			case <-answered[i]:
				mu.Lock()
				timings = append(timings, fmt.Sprintf("%q: typed in %v, answered %v after Enter",
					s.line, pressed.Sub(start).Round(time.Millisecond), time.Since(pressed).Round(time.Millisecond)))
				mu.Unlock()
			case <-time.After(s.within):
				fail("line %d of %d, %q (typed in %v), not answered within %v of its Enter",
					i+1, len(session), s.line, pressed.Sub(start).Round(time.Millisecond), s.within)
				return
			}
		}
	}
	console := func(line string, kb io.Writer) bool {
		l := strings.TrimSpace(ansi.ReplaceAllString(line, ""))
		mu.Lock()
		defer mu.Unlock()
		if !atShell {
			if strings.Contains(l, "passage: emergency (units failed: ") && strings.HasSuffix(l, announced) {
				atShell = true
				go operator(kb)
			}
			return false
		}
		select {
		case <-prompt:
		default:
			// gosh's prompt, shown on a line of its own once the Enter that woke the
			// console is echoed; a line editor's prompt is a line of its own at once.
			if l == "$" || l == ">" {
				close(prompt)
			}
			return false
		}
		if l == abandoned {
			ran = true
		}
		if current < 0 || session[current].answer == nil {
			return false
		}
		s := session[current]
		if strings.HasSuffix(s.line, end) {
			switch {
			case l == begin:
				inDmesg = true
			case l == end:
				inDmesg = false
			case inDmesg:
				dmesg = append(dmesg, l)
			}
		}
		select {
		case <-answered[current]:
		default:
			if s.answer(l) {
				close(answered[current])
				return current == len(session)-1
			}
		}
		return false
	}
	priv, v := testKey(t)
	run, err := Boot(ctx, Options{Build: buildDir(t), Key: priv, WorkDir: filepath.Join(t.TempDir(), "work"),
		Name: t.Name(), Topology: Topology{ATSOff: true}, Console: console, Timeout: 4 * time.Minute,
		Append: []string{"passage.ats=require", "passage.handoff=hold", "passage.emergency=shell", "passage.emergency_on=failed"}})
	cancel()
	mu.Lock()
	defer mu.Unlock()
	if run != nil {
		t.Logf("console: %s\n%s", run.Console, run.Timeline())
		for _, s := range timings {
			t.Logf("operator: %s", s)
		}
	}
	switch {
	case failure != "":
		t.Fatalf("%s; the console's end:\n%s", failure, consoleTail(run.Console, 40))
	case err != nil && run != nil:
		t.Fatalf("%v; the console's end:\n%s", err, consoleTail(run.Console, 40))
	case err != nil:
		t.Fatal(err)
	case !atShell:
		t.Fatalf("the console never announced the emergency shell; its end:\n%s", consoleTail(run.Console, 30))
	case len(timings) != len(session):
		t.Fatalf("%d of %d lines answered; the console's end:\n%s", len(timings), len(session), consoleTail(run.Console, 40))
	}
	env, ok := run.Files["manifest.dsse.json"]
	if !ok {
		t.Fatalf("no manifest.dsse.json from the guest; files: %v", keys(run.Files))
	}
	ver, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatalf("manifest does not verify with the image's ed25519 key: %v", err)
	}
	m := ver.Manifest
	if u := unitWith(m, "0000:0f:00.1"); u == nil || u.Status != manifest.StatusFailed {
		t.Fatalf("unit of the NIC without ATS: %+v, want failed", u)
	}
	if ran {
		t.Errorf("the line abandoned with Ctrl-C ran (%q on the console)", abandoned)
	}
	if len(dmesg) == 0 {
		t.Fatalf("dmesg printed nothing between %s and %s; the console's end:\n%s", begin, end, consoleTail(run.Console, 40))
	}
	log := strings.Join(dmesg, "\n")
	for _, s := range m.Stages {
		re := regexp.MustCompile(`passage: ` + regexp.QuoteMeta(s.Name) + ` +` + regexp.QuoteMeta(string(s.Status)) + ` `)
		if !re.MatchString(log) {
			t.Errorf("the guest's dmesg lacks stage %s's line (%s); dmesg said:\n%s", s.Name, re, log)
		}
	}
}

// ansi matches the terminal control sequences a line editor draws with, and its
// queries (OSC colour requests).
var ansi = regexp.MustCompile(`\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[()][AB0-2]|\r`)

// checkImageBuild: the manifest names the build the image was made from, the commit
// this tree is at (image/initramfs.sh stamps it: u-root's busybox records none for
// passage), or no revision where the tree is not a git checkout.
func checkImageBuild(t *testing.T, m *manifest.Manifest) {
	t.Helper()
	if m.Build == nil {
		t.Fatal("the manifest names no build")
	}
	want, modified := "", false
	if out, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
		want = strings.TrimSpace(string(out))
		st, err := exec.Command("git", "status", "--porcelain").Output()
		if err != nil {
			t.Fatal(err)
		}
		modified = len(st) > 0
	}
	if m.Build.Revision != want || m.Build.Modified != modified || m.Build.Version != "(devel)" || m.Build.GoVersion != runtime.Version() {
		t.Errorf("manifest build %+v, want version (devel), revision %q (git rev-parse HEAD), modified %v (git status), %s",
			*m.Build, want, modified, runtime.Version())
	}
}
