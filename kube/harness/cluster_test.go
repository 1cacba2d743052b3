package harness_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/kube/harness"
)

// TestStartFailsNamingTheComponent: a component that dies before it is ready fails Start
// at once with its name and its log's tail, and a missing binary names the directory
// and how to build it (the waits never run into their bounds for these).
func TestStartFailsNamingTheComponent(t *testing.T) {
	bin := t.TempDir()
	if _, err := harness.Start(context.Background(), bin, t.TempDir()); err == nil || !strings.Contains(err.Error(), filepath.Join(bin, "etcd")) || !strings.Contains(err.Error(), "make cluster-bin") {
		t.Fatalf("no binaries: %v", err)
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"} {
		script := "#!/bin/sh\necho \"$0: listen tcp 127.0.0.1: bind: address already in use\" >&2\nexit 1\n"
		if err := os.WriteFile(filepath.Join(bin, b), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, err := harness.Start(context.Background(), bin, t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "etcd exited") || !strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("etcd dying at start: %v", err)
	}
}
