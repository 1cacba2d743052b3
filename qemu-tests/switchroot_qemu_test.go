//go:build qemu

package qemutest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// Scenario 7: the switch_root handoff. passage runs as the initramfs's init (rdinit=),
// so it is PID 1 and can hand PID 1 to the real root's init: a disk whose /sbin/init
// prints what it sees and powers off.
func TestScenario7SwitchRoot(t *testing.T) {
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	for _, d := range []string{"sbin", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	build := exec.Command("go", "build", "-o", filepath.Join(root, "sbin", "init"), "./internal/rootinit")
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build rootinit: %v\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "passage-root"), []byte("disk"), 0o644); err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(dir, "root.img")
	if err := NewDisk(disk, 64); err != nil {
		t.Fatal(err)
	}
	// Refill the fresh filesystem with the root tree (mkfs.ext4 -d, nothing mounted).
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-L", "root", "-d", root, disk).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 -d: %v\n%s", err, out)
	}

	run, m := bootPassage(t, Options{Disk: disk, Append: []string{
		"rdinit=/bbin/passage",
		"passage.handoff=switch_root", "passage.root=/dev/vda", "passage.rootfstype=ext4",
		"passage.host_modules=e1000e,virtio_pci,virtio_blk,crc32c_generic,ext4",
	}})
	if run.Done != "ok" {
		t.Errorf("PASSAGE-DONE %s, want ok", run.Done)
	}
	for _, u := range m.Units {
		checkBound(t, &u)
	}
	con, err := os.ReadFile(run.Console)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(con), "PASSAGE-ROOT-INIT pid=1 root=disk") {
		t.Errorf("the real root's init did not run as PID 1 on the disk; console end:\n%s", consoleTail(run.Console, 40))
	}
}
