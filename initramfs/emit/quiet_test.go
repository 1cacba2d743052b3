package emit

import (
	"os"
	"path/filepath"
	"testing"
)

func TestQuietKernel(t *testing.T) {
	root := t.TempDir()
	p := filepath.Join(root, "proc", "sys", "kernel", "printk")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("7\t4\t1\t7\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	restore, err := QuietKernel(root)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "1\n" {
		t.Errorf("during: %q", b)
	}
	if err := restore(); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "7\n" {
		t.Errorf("after: %q", b)
	}

	// Without /proc the blocks are still written: the error says why nothing was quieted.
	restore, err = QuietKernel(t.TempDir())
	if err == nil {
		t.Error("no error without /proc")
	}
	if restore() != nil {
		t.Error("restore without /proc failed")
	}
}
