package topology

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// The reference trees take seconds to write; the tests only read them, so each is built
// once per test binary (cached by name) and scanned afresh by each test.
var (
	refMu    sync.Mutex
	refTrees = map[string]*pcitest.Node{}
	refDir   string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if refDir != "" {
		os.RemoveAll(refDir)
	}
	os.Exit(code)
}

func reference(t *testing.T, name string) (*pcitest.Node, *pci.Tree) {
	t.Helper()
	refMu.Lock()
	n := refTrees[name]
	if n == nil {
		var err error
		if refDir == "" {
			if refDir, err = os.MkdirTemp("", "topology-ref"); err != nil {
				refMu.Unlock()
				t.Fatal(err)
			}
		}
		spec := map[string]func() pcitest.Spec{"b300": pcitest.B300, "b200": pcitest.B200, "qemu": qemuSpec}[name]
		n, err = pcitest.Build(filepath.Join(refDir, name), spec())
		if err != nil {
			refMu.Unlock()
			t.Fatal(err)
		}
		refTrees[name] = n
	}
	refMu.Unlock()
	return n, scanRoot(t, n.Root)
}

func scan(t *testing.T, spec pcitest.Spec) (*pcitest.Node, *pci.Tree) {
	t.Helper()
	n := pcitest.New(t, spec)
	return n, scanRoot(t, n.Root)
}

func scanRoot(t *testing.T, root string) *pci.Tree {
	t.Helper()
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := tree.Err(); err != nil {
		t.Fatalf("scan problems: %v", err)
	}
	return tree
}

func mustLabel(t *testing.T, tree *pci.Tree, profile string) *Labels {
	t.Helper()
	p, err := Builtin(profile)
	if err != nil {
		t.Fatal(err)
	}
	l, err := Label(tree, p)
	if err != nil {
		t.Fatalf("label: %v", err)
	}
	return l
}

func TestLabelB300(t *testing.T) {
	n, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	if len(l.Units) != 8 {
		t.Fatalf("units = %d, want 8", len(l.Units))
	}
	for i, u := range l.Units {
		if u.ID != i {
			t.Errorf("unit %d has ID %d", i, u.ID)
		}
		if u.GPU.Addr != n.Addr(fmt.Sprintf("gpu%d", i)) {
			t.Errorf("unit %d GPU = %s, want gpu%d at %s", i, u.GPU.Addr, i, n.Addr(fmt.Sprintf("gpu%d", i)))
		}
		if len(u.NICs) != 2 || u.NICs[0].Addr != n.Addr(fmt.Sprintf("nic%d.0", i)) || u.NICs[1].Addr != n.Addr(fmt.Sprintf("nic%d.1", i)) {
			t.Errorf("unit %d NICs = %v", i, u.NICs)
		}
		if len(u.NVMe) != 1 || u.NVMe[0].Addr != n.Addr(fmt.Sprintf("nvme%d", i)) {
			t.Errorf("unit %d NVMe = %v", i, u.NVMe)
		}
		if want := i / 4; u.NUMANode != want {
			t.Errorf("unit %d NUMA = %d, want %d", i, u.NUMANode, want)
		}
		if u.Status != StatusReady {
			t.Errorf("unit %d status %s %v", i, u.Status, u.Reasons)
		}
		// root port, Broadcom USP, virtual port, CX USP, NIC DSP, GPU DSP, nested USP,
		// nested DSP, NVMe DSP.
		if len(u.Bridges) != 9 {
			t.Errorf("unit %d bridges = %d %v, want 9", i, len(u.Bridges), u.Bridges)
		}
	}
	counts := map[Role]int{}
	for _, d := range tree.Devices {
		counts[l.RoleOf(d.Addr)]++
	}
	want := map[Role]int{RoleGPU: 8, RoleGPUNIC: 16, RoleGPUNVMe: 8, RoleMgmtNIC: 2, RoleNVSwitchMgmt: 4, RolePlaceholder: 8}
	for r, c := range want {
		if counts[r] != c {
			t.Errorf("%s: %d functions, want %d", r, counts[r], c)
		}
	}
	if counts[RoleUnlabeled] != 0 {
		t.Errorf("%d unlabeled", counts[RoleUnlabeled])
	}
	for _, name := range []string{"mgmt0", "mgmt1", "nvswitch0", "nvswitch3", "holder0"} {
		if u, ok := l.UnitOf(n.Addr(name)); ok {
			t.Errorf("%s is in unit %d; it stays on the host", name, u)
		}
	}
	if len(l.Problems) != 0 {
		t.Errorf("problems: %v", l.Problems)
	}
}

// TestSameIDTwoRoles puts a ConnectX-8 (the same 15b3:1023 as the GPU-adjacent PFs) on a
// root port of its own: it must come out mgmt-nic, the ones in the GPU switches gpu-nic.
func TestSameIDTwoRoles(t *testing.T) {
	spec := pcitest.B300()
	spec.Hosts[0].Fns = append(spec.Hosts[0].Fns, pcitest.MgmtNIC("cxmgmt", 5, pcitest.VendorMellanox, pcitest.DevCX8))
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300")
	mg, gn := tree.Lookup(n.Addr("cxmgmt")), tree.Lookup(n.Addr("nic3.1"))
	if mg.IDs() != gn.IDs() {
		t.Fatalf("test tree wrong: %s vs %s", mg.IDs(), gn.IDs())
	}
	if got := l.Of(mg.Addr); got.Role != RoleMgmtNIC || got.Rule != "mgmt-nic" {
		t.Errorf("management CX-8: %+v", got)
	}
	if got := l.Of(gn.Addr); got.Role != RoleGPUNIC || got.Unit != 3 {
		t.Errorf("GPU CX-8: %+v", got)
	}
	if _, ok := l.UnitOf(mg.Addr); ok {
		t.Errorf("management CX-8 is in a unit")
	}
}

func TestConflictingRules(t *testing.T) {
	_, tree := reference(t, "b300")
	p, err := ParseProfile("test", []byte(`
name: clash
rules:
  - {name: all-nvidia-gpu, role: gpu, match: {vendor: 0x10de}}
  - {name: nvswitch, role: nvswitch-mgmt, match: {vendor: 0x10de, device: 0x22a3}}
`))
	if err != nil {
		t.Fatal(err)
	}
	l, err := Label(tree, p)
	if err == nil || !strings.Contains(err.Error(), `"all-nvidia-gpu" (gpu) and "nvswitch" (nvswitch-mgmt)`) {
		t.Fatalf("err = %v, want both rules named", err)
	}
	if l == nil || len(l.Units) != 8 {
		t.Fatalf("labels not returned complete")
	}
}

func TestUnlabeled(t *testing.T) {
	_, tree := reference(t, "b300")
	src := "name: partial\nrules:\n  - {name: gpu, role: gpu, match: {vendor: 0x10de, class: 0x030200}}\n"
	p, err := ParseProfile("test", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	l, err := Label(tree, p)
	if err != nil {
		t.Fatalf("unlabeled allowed, got %v", err)
	}
	nic := l.Units[0].GPU.Parent // a bridge: no rule
	if fl := l.Of(nic.Addr); fl.Role != RoleUnlabeled || !strings.Contains(fl.Reason, "no rule of profile partial") {
		t.Errorf("bridge label %+v", fl)
	}
	p, _ = ParseProfile("test", []byte(src+"unlabeled_is_error: true\n"))
	if _, err := Label(tree, p); err == nil || !strings.Contains(err.Error(), "no rule of profile partial matches") {
		t.Errorf("unlabeled_is_error: err = %v", err)
	}
}

// ConnectX VFs are network-class functions outside any GPU switch, like a management
// NIC: the mgmt-nic rule must not claim them too (that would be a rule conflict).
func TestConnectXVFsNotManagementNICs(t *testing.T) {
	for _, prof := range []string{"b300", "b200"} {
		n, tree := scan(t, pcitest.SRIOVNode(2, 3, 2))
		l := mustLabel(t, tree, prof)
		vfs := 0
		for _, d := range tree.Devices {
			if d.DeviceID == pcitest.DevCX8VF {
				vfs++
				if got := l.Of(d.Addr); got.Role != RoleHostOther || got.Rule != "connectx-vf" {
					t.Errorf("%s: VF %s labelled %+v", prof, d.Addr, got)
				}
			}
		}
		if vfs != 10 {
			t.Fatalf("%s: %d VFs in the tree, want 10", prof, vfs)
		}
		if got := l.Of(n.Addr("nic0.0")); got.Role != RoleMgmtNIC {
			t.Errorf("%s: PF on its own root port labelled %+v", prof, got)
		}
	}
}
