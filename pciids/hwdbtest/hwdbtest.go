// Package hwdbtest builds udev hardware databases for tests with systemd-hwdb, the tool
// udev's own hwdb.bin is compiled with, so a test's database is in the real format.
package hwdbtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// Build writes files (paths relative to a new root, e.g. "etc/udev/hwdb.d/20-x.hwdb")
// and compiles them with `systemd-hwdb --strict update --root`; it returns the root and
// the hwdb.bin written under it.
func Build(t testing.TB, files map[string]string) (root, bin string) {
	t.Helper()
	tool, err := exec.LookPath("systemd-hwdb")
	if err != nil {
		t.Fatalf("systemd-hwdb not found (image/deps.sh installs udev, which ships it): %v", err)
	}
	root = t.TempDir()
	for name, text := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command(tool, "--strict", "update", "--root", root).CombinedOutput(); err != nil {
		t.Fatalf("systemd-hwdb update: %v\n%s", err, out)
	}
	return root, filepath.Join(root, "etc/udev/hwdb.bin")
}
