package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci/pcitest"
)

// bootTree is a synthetic B300 node: sysfs from pcitest plus the /proc files and the key a
// boot reads.
func bootTree(t *testing.T, cmdline string) string {
	t.Helper()
	return bootTreeOf(t, pcitest.B300(), cmdline)
}

// bootTreeOf is bootTree on another node.
func bootTreeOf(t *testing.T, spec pcitest.Spec, cmdline string) string {
	t.Helper()
	root := pcitest.New(t, spec).Root
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

// TestBootDryRun: boot --dry-run on the B300 reference tree, with passage.handoff=hold
// on its command line and without --no-handoff, returns by itself; it decides and
// reports, and signs nothing: no envelope or payload anywhere under the root, so no
// signed record calls a unit ready that nothing bound. The console and log.jsonl carry
// the decision.
func TestBootDryRun(t *testing.T) {
	root := bootTree(t, "console=ttyS0 passage.profile=b300 passage.key=/etc/passage/passage.key passage.tpm=off "+
		"passage.emit=console passage.handoff=hold passage.bogus=1")
	var out, errb bytes.Buffer
	done := make(chan int, 1)
	go func() { done <- cmdBoot([]string{"--root", root, "--dry-run"}, &out, &errb) }()
	var code int
	select {
	case code = <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("boot --dry-run did not return within 60s (it holds)")
	}
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
		"passage: manifest  skipped",
		"dry run: nothing was prepared, nothing is signed",
		"passage: publish   skipped",
		"passage: boot --dry-run failed: the decision only; nothing written, bound, erased or signed\n",
		"===PASSAGE-DONE failed===\n",
	} {
		if !strings.Contains(con, want) {
			t.Errorf("console lacks %q", want)
		}
	}
	for _, not := range []string{"PASSAGE-T handoff", "PASSAGE-T manifest-written", "passage: handoff"} {
		if strings.Contains(con, not) {
			t.Errorf("console has %q in a dry run", not)
		}
	}
	// A dry run plans DT on every unit's NIC port and writes none of them.
	if n := strings.Count(con, "would apply"); n != 8 {
		t.Errorf("%d ports left for the dry run, want 8 (one NIC port per unit)", n)
	}

	// Nothing signed, nothing that reads as a manifest, anywhere under the root.
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if n := d.Name(); strings.HasPrefix(n, "manifest") || strings.HasSuffix(n, ".dsse.json") {
			t.Errorf("a dry run wrote %s", strings.TrimPrefix(p, root))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := emit.Parse(strings.NewReader(con))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Errors) != 0 {
		t.Errorf("console blocks damaged: %v", got.Errors)
	}
	if got.Done != "failed" || got.Markers["uinit-start"] != 7.25 {
		t.Errorf("read back PASSAGE-DONE %q, markers %v", got.Done, got.Markers)
	}
	for n := range got.Files {
		if n != "log.jsonl" && n != "readback.json" {
			t.Errorf("a dry run emitted %s", n)
		}
	}
	var rb struct {
		Functions []struct{ BDF, ACSCtl string }
	}
	if err := json.Unmarshal(got.Files["readback.json"], &rb); err != nil || len(rb.Functions) == 0 {
		t.Errorf("readback.json: %v (%d functions)", err, len(rb.Functions))
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
	if stagesN != 12 || unitsN != 8 {
		t.Errorf("log has %d stage and %d unit lines, want 12 and 8", stagesN, unitsN)
	}
	if got := strings.Join(order, " "); got != "modules scan decide acs erase vfio host hostname manifest network publish push" {
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
