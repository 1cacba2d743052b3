//go:build qemu

package qemutest

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/manifest"
)

// Scenario 8: a node boots the way it does in a fleet. OVMF with Secure Boot (the
// snakeoil test key enrolled in db), the management NIC's iPXE ROM gets boot.ipxe from
// QEMU's TFTP on a restrict=on network, and chains a unified kernel image signed with
// that key, whose command line carries the reference node's plan (make uki PLAN=); the
// CPU has no RDRAND and the TPM's RNG is credited nothing, so the kernel's random pool is
// not ready during the boot. Under Secure Boot Debian's kernel is locked down
// (integrity): 6.12 programs ACS from the signed command line and passage verifies every
// port, so every unit is ready. 6.1 ignores the argument, and every unit is degraded with
// the advice: TestScenario4LockdownPlanned boots 6.1 locked down with the plan (the same
// kernel, initramfs and command line, without the firmware's 25 s).
func TestScenario8NetBootSecureBoot(t *testing.T) {
	plan := planFor(t, Topology{})
	run, m := bootPassage(t, Options{NetBoot: &NetBoot{}, NoRDRAND: true, Plan: plan})
	checkSecureNetBoot(t, run)
	if !strings.Contains(run.Cmdline, "passage.plan="+decision.PlanDigest(plan)) {
		t.Errorf("the image's command line %q does not carry the plan", run.Cmdline)
	}
	checkPlanVerified(t, run, m, plan)
}

// Scenario 8, planned for another topology: the signed image carries the plan of a node
// whose unit 1 has a port without ACS (so the plan leaves unit 1 out), and boots the
// default node. The locked-down kernel set unit 0's ports, which verify: unit 0 is
// ready. Unit 1's NIC port needs DT that nothing may set: unit 1 fails naming the port
// and the other topology, and the manifest says the node did not match the plan.
func TestScenario8NetBootOtherTopology(t *testing.T) {
	plan := planFor(t, Topology{NoACSPort: true})
	run, m := bootPassage(t, Options{NetBoot: &NetBoot{}, NoRDRAND: true, Plan: plan})
	checkSecureNetBoot(t, run)
	if run.Done != "failed" {
		t.Errorf("PASSAGE-DONE %s, want failed (a unit failed)", run.Done)
	}
	const unit1NIC = "0000:0e:00.0"
	for i := range m.Units {
		u := &m.Units[i]
		why := strings.Join(u.Reasons, "; ")
		switch u.ID {
		case "gpu1":
			if u.Status != manifest.StatusFailed || !strings.Contains(why, "acs "+unit1NIC) || !strings.Contains(why, "planned for another topology") {
				t.Errorf("unit %s: %s %q, want failed naming %s and the other topology", u.ID, u.Status, why, unit1NIC)
			}
		default:
			if u.Status != manifest.StatusReady {
				t.Errorf("unit %s: %s %q, want ready", u.ID, u.Status, why)
			}
			checkBound(t, u)
		}
	}
	if ip := m.ImagePlan; ip == nil || ip.Matched || ip.Digest != decision.PlanDigest(plan) || !strings.Contains(strings.Join(ip.Differences, "; "), unit1NIC) {
		t.Errorf("manifest image_plan %+v, want the plan's digest, not matched, naming %s", ip, unit1NIC)
	}
}

var fetched = regexp.MustCompile(`passage\.efi\.\.\.[^\n]*\bok\b`)

// checkSecureNetBoot holds a boot to the fleet path: iPXE chained the signed image,
// Secure Boot was on, no -kernel/-initrd and no RDRAND, and the kernel's random pool was
// still cold when the network stage ended (the stage leased an address without it).
func checkSecureNetBoot(t *testing.T, run *Run) {
	t.Helper()
	con, err := os.ReadFile(run.Console)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"iPXE", "boot.ipxe", "EFI stub: UEFI Secure Boot is enabled"} {
		if !strings.Contains(string(con), want) {
			t.Errorf("console lacks %q: not the iPXE and Secure Boot path", want)
		}
	}
	// iPXE ends the image's line with "ok"; a slow transfer prints its progress between.
	if !fetched.Match(con) {
		t.Errorf("console lacks iPXE's \"passage.efi... ok\": the signed image was not what booted")
	}
	for _, banned := range []string{"rdrand", "-kernel", "-initrd"} {
		for _, a := range run.Args {
			if strings.Contains(a, banned) || a == banned {
				t.Errorf("QEMU argument %q: the scenario must boot without %s", a, banned)
			}
		}
	}
	// The point of no RDRAND: the kernel's pool must still be uninitialised when the
	// network stage ran. Its "crng init done" line, if any, comes after the stage's.
	c := string(con)
	netLine := strings.Index(c, "passage: network ")
	if crng := strings.Index(c, "random: crng init done"); netLine < 0 || crng >= 0 && crng < netLine {
		t.Errorf("the kernel's random pool was ready before the network stage ended (crng at %d, network at %d): the scenario tests nothing", crng, netLine)
	}
	var network bool
	for _, s := range logStages(t, run) {
		if s.Name != "network" {
			continue
		}
		network = true
		if s.Status != "ok" {
			t.Errorf("network stage %s: %s %v", s.Status, s.Error, s.Findings)
		}
		t.Logf("network stage: %s in %.0f ms (deadline passage.net_timeout, 30 s by default)", s.Status, s.DurationMS)
	}
	if !network {
		t.Error("no network stage in log.jsonl")
	}
	if rb := readbackOf(t, run); len(rb.Leases) == 0 || !strings.Contains(strings.Join(rb.Leases, " "), "10.0.2.15") {
		t.Errorf("leases %q, want 10.0.2.15 from QEMU's DHCP", rb.Leases)
	}
}

// Scenario 8, tampered: the same boot with one byte of the initramfs changed inside the
// signed image (on the TFTP server, after signing). The firmware refuses it and iPXE says
// so; the kernel never starts and passage never runs. The control: the same tampered
// image under the same firmware without Secure Boot keys starts the kernel, so what
// stopped it was the signature check, not a broken image.
func TestScenario8NetBootTamperedImageRefused(t *testing.T) {
	const refused = "passage: passage.efi did not boot"
	tamper := func(uki string) error { return TamperSection(uki, ".initrd") }
	priv, _ := testKey(t)
	run, err := Boot(t.Context(), Options{Build: buildDir(t), Key: priv, Name: t.Name(), NoRDRAND: true,
		WorkDir: t.TempDir(), Timeout: 3 * time.Minute, NetBoot: &NetBoot{Tamper: tamper, StopAt: refused}})
	if err != nil {
		t.Fatal(err)
	}
	con, err := os.ReadFile(run.Console)
	if err != nil {
		t.Fatal(err)
	}
	c := string(con)
	if !strings.Contains(c, "Could not boot") || !strings.Contains(c, refused) {
		t.Errorf("no refusal from iPXE (\"Could not boot\", %q); console end:\n%s", refused, consoleTail(run.Console, 30))
	}
	if strings.Contains(c, "EFI stub") || strings.Contains(c, "Linux version") || len(run.Markers) > 0 || run.Done != "" {
		t.Errorf("the tampered image ran (kernel or passage output on the console)")
	}

	control, err := Boot(t.Context(), Options{Build: buildDir(t), Key: priv, Name: t.Name() + " (no Secure Boot keys)",
		NoRDRAND: true, WorkDir: t.TempDir(), Timeout: 3 * time.Minute,
		NetBoot: &NetBoot{Vars: OVMFVarsNoKeys, Tamper: tamper, StopAt: "EFI stub"}})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := os.ReadFile(control.Console)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(cc), "EFI stub") || strings.Contains(string(cc), refused) {
		t.Errorf("control: without Secure Boot keys the tampered image should start the kernel; console end:\n%s", consoleTail(control.Console, 30))
	}
}
