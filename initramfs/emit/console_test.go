package emit

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Drain must never hang or fail the handoff on something that is not a terminal
// (a pipe when passage boot runs under a test or a supervisor).
func TestDrainNotATerminal(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if _, err := w.Write([]byte("unread\n")); err != nil {
		t.Fatal(err)
	}
	if err := Drain(w); err != nil {
		t.Errorf("pipe: %v", err)
	}
	if err := Drain(&bytes.Buffer{}); err != nil {
		t.Errorf("buffer: %v", err)
	}
}

// The uinit writes to the console= TTYs itself, each once, skipping those that do not
// open; names that would leave /dev are refused.
func TestOpenConsoles(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "proc"), 0o755)
	os.MkdirAll(filepath.Join(root, "dev"), 0o755)
	os.WriteFile(filepath.Join(root, "proc/cmdline"),
		[]byte("quiet console=tty0 console=ttyS0,115200n8 console=ttyS0 console=../etc/passwd\n"), 0o644)
	os.WriteFile(filepath.Join(root, "dev/ttyS0"), nil, 0o644)
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), nil, 0o644)
	fs := OpenConsoles(root)
	var names []string
	for _, f := range fs {
		names = append(names, filepath.Base(f.Name()))
		f.Close()
	}
	if strings.Join(names, " ") != "ttyS0" {
		t.Errorf("opened %v, want [ttyS0]", names)
	}
	if got := OpenConsoles(t.TempDir()); len(got) != 0 {
		t.Errorf("no /proc/cmdline: opened %d", len(got))
	}
}
