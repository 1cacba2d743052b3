//go:build qemu

package qemutest

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// Scenario 8: a node boots the way it does in a fleet. OVMF with Secure Boot (the
// snakeoil test key enrolled in db), the management NIC's iPXE ROM gets boot.ipxe from
// QEMU's TFTP on a restrict=on network, and chains a unified kernel image signed with
// that key; the CPU has no RDRAND, so the kernel's random pool is not ready during the
// boot. passage runs, signs the manifest and leases an address without waiting on the
// pool. Under Secure Boot Debian's kernel is locked down (integrity): the ACS writes are
// refused and the units are degraded with the pci=config_acs= advice, as on a real
// Secure Boot node.
func TestScenario8NetBootSecureBoot(t *testing.T) {
	run, m := bootPassage(t, Options{NetBoot: &NetBoot{}, NoRDRAND: true})
	con, err := os.ReadFile(run.Console)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"iPXE", "boot.ipxe", "passage.efi... ok", "EFI stub: UEFI Secure Boot is enabled"} {
		if !strings.Contains(string(con), want) {
			t.Errorf("console lacks %q: not the iPXE and Secure Boot path", want)
		}
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
	if run.Done != "degraded" {
		t.Errorf("PASSAGE-DONE %s, want degraded (Secure Boot locks the kernel down)", run.Done)
	}
	for i := range m.Units {
		u := &m.Units[i]
		if u.Status != manifest.StatusDegraded || !strings.Contains(strings.Join(u.Reasons, "; "), "pci=config_acs=") {
			t.Errorf("unit %s: %s %q, want degraded with the pci=config_acs= advice", u.ID, u.Status, u.Reasons)
		}
		checkBound(t, u)
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
