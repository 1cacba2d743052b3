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
		if u.ID != UnitID(i) {
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

// TestConflictingRules: two rules equally specific that give one function different
// roles make the labelling unusable; the function is unlabeled with both rules named,
// and the labels still come back complete.
func TestConflictingRules(t *testing.T) {
	_, tree := reference(t, "b300")
	for _, c := range []struct{ name, rules string }{
		// The same match twice.
		{"identical", `
  - {name: nvswitch, role: nvswitch-mgmt, match: {vendor: 0x10de, device: 0x22a3}}
  - {name: nvidia-22a3, role: host-other, match: {vendor: 0x10de, device: 0x22a3}}
`},
		// Different conditions, equally many: vendor+device and one constraint each.
		{"equal count", `
  - {name: nvswitch, role: nvswitch-mgmt, match: {vendor: 0x10de, device: 0x22a3, port_type: [endpoint]}}
  - {name: nvidia-22a3, role: host-other, match: {vendor: 0x10de, device: 0x22a3, depth_min: 1}}
`},
	} {
		p, err := ParseProfile("test", []byte("name: clash\nrules:\n  - {name: gpu, role: gpu, match: {vendor: 0x10de, device: 0x3182}}"+c.rules))
		if err != nil {
			t.Fatal(err)
		}
		l, err := Label(tree, p)
		if err == nil || !strings.Contains(err.Error(), `"nvswitch" (nvswitch-mgmt) and "nvidia-22a3" (host-other) both match, equally specific`) {
			t.Errorf("%s: err = %v, want both rules named", c.name, err)
			continue
		}
		if n := strings.Count(err.Error(), "equally specific"); n != 4 {
			t.Errorf("%s: %d conflicts reported, want one per NVSwitch function (4): %v", c.name, n, err)
		}
		if l == nil || len(l.Units) != 8 {
			t.Fatalf("%s: labels not returned complete", c.name)
		}
		for _, d := range tree.Devices {
			fl := l.Of(d.Addr)
			if d.DeviceID == pcitest.DevNVSwitch && (fl.Role != RoleUnlabeled || fl.Rule != "" || !strings.Contains(fl.Reason, "equally specific")) {
				t.Errorf("%s: NVSwitch %s labelled %+v", c.name, d.Addr, fl)
			}
			if d.DeviceID == pcitest.DevB300 && fl.Role != RoleGPU {
				t.Errorf("%s: GPU %s labelled %+v", c.name, d.Addr, fl)
			}
		}
	}
}

// TestRulePrecedence: of the rules that match a function the most specific gives its
// role, whatever their order (vendor+device beats vendor+class beats vendor alone beats
// class alone), among host roles and among passthrough roles; but no precedence lets a
// passthrough rule take a function that another rule keeps for the host: that profile
// contradicts itself and is refused, function by function.
func TestRulePrecedence(t *testing.T) {
	n, tree := reference(t, "b300")
	rules := []string{
		"  - {name: all-nvidia, role: host-other, match: {vendor: 0x10de}}\n",
		"  - {name: nvidia-display, role: gpu, match: {vendor: 0x10de, class: 0x030000, class_mask: 0xff0000}}\n",
		"  - {name: nvswitch, role: nvswitch-mgmt, match: {vendor: 0x10de, device: 0x22a3}}\n",
		"  - {name: any-ethernet, role: mgmt-nic, match: {class: 0x020000}}\n",
		"  - {name: cx8-below-switch, role: gpu-nic, match: {class: 0x020000, below: [{vendor: 0x15b3, device: 0x197c}]}}\n",
		"  - {name: bridges, role: switch-port, match: {bridge: true}}\n",
	}
	for _, reverse := range []bool{false, true} {
		src := "name: ladder\nrules:\n"
		for i := range rules {
			if reverse {
				src += rules[len(rules)-1-i]
			} else {
				src += rules[i]
			}
		}
		p, err := ParseProfile("test", []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		l, err := Label(tree, p)
		// The GPUs (all-nvidia keeps them) and the CX-8 PFs (any-ethernet keeps them) are
		// refused; every other function gets the most specific rule's role.
		if err == nil || !strings.Contains(err.Error(), `rule "nvidia-display" passes it through as gpu, rule "all-nvidia" keeps it for the host as host-other`) ||
			!strings.Contains(err.Error(), `rule "cx8-below-switch" passes it through as gpu-nic, rule "any-ethernet" keeps it for the host as mgmt-nic`) {
			t.Fatalf("reverse %v: %v", reverse, err)
		}
		for name, want := range map[string]FunctionLabel{
			"gpu0":      {Role: RoleUnlabeled},
			"nic3.1":    {Role: RoleUnlabeled},
			"nvswitch2": {Role: RoleNVSwitchMgmt, Rule: "nvswitch"}, // vendor+device over vendor
			"mgmt0":     {Role: RoleMgmtNIC, Rule: "any-ethernet"},
		} {
			if got := l.Of(n.Addr(name)); got.Role != want.Role || got.Rule != want.Rule {
				t.Errorf("reverse %v: %s labelled %+v, want %s by %q", reverse, name, got, want.Role, want.Rule)
			}
		}
		if len(l.Units) != 0 {
			t.Errorf("reverse %v: %d units from a refused labelling", reverse, len(l.Units))
		}
	}
}

// TestB300Specificity holds the embedded b300 profile to the precedence rule on the IDs
// it names under the classes the functions report on other firmware: the device rules
// win over the class-only ones, none of it is a conflict.
func TestB300Specificity(t *testing.T) {
	spec := pcitest.B300()
	// The Broadcom placeholders of units 0-3 report system peripheral, other (the class
	// rule system-peripheral matches them too).
	for i := 1; i <= 4; i++ {
		spec.Hosts[i].Fns[0].Below[0].Below[1].Below[0].Class = 0x088000
	}
	// NVSwitch management functions as bridge, other (as pcitest has them) and as system
	// peripheral, other.
	nvsw := spec.Hosts[len(spec.Hosts)-1].Fns[0].Below[0].Below
	nvsw[1].Below[0].Class, nvsw[3].Below[0].Class = 0x088000, 0x088000
	// Switch management endpoints on root ports of their own, under classes that do
	// and do not have a class rule of their own in the profile.
	mgmtClasses := map[string]uint32{"sw-mgmt-cop": pcitest.ClassHolder, "sw-mgmt-sys": 0x088000,
		"sw-mgmt-net": 0x020000, "sw-mgmt-vga": 0x030000, "sw-mgmt-other": 0xff0000}
	dev := uint8(5)
	for _, name := range []string{"sw-mgmt-cop", "sw-mgmt-sys", "sw-mgmt-net", "sw-mgmt-vga", "sw-mgmt-other"} {
		f := pcitest.MgmtNIC(name, dev, pcitest.VendorBroadcom, pcitest.DevBCMMgmt)
		f.Below[0].Class, f.Below[0].Driver = mgmtClasses[name], ""
		spec.Hosts[0].Fns = append(spec.Hosts[0].Fns, f)
		dev++
	}
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300") // fails the test on any conflict

	for i := 0; i < 8; i++ {
		name := fmt.Sprintf("holder%d", i)
		d := tree.Lookup(n.Addr(name))
		want := uint32(pcitest.ClassHolder)
		if i < 4 {
			want = 0x088000
		}
		if d.Class != want {
			t.Fatalf("test tree wrong: %s class %06x, want %06x", name, d.Class, want)
		}
		if got := l.Of(d.Addr); got.Role != RolePlaceholder || got.Rule != "broadcom-placeholder" || got.Unit != -1 {
			t.Errorf("%s (%s class %06x): %+v", name, d.IDs(), d.Class, got)
		}
	}
	for k := 0; k < 4; k++ {
		name := fmt.Sprintf("nvswitch%d", k)
		d := tree.Lookup(n.Addr(name))
		want := uint32(0x068000)
		if k%2 == 1 {
			want = 0x088000
		}
		if d.Class != want {
			t.Fatalf("test tree wrong: %s class %06x, want %06x", name, d.Class, want)
		}
		if got := l.Of(d.Addr); got.Role != RoleNVSwitchMgmt || got.Rule != "nvswitch-mgmt" {
			t.Errorf("%s (%s class %06x): %+v", name, d.IDs(), d.Class, got)
		}
	}
	for name, class := range mgmtClasses {
		d := tree.Lookup(n.Addr(name))
		if d.Class != class {
			t.Fatalf("test tree wrong: %s class %06x, want %06x", name, d.Class, class)
		}
		if got := l.Of(d.Addr); got.Role != RoleHostOther || got.Rule != "broadcom-switch-mgmt-endpoint" || got.Unit != -1 {
			t.Errorf("%s (%s class %06x): %+v", name, d.IDs(), d.Class, got)
		}
	}
	// The rest of the node is as the reference labels it.
	if len(l.Units) != 8 || l.RoleOf(n.Addr("mgmt0")) != RoleMgmtNIC || len(l.Problems) != 0 {
		t.Errorf("units %d, mgmt0 %s, problems %v", len(l.Units), l.RoleOf(n.Addr("mgmt0")), l.Problems)
	}
}

func TestSpecificity(t *testing.T) {
	hex := func(v uint32) *Hex { h := Hex(v); return &h }
	one := 1
	class := func(c, mask uint32) Match { return Match{Class: hex(c), ClassMask: hex(mask)} }
	vd := Match{Vendor: IDs{0x10de}, Device: IDs{0x22a3}}
	vc := Match{Vendor: IDs{0x10de}, Class: hex(0x030200)}
	v := Match{Vendor: IDs{0x10de}}
	c := Match{Class: hex(0x030200)}
	withBelow := Match{Class: hex(0x020000), Below: []Match{{Vendor: IDs{0x15b3}}}, DepthMin: &one}
	for _, tc := range []struct {
		name string
		a, b Match
		want bool // a beats b
	}{
		{"vendor+device over vendor+class", vd, vc, true},
		{"vendor+class over vendor", vc, v, true},
		{"vendor over class", v, c, true},
		{"vendor+class over class", vc, c, true},
		{"class not over vendor+device", c, vd, false},
		{"constraints over none", withBelow, Match{Class: hex(0x020000)}, true},
		{"constraints do not beat identity", withBelow, v, false},
		{"more class bits", class(0x068000, 0xffffff), class(0x060000, 0xff0000), true},
		{"equal not beaten", vd, Match{Vendor: IDs{0x10de}, Device: IDs{0x22a3, 0x22a4}}, false},
	} {
		if got := tc.a.Specificity().Beats(tc.b.Specificity()); got != tc.want {
			t.Errorf("%s: %+v beats %+v = %v", tc.name, tc.a.Specificity(), tc.b.Specificity(), got)
		}
		if tc.want && tc.b.Specificity().Beats(tc.a.Specificity()) {
			t.Errorf("%s: beaten both ways", tc.name)
		}
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

// TestLabelLeavesNICLessUnitReady: a GPU without a NIC beside it is still a unit, with
// no NICs; labelling reports what it found and gives no verdict (package decision
// degrades such a unit).
func TestLabelLeavesNICLessUnitReady(t *testing.T) {
	spec := pcitest.B300()
	spec.Hosts[6].Fns[0].Below[0].Below[0].Below[0].Below[0].Below = nil // unit 5's CX-8 PFs
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300")
	u := l.Unit(5)
	if u == nil || u.GPU.Addr != n.Addr("gpu5") || len(u.NICs) != 0 || len(u.NVMe) != 1 {
		t.Fatalf("unit 5: %+v", u)
	}
	if u.Status != StatusReady || len(u.Reasons) != 0 {
		t.Errorf("unit 5: %s %v", u.Status, u.Reasons)
	}
}
