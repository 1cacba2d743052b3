//go:build qemu

package qemutest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A tenant wrote the host root's filesystem UUID and label onto its passthrough NVMe,
// with an init of its own, and its unit fails (its CX-8 PF1 without ATS under
// passage.ats=require), so nothing erases or binds its NVMe. The erase stage and the
// host stage both load nvme. The boot must switch to the real root (a host NVMe on the
// root complex), never the tenant's: no unit's NVMe is left on nvme, and a block device
// below a unit's function is no root candidate.
func TestTenantDiskNeverRoot(t *testing.T) {
	dir := t.TempDir()
	build := func(root, marker string) {
		for _, d := range []string{"sbin", "etc"} {
			if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		cmd := exec.Command("go", "build", "-o", filepath.Join(root, "sbin", "init"), "./internal/rootinit")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build rootinit: %v\n%s", err, out)
		}
		if err := os.WriteFile(filepath.Join(root, "etc", "passage-root"), []byte(marker), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	realRoot, tenantRoot := filepath.Join(dir, "root"), filepath.Join(dir, "tenant")
	build(realRoot, "disk")
	build(tenantRoot, "tenant")
	disk := filepath.Join(dir, "root.img")
	if err := NewGPTDisk(disk, 64, rootPartUUID, rootFSUUID, rootLabel, realRoot); err != nil {
		t.Fatal(err)
	}
	tenant := filepath.Join(dir, "tenant.img")
	if err := NewGPTDisk(tenant, 64, "7e6d5c4b-3a29-4817-a6f5-e4d3c2b1a090", rootFSUUID, rootLabel, tenantRoot); err != nil {
		t.Fatal(err)
	}
	unit0 := filepath.Join(dir, "unit0.img")
	markedImage(t, unit0, 16, tenantMarker)

	run, m := bootPassage(t, Options{Topology: Topology{ATSOff: true, NVMeImages: []string{unit0, tenant}}, NVMe: []string{disk},
		Append: []string{
			"rdinit=/bbin/passage", "passage.ats=require", "passage.erase=require", "passage.net=off",
			"passage.handoff=switch_root", "passage.root=UUID=" + rootFSUUID, "passage.rootfstype=ext4",
			"passage.host_modules=e1000e,nvme,crc32c_generic,ext4",
		}})
	con, err := os.ReadFile(run.Console)
	if err != nil {
		t.Fatal(err)
	}
	c := string(con)
	if strings.Contains(c, "PASSAGE-ROOT-INIT pid=1 root=tenant") {
		t.Fatalf("the tenant's disk became the root; console end:\n%s", consoleTail(run.Console, 40))
	}
	if !strings.Contains(c, "PASSAGE-ROOT-INIT pid=1 root=disk") {
		t.Errorf("the real root's init did not run; console end:\n%s", consoleTail(run.Console, 40))
	}
	unitFn := map[string]bool{}
	for _, u := range m.Units {
		if u.ID == "gpu1" && u.Status != "failed" {
			t.Errorf("gpu1 %s, want failed (no ATS under require): the scenario is not testing an unerased unit", u.Status)
		}
		for _, f := range u.Functions {
			unitFn[f.BDF] = true
		}
	}
	for _, f := range readbackOf(t, run).Functions {
		if unitFn[f.BDF] && f.Driver == "nvme" {
			t.Errorf("unit function %s on nvme at the handoff", f.BDF)
		}
	}
}
