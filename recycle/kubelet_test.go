package recycle_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/recycle"
)

// TestRecycleCarriesKubeletKey: a generation recycle signs in the boot that made the
// kubelet's key signs that key again (passage-control's record keeps the key the kubelet
// holds), under the boot's hostname whatever the hostname reads now (a container's UTS
// namespace has its pod's); after a reboot (another boot id) the previous boot's key and
// hostname are not carried.
func TestRecycleCarriesKubeletKey(t *testing.T) {
	n := newNode(t)
	m := n.latest(t)
	m.Node.KubeletKey = manifesttest.KubeletKey
	const boot = "b300-a"
	m.Node.Hostname = boot
	if err := os.WriteFile(filepath.Join(n.root, "proc/sys/kernel/hostname"), []byte("passage-dra-x7k2q\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := manifest.WriteSigned(context.Background(), m, n.dir, recycle.EnvelopeName, nil, n.signer); err != nil {
		t.Fatal(err)
	}
	if _, err := recycle.Run(context.Background(), n.opts(3)); err != nil {
		t.Fatal(err)
	}
	if got := n.latest(t); got.Node.KubeletKey != manifesttest.KubeletKey || got.Generation <= m.Generation || got.Node.Hostname != boot {
		t.Fatalf("the same boot's generation %d: kubelet key %q, hostname %q; want %q, %q", got.Generation, got.Node.KubeletKey,
			got.Node.Hostname, manifesttest.KubeletKey, boot)
	}
	if err := os.WriteFile(filepath.Join(n.root, "proc/sys/kernel/random/boot_id"), []byte("0d1e2f3a-4b5c-4d6e-8f70-8192a3b4c5d6\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := recycle.Run(context.Background(), n.opts(3)); err != nil {
		t.Fatal(err)
	}
	if got := n.latest(t); got.Node.KubeletKey != "" || got.Node.Hostname != "passage-dra-x7k2q" {
		t.Errorf("another boot's generation %d carries the kubelet key %q, hostname %q", got.Generation, got.Node.KubeletKey, got.Node.Hostname)
	}
}
