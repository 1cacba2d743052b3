package boot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
)

// TestBootEraseRecord runs a whole boot under b300's default passage.erase=require with
// a simulated controller behind each NVMe; unit 2's keeps the tenant's data through its
// sanitize. The signed manifest has unit 2 failed with the reason, its erase record
// saying why, none of its functions on vfio-pci; every other unit ready, erased by
// sanitize crypto erase, read back, every function reset.
func TestBootEraseRecord(t *testing.T) {
	bn := newBootNode(t)
	root := bn.node.Root
	ctrls := map[pci.Address]*erasetest.Controller{}
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range tree.Devices {
		dir := filepath.Join(root, pci.DevicesDir, d.Addr.String())
		if err := os.WriteFile(filepath.Join(dir, "reset_method"), []byte("flr bus\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "reset"), nil, 0o200); err != nil {
			t.Fatal(err)
		}
		if d.Class == pcitest.ClassNVMe {
			c := erasetest.New("S"+d.Addr.String(), erase.SANICAPCES|erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 22})
			c.Write(1, 0, bytes.Repeat([]byte{0xa5}, 512))
			ctrls[d.Addr] = c
		}
	}
	victim := bn.node.Addr("nvme2")
	ctrls[victim].Faults.KeepData = true

	b := &Boot{Root: root, Config: initramfs.ParseCmdline(bootCmdline + " passage.net=off"), Sysfs: bn.kern,
		OpenNVMe: func(_ context.Context, a pci.Address) (erase.Controller, string, error) { return ctrls[a], "nvme", nil }}
	if _, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{}); err != nil {
		t.Fatal(err)
	}
	m, err := bn.envelopeOnDisk()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Units) != 8 {
		t.Fatalf("%d units", len(m.Units))
	}
	for _, u := range m.Units {
		e := u.Erase
		if e == nil || e.Policy != "require" || len(e.NVMe) != 1 || len(e.Resets) != len(u.Functions) {
			t.Errorf("%s: erase record %+v", u.ID, e)
			continue
		}
		if u.ID == "gpu2" {
			if u.Status != manifest.StatusFailed || !strings.Contains(strings.Join(u.Reasons, ";"), "data remains") ||
				!strings.Contains(e.NVMe[0].Error, "data remains") {
				t.Errorf("gpu2: %s %v, record error %q: want failed, data remains", u.Status, u.Reasons, e.NVMe[0].Error)
			}
			for _, f := range u.Functions {
				if f.DriverAfter == "vfio-pci" {
					t.Errorf("gpu2 %s on vfio-pci with its NVMe not erased", f.BDF)
				}
			}
			continue
		}
		n := e.NVMe[0]
		if u.Status != manifest.StatusReady || n.Method != string(erase.SanitizeCrypto) || n.SanitizeStatus != "completed" || n.VerifiedLBAs != 64 {
			t.Errorf("%s: %s %v, nvme %+v", u.ID, u.Status, u.Reasons, n)
		}
		for _, r := range e.Resets {
			if r.Result != "done" || r.Methods != "flr bus" {
				t.Errorf("%s: reset %+v", u.ID, r)
			}
		}
		for _, f := range u.Functions {
			if f.DriverAfter != "vfio-pci" {
				t.Errorf("%s %s on %q", u.ID, f.BDF, f.DriverAfter)
			}
		}
	}
}
