package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestFloorFlag: -floor EMPTY,DEPS adds row O3 to the oracle measurement, timing the two
// binaries it names beside lspci --version; a value that is not two paths is refused. The
// passage side is a script that answers as passage plan does (this test judges the
// table's plumbing, not passage).
func TestFloorFlag(t *testing.T) {
	var out, errs bytes.Buffer
	if code := run([]string{"-passage", "/bin/true", "-floor", "only-one"}, &out, &errs); code != 2 || !strings.Contains(errs.String(), "want EMPTY,DEPS") {
		t.Fatalf("-floor only-one: exit %d, stderr %q", code, errs.String())
	}
	for _, tool := range []string{"lspci", "setpci"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s: %v (make deps installs pciutils)", tool, err)
		}
	}
	if _, err := os.Stat("/usr/share/misc/pci.ids"); err != nil {
		t.Fatalf("%v (pciutils ships it)", err)
	}
	fake := filepath.Join(t.TempDir(), "passage")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\necho 'gpu0 nic0 Mellanox Technologies'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	errs.Reset()
	if code := run([]string{"-passage", fake, "-floor", "/bin/true,/bin/true", "-rows", "oracle", "-rounds", "2", "-boot=false"}, &out, &errs); code != 0 {
		t.Fatalf("-rows oracle -floor: exit %d\n%s%s", code, out.String(), errs.String())
	}
	var o3 string
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(l, "O3 ") {
			o3 = l
		}
	}
	if !strings.Contains(o3, "start-up floor") || !strings.Contains(o3, "lspci --version") || !strings.Contains(o3, "an empty static Go program") {
		t.Errorf("row O3: %q\n%s", o3, out.String())
	}
	out.Reset()
	if code := run([]string{"-passage", fake, "-rows", "oracle", "-rounds", "2", "-boot=false"}, &out, &errs); code != 0 || strings.Contains(out.String(), "\nO3 ") {
		t.Errorf("without -floor: exit %d, table:\n%s", code, out.String())
	}
}
