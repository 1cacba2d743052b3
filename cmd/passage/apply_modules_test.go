package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
)

// TestApplyModulesFromTree: apply --root DIR loads nothing into the running kernel from
// DIR unless asked, and never through a release that is not a plain name.
func TestApplyModulesFromTree(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	p := filepath.Join(root, "proc/sys/kernel/osrelease")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("../../../tmp/evil\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, _, errs := applyCmd(t, "--root", root, "--modules-from-root")
	if code != 2 || !strings.Contains(errs, `kernel release "../../../tmp/evil": not a plain release name`) {
		t.Errorf("--modules-from-root with a path as release: exit %d, %q", code, errs)
	}
	// Without the flag the tree's modules are not this kernel's business: apply goes on
	// (and, vfio-pci not being registered in a synthetic tree, binds nothing).
	code, out, errs := applyCmd(t, "--root", root)
	if strings.Contains(errs, "release") || !strings.Contains(out, "vfio stack") {
		t.Errorf("apply without --modules-from-root: exit %d\n%s\n%s", code, out, errs)
	}
}
