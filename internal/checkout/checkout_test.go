package checkout

import (
	"os"
	"path/filepath"
	"testing"
)

// TestRoot finds the checkout from the package's directory (go test's working
// directory) both ways: the root holds this package's source and the root go.mod.
func TestRoot(t *testing.T) {
	root, err := Root()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "internal", "checkout", "checkout.go")); err != nil {
		t.Fatalf("root %s: %v", root, err)
	}
	if !declares(filepath.Join(root, "go.mod")) {
		t.Fatalf("root %s: its go.mod does not declare %s", root, Module)
	}
	// The working directory's way, which a -trimpath build takes.
	if got := walk(t, "."); got != root {
		t.Fatalf("from the package's directory the walk found %q, runtime.Caller %q", got, root)
	}
	// A go.mod of another module (kube/'s) on the way up is passed over.
	if got := walk(t, filepath.Join(root, "kube", "control")); got != root {
		t.Fatalf("from kube/control the walk found %q, want %q", got, root)
	}
	if got := walk(t, t.TempDir()); got != "" {
		t.Fatalf("outside the checkout the walk found %q", got)
	}
}

func walk(t *testing.T, from string) string {
	t.Helper()
	t.Chdir(from)
	got, err := fromWorkingDir()
	if err != nil {
		return ""
	}
	return got
}
