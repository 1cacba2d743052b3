package simnode_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/kube/internal/simnode"
	"github.com/passage-boot/passage/pci"
)

// TestSharedAcrossOpens: what a tenant wrote is on the device every open sees; the
// erase (a Format NVM, verified by erase's own read-back) removes it for the next open
// too; a fault and a latency reach the next open.
func TestSharedAcrossOpens(t *testing.T) {
	root := t.TempDir()
	a, _ := pci.ParseAddress("0000:1b:00.0")
	ctx := context.Background()
	data := bytes.Repeat([]byte("TENANT-A-SECRET!"), simnode.BlockSize/16)
	for _, lba := range []uint64{0, 1<<16 - 1} {
		if err := simnode.Write(root, a, lba, data); err != nil {
			t.Fatal(err)
		}
	}
	if err := simnode.Write(root, a, 1<<16, data); err == nil {
		t.Error("a block past the namespace was written")
	}
	if b, err := simnode.Read(ctx, root, a, 1<<16-1); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("read back before the erase: %v %q", err, b[:16])
	}
	open := simnode.Opener(root)
	c, _, err := open(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	r := erase.Erase(ctx, c, erase.Options{Samples: 8})
	c.Close()
	if !r.Erased() || r.Method != erase.FormatUserData {
		t.Fatalf("erase: method %q err %q, want %s", r.Method, r.Err, erase.FormatUserData)
	}
	for _, lba := range []uint64{0, 1<<16 - 1} {
		b, err := simnode.Read(ctx, root, a, lba)
		if err != nil || bytes.Contains(b, []byte("TENANT")) {
			t.Fatalf("block %d after the erase, opened again: %v %q", lba, err, b[:16])
		}
	}
	if err := simnode.SetFault(root, a, true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := open(ctx, a); err == nil || !strings.Contains(err.Error(), "does not answer") {
		t.Fatalf("open with the fault: %v", err)
	}
	simnode.SetFault(root, a, false)
	if err := simnode.SetLatency(root, a, 30*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	c, _, err = open(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c.Admin(ctx, erase.Command{Opcode: erase.OpIdentify, CDW10: erase.CNSController}, make([]byte, erase.IdentifySize))
	if d := time.Since(start); d < 30*time.Millisecond {
		t.Errorf("an admin command with latency 30ms took %v", d)
	}
	os.WriteFile(filepath.Join(root, simnode.Dir, "nvme", a.String(), "latency"), []byte("soon"), 0o644)
	if _, _, err := open(ctx, a); err == nil || !strings.Contains(err.Error(), "latency") {
		t.Errorf("open with a latency file that is no duration: %v", err)
	}
}
