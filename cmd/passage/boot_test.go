package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci/pcitest"
)

// bootTree is a synthetic B300 node: sysfs from pcitest plus the /proc files and the key a
// boot reads.
func bootTree(t *testing.T, cmdline string) string {
	t.Helper()
	root := pcitest.New(t, pcitest.B300()).Root
	files := map[string]string{
		"proc/cmdline":                   cmdline + "\n",
		"proc/uptime":                    "7.250 12.00\n",
		"proc/sys/kernel/random/boot_id": "6f1c2a34-0000-4000-8000-000000000001\n",
		"proc/sys/kernel/osrelease":      "6.1.0-test-amd64\n",
		"proc/sys/kernel/hostname":       "b300-test\n",
	}
	for p, c := range files {
		os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.MkdirAll(filepath.Join(root, "lib/modules/6.1.0-test-amd64"), 0o755)
	os.MkdirAll(filepath.Join(root, "sys/class/net"), 0o755)
	keyDir := filepath.Join(root, "etc/passage")
	os.MkdirAll(keyDir, 0o755)
	if _, _, err := manifest.GenerateKey(keyDir); err != nil {
		t.Fatal(err)
	}
	return root
}

func TestBootDryRun(t *testing.T) {
	root := bootTree(t, "console=ttyS0 passage.profile=b300 passage.key=/etc/passage/passage.key passage.tpm=off "+
		"passage.emit=console passage.handoff=poweroff passage.bogus=1")
	var out, errb bytes.Buffer
	code := cmdBoot([]string{"--root", root, "--dry-run", "--no-handoff"}, &out, &errb)
	con := out.String()
	if os.Getenv("PASSAGE_SHOW") != "" {
		t.Log(con)
	}
	if errb.Len() > 0 {
		t.Errorf("stderr: %s", errb.String())
	}
	// The vfio stack is not in this tree's /lib/modules: modules fails, so the boot does.
	if code != 1 {
		t.Errorf("exit %d, want 1 (modules failed)\n%s", code, con)
	}
	for _, want := range []string{
		"PASSAGE-T uinit-start 7.250\n",
		`cmdline "passage.bogus=1": unknown passage argument`,
		"passage: modules   failed",
		"passage: scan      ok",
		"passage: decide    ok",
		"passage: acs       ok",
		"reads 0x001d: would apply",
		"passage: vfio      skipped",
		"passage: manifest  ok",
		"passage: publish   skipped",
		"PASSAGE-T manifest-written 7.250\n",
		"passage: boot failed\n",
		"===PASSAGE-DONE failed===\n",
	} {
		if !strings.Contains(con, want) {
			t.Errorf("console lacks %q", want)
		}
	}
	if strings.Contains(con, "PASSAGE-T handoff") {
		t.Error("handoff marker with --no-handoff")
	}

	// What left over the console is what is on disk, and the envelope verifies.
	got, err := emit.Parse(strings.NewReader(con))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Errors) != 0 {
		t.Errorf("console blocks damaged: %v", got.Errors)
	}
	if got.Done != "failed" || got.Markers["uinit-start"] != 7.25 || got.Markers["manifest-written"] != 7.25 {
		t.Errorf("read back PASSAGE-DONE %q, markers %v", got.Done, got.Markers)
	}
	for _, n := range []string{"manifest.dsse.json", "manifest.json", "log.jsonl", "readback.json"} {
		disk, err := os.ReadFile(filepath.Join(root, "run/passage", n))
		if err != nil {
			t.Fatal(err)
		}
		if n != "log.jsonl" && !bytes.Equal(got.Files[n], disk) {
			t.Errorf("%s emitted differs from disk", n)
		}
		if len(got.Files[n]) == 0 {
			t.Errorf("%s not emitted", n)
		}
	}
	v, err := manifest.LoadVerifier(filepath.Join(root, "etc/passage/passage.pub"))
	if err != nil {
		t.Fatal(err)
	}
	// A dry run binds nothing, so the units it calls ready are not on vfio-pci: the
	// signature verifies (the contradiction is checked after it) and the payload is
	// refused, so no hypervisor takes a dry run for a boot.
	_, err = manifest.Verify(got.Files["manifest.dsse.json"], v, manifest.VerifyOptions{})
	if !errors.Is(err, manifest.ErrContradiction) || !strings.Contains(err.Error(), `driver_after "nvme", want vfio-pci`) {
		t.Fatalf("verify the dry run's manifest: %v, want a contradiction (ready, not bound)", err)
	}
	m, err := manifest.Unmarshal(got.Files["manifest.json"])
	if err != nil {
		t.Fatal(err)
	}
	if m.BootID != "6f1c2a34-0000-4000-8000-000000000001" || m.Profile.Name != "b300" {
		t.Errorf("manifest boot id %q profile %q", m.BootID, m.Profile.Name)
	}
	if len(m.Units) != 8 {
		t.Errorf("manifest has %d units, want 8", len(m.Units))
	}
	// A dry run plans DT on every unit's NIC port and writes none of them.
	for _, u := range m.Units {
		dry := 0
		for _, c := range u.ACSChanges {
			if c.Result == "would apply" && strings.Contains(c.Target, "DirectTrans+") && !strings.Contains(c.After, "DirectTrans+") {
				dry++
			}
		}
		if dry != 1 {
			t.Errorf("unit %s: %d NIC ports left for the dry run, want 1: %+v", u.ID, dry, u.ACSChanges)
		}
	}
	var rb struct {
		Functions []struct{ BDF, ACSCtl string }
	}
	if err := json.Unmarshal(got.Files["readback.json"], &rb); err != nil || len(rb.Functions) == 0 {
		t.Errorf("readback.json: %v (%d functions)", err, len(rb.Functions))
	}
	if len(m.Errors) != 1 || !strings.Contains(m.Errors[0], "passage.bogus=1") {
		t.Errorf("manifest errors = %q", m.Errors)
	}
	var names []string
	for _, s := range m.Stages {
		names = append(names, s.Name)
	}
	// The manifest is written before the network and publish stages: it records the
	// stages that prepared the node, not its delivery.
	if strings.Join(names, " ") != "modules scan decide acs erase vfio host" {
		t.Errorf("manifest stages = %v", names)
	}

	// log.jsonl: one line per stage, then one per unit.
	f, err := os.Open(filepath.Join(root, "run/passage/log.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var stagesN, unitsN int
	var order []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		switch rec["type"] {
		case "stage":
			stagesN++
			order = append(order, fmt.Sprint(rec["name"]))
		case "unit":
			unitsN++
		}
	}
	if stagesN != 11 || unitsN != 8 {
		t.Errorf("log has %d stage and %d unit lines, want 11 and 8", stagesN, unitsN)
	}
	if got := strings.Join(order, " "); got != "modules scan decide acs erase vfio host manifest network publish push" {
		t.Errorf("log's stage order %q", got)
	}
}

func TestBootBadFlag(t *testing.T) {
	var out, errb bytes.Buffer
	if code := cmdBoot([]string{"--no-handoff", "--bogus"}, &out, &errb); code != 2 {
		t.Errorf("exit %d, want 2", code)
	}
	if !strings.Contains(errb.String(), "bogus") {
		t.Errorf("stderr %q", errb.String())
	}
}
