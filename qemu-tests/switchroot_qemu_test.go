//go:build qemu

package qemutest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The root disk's identities, and a scratch disk's: both host NVMe, both ext4.
const (
	rootPartUUID = "5f3c2a1e-8b7d-4c6e-9a0f-1d2e3f405162"
	rootFSUUID   = "0b9e7c61-2f4a-4d3b-8e5c-6a7b8c9d0e1f"
	rootLabel    = "passage-root"
)

// Scenario 7: the switch_root handoff. passage runs as the initramfs's init (rdinit=),
// so it is PID 1 and can hand PID 1 to the real root's init: a disk whose /sbin/init
// prints what it sees and powers off. The node has four NVMe: the two units'
// (passthrough, bound to vfio-pci), a scratch disk and the root disk (00:11.0 and
// 00:12.0, in either order), and passage.root names the root by identity: by filesystem
// UUID, and by label.
func TestScenario7SwitchRoot(t *testing.T) {
	dir := t.TempDir()
	disk := newRootDisk(t)
	scratch := filepath.Join(dir, "scratch.img")
	if err := NewGPTDisk(scratch, 16, "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d", "11111111-2222-4333-8444-555555555555", "scratch", ""); err != nil {
		t.Fatal(err)
	}

	// Which controller the kernel probes first, and so names nvme0, is not fixed (6.1
	// took 00:11.0 first; 6.12 takes either, boot to boot): the root disk has another
	// identity than the scratch disk beside it, sits behind each controller in turn, and
	// the boot must find it whatever its name. rootdev's own tests hold, deterministically,
	// that the identity and not the name decides; here the names are only logged.
	for _, c := range []struct {
		name, spec string
		nvme       []string
	}{
		{"UUID", "UUID=" + rootFSUUID, []string{scratch, disk}},
		{"LABEL", "LABEL=" + rootLabel, []string{disk, scratch}},
	} {
		spec := c.spec
		t.Run(c.name, func(t *testing.T) {
			run, m := bootPassage(t, Options{NVMe: c.nvme, Append: []string{
				"rdinit=/bbin/passage",
				"passage.handoff=switch_root", "passage.root=" + spec, "passage.rootfstype=ext4",
				"passage.host_modules=e1000e,nvme,crc32c_generic,ext4",
			}})
			if run.Done != "ok" {
				t.Errorf("PASSAGE-DONE %s, want ok", run.Done)
			}
			if len(m.Units) != 2 {
				t.Errorf("%d units, want 2 (the host NVMe are no unit's)", len(m.Units))
			}
			for _, u := range m.Units {
				checkBound(t, &u)
			}
			con, err := os.ReadFile(run.Console)
			if err != nil {
				t.Fatal(err)
			}
			c := string(con)
			if i := strings.Index(c, "passage: root "+spec+" is /dev/"); i >= 0 {
				t.Logf("%s", strings.SplitN(c[i:], "\n", 2)[0])
			} else {
				t.Errorf("no line resolving %s to a device; console end:\n%s", spec, consoleTail(run.Console, 40))
			}
			if !strings.Contains(c, "PASSAGE-ROOT-INIT pid=1 root=disk") {
				t.Errorf("the real root's init did not run as PID 1 on the disk; console end:\n%s", consoleTail(run.Console, 40))
			}
		})
	}
}
