package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
)

func TestEmergencyWhy(t *testing.T) {
	units := []stages.Unit{{ID: "gpu0", Status: stages.OK}, {ID: "gpu1", Status: stages.Failed}, {ID: "gpu2", Status: stages.Degraded}}
	for _, tt := range []struct {
		on      initramfs.EmergencyOn
		summary stages.Status
		units   []stages.Unit
		want    string
	}{
		{initramfs.EmergencyOnFailed, stages.Failed, units, "units failed: gpu1 (passage.emergency_on=failed)"},
		{initramfs.EmergencyOnDegraded, stages.Failed, units, "units failed: gpu1; degraded: gpu2 (passage.emergency_on=degraded)"},
		{initramfs.EmergencyOnNever, stages.Failed, units, ""},
		{initramfs.EmergencyOnFailed, stages.Degraded, units[2:], ""},
		{initramfs.EmergencyOnDegraded, stages.Degraded, units[2:], "units degraded: gpu2 (passage.emergency_on=degraded)"},
		{initramfs.EmergencyOnFailed, stages.OK, units[:1], ""},
		{initramfs.EmergencyOnFailed, stages.Failed, nil, "the boot failed before any unit was decided"},
		{initramfs.EmergencyOnNever, stages.Failed, nil, ""},
	} {
		cfg := initramfs.Defaults()
		cfg.EmergencyOn = tt.on
		if got := emergencyWhy(cfg, tt.summary, tt.units, true); got != tt.want {
			t.Errorf("emergency_on=%s, %d units, %s: %q, want %q", tt.on, len(tt.units), tt.summary, got, tt.want)
		}
		// Without a signed manifest the boot cannot go on, whatever emergency_on says.
		if got := emergencyWhy(cfg, tt.summary, tt.units, false); got != "no signed manifest was written" {
			t.Errorf("emergency_on=%s, no manifest: %q", tt.on, got)
		}
	}
	if initramfs.Defaults().EmergencyOn != initramfs.EmergencyOnNever {
		t.Errorf("default passage.emergency_on=%s: a node with one failed unit would not hand off", initramfs.Defaults().EmergencyOn)
	}
}

// TestBootKmsgAndEmergency: a boot mirrors its console into the kernel log (a plain file
// at the tree's dev/kmsg here), and names the emergency it would take for a verdict with
// a failed unit under passage.emergency_on=failed (and hands off under the default).
func TestBootKmsgAndEmergency(t *testing.T) {
	spec := pcitest.B300()
	spec.Fn("nic1.0").ATS = nil // gpu1 fails under passage.ats=require
	root := bootTreeOf(t, spec, "console=ttyS0 passage.profile=b300 passage.key=/etc/passage/passage.key passage.tpm=off "+
		"passage.ats=require passage.emergency=poweroff passage.emergency_on=failed passage.debug")
	kmsg := filepath.Join(root, "dev", "kmsg")
	os.MkdirAll(filepath.Dir(kmsg), 0o755)
	if err := os.WriteFile(kmsg, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	devkmsg := filepath.Join(root, "proc", "sys", "kernel", "printk_devkmsg")
	if err := os.WriteFile(devkmsg, []byte("ratelimit\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var con, errb bytes.Buffer
	cmdBoot([]string{"--root", root, "--dry-run", "--no-handoff"}, &con, &errb)
	if b, _ := os.ReadFile(devkmsg); string(b) != "ratelimit\n" {
		t.Errorf("printk_devkmsg after the boot: %q, want the kernel's ratelimit back", b)
	}
	log, err := os.ReadFile(kmsg)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<15>passage: passage ", "passage: scan      ok", "<11>passage: boot --dry-run failed: "} {
		if !bytes.Contains(log, []byte(want)) {
			t.Errorf("kernel log lacks %q:\n%s", want, log)
		}
	}
	if bytes.Contains(log, []byte("PASSAGE-T")) {
		t.Errorf("timeline markers in the kernel log:\n%s", log)
	}
	if !strings.Contains(con.String(), "passage: emergency poweroff would be taken (units failed: gpu1 (passage.emergency_on=failed)); --no-handoff\n") {
		t.Errorf("console does not name the emergency:\n%s", con.String())
	}

	// Under the default the same verdict hands off: gpu1 stays failed, the rest serve.
	root = bootTreeOf(t, spec, "console=ttyS0 passage.profile=b300 passage.key=/etc/passage/passage.key passage.tpm=off "+
		"passage.ats=require passage.emergency=poweroff")
	con.Reset()
	cmdBoot([]string{"--root", root, "--dry-run", "--no-handoff"}, &con, &errb)
	if !strings.Contains(con.String(), "passage: boot --dry-run failed") || strings.Contains(con.String(), "would be taken") {
		t.Errorf("default passage.emergency_on: a failed unit should hand off:\n%s", con.String())
	}
}
