package firmware

import (
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// find returns the named function of a spec, for tests that alter the reference tree.
func find(fns []pcitest.Fn, name string) *pcitest.Fn {
	for i := range fns {
		if fns[i].Name == name {
			return &fns[i]
		}
		if f := find(fns[i].Below, name); f != nil {
			return f
		}
	}
	return nil
}

func mustFind(t *testing.T, s pcitest.Spec, name string) *pcitest.Fn {
	t.Helper()
	for i := range s.Hosts {
		if f := find(s.Hosts[i].Fns, name); f != nil {
			return f
		}
	}
	t.Fatalf("no function %s in spec", name)
	return nil
}

// units builds the B300 units by hand (the labeller is another package's): GPU i with
// nic<i>.0, nic<i>.1 and, when the spec has them, dd<i>.
func units(t *testing.T, n *pcitest.Node, tr *pci.Tree, count int) []*topology.Unit {
	t.Helper()
	var out []*topology.Unit
	for i := 0; i < count; i++ {
		get := func(name string) *pci.Device {
			d := tr.Lookup(n.Addr(name))
			if d == nil {
				t.Fatalf("%s not scanned", name)
			}
			return d
		}
		u := &topology.Unit{ID: topology.UnitID(i), GPU: get(fmt.Sprintf("gpu%d", i)), Status: topology.StatusReady}
		for f := 0; f < 2; f++ {
			u.NICs = append(u.NICs, get(fmt.Sprintf("nic%d.%d", i, f)))
		}
		if _, ok := n.Names[fmt.Sprintf("dd%d", i)]; ok {
			u.DataDirect = append(u.DataDirect, get(fmt.Sprintf("dd%d", i)))
		}
		out = append(out, u)
	}
	return out
}

func scan(t *testing.T, s pcitest.Spec) (*pcitest.Node, *pci.Tree) {
	t.Helper()
	n := pcitest.New(t, s)
	tr, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	return n, tr
}

// withDataDirect adds a ConnectX-8 data-direct function (15b3:2100) beside each unit's PFs.
func withDataDirect(t *testing.T, s pcitest.Spec) {
	for i := 0; i < 8; i++ {
		dsp := mustFind(t, s, fmt.Sprintf("cx-dsp-nic%d", i))
		dsp.Below = append(dsp.Below, pcitest.Fn{Name: fmt.Sprintf("dd%d", i), Dev: 0, Func: 2,
			Vendor: pcitest.VendorMellanox, Device: pcitest.DevCX8DD, Class: 0x020000, Port: pci.PortEndpoint,
			Link: pcitest.Link{Speed: pcitest.Gen6, Width: 16}, ATS: &pcitest.ATS{}})
	}
}

func TestCheckATSReference(t *testing.T) {
	s := pcitest.B300()
	withDataDirect(t, s)
	n, tr := scan(t, s)
	us := units(t, n, tr, 8)
	fs := CheckATS(us)
	if len(fs) != 8*3 {
		t.Fatalf("%d findings, want 24 (2 PFs + 1 data-direct per unit)", len(fs))
	}
	for _, f := range fs {
		if !f.ATS || f.Missing() || f.Enable || f.Offset < pci.ConventionalSize || !strings.Contains(f.Note, "IOMMU sets it") {
			t.Errorf("%s: %+v", f.Addr, f)
		}
		// ATS present: no verdict under any policy.
		for _, p := range []Policy{PolicyPrefer, PolicyRequire, ""} {
			if s, why := f.Verdict(p); s != "" || why != "" {
				t.Errorf("%s under %q: %s %q", f.Addr, p, s, why)
			}
		}
	}
	dd := 0
	for _, f := range fs {
		if f.Role == string(topology.RoleDataDirect) && f.IDs == "15b3:2100" {
			dd++
		}
	}
	if dd != 8 {
		t.Errorf("%d data-direct findings, want 8", dd)
	}
	unchanged(t, us)
	if len(NoDT(fs)) != 0 {
		t.Errorf("NoDT = %v on a tree with ATS everywhere", NoDT(fs))
	}
}

// unchanged checks that the units are as units built them: CheckATS only reports.
func unchanged(t *testing.T, us []*topology.Unit) {
	t.Helper()
	for _, u := range us {
		if u.Status != topology.StatusReady || len(u.Reasons) != 0 {
			t.Errorf("unit %d changed: %s %v", u.ID, u.Status, u.Reasons)
		}
	}
}

func TestCheckATSMissing(t *testing.T) {
	// Unit 3 lacks ATS on a PF, unit 5 on its data-direct function.
	s := pcitest.B300()
	withDataDirect(t, s)
	mustFind(t, s, "nic3.1").ATS = nil
	mustFind(t, s, "dd5").ATS = nil
	n, tr := scan(t, s)
	missing := map[int]string{3: "nic3.1", 5: "dd5"}
	us := units(t, n, tr, 8)
	fs := CheckATS(us)
	if len(fs) != 8*3 {
		t.Fatalf("%d findings, want 24", len(fs))
	}
	unchanged(t, us)
	bad := map[int]Finding{}
	for _, f := range fs {
		if f.Missing() != !f.ATS {
			t.Errorf("%s: missing=%v ats=%v", f.Addr, f.Missing(), f.ATS)
		}
		if f.Missing() {
			if _, dup := bad[int(f.Unit)]; dup {
				t.Errorf("unit %d: second missing finding %s", f.Unit, f)
			}
			bad[int(f.Unit)] = f
		}
	}
	if len(bad) != 2 {
		t.Fatalf("missing findings %v, want units 3 and 5", bad)
	}
	for id, name := range missing {
		f := bad[id]
		if f.Addr != n.Addr(name) || f.Enable || f.Offset != 0 || !strings.Contains(f.String(), n.Addr(name).String()) || !strings.Contains(f.String(), "no ATS capability") {
			t.Errorf("unit %d: finding %q does not name %s and what is missing", id, f, name)
		}
	}
	if bad[5].Role != string(topology.RoleDataDirect) || bad[5].IDs != "15b3:2100" || bad[3].Role != string(topology.RoleGPUNIC) || bad[3].IDs != "15b3:1023" {
		t.Errorf("roles: %s, %s", bad[3], bad[5])
	}
	if got := NoDT(fs); len(got) != 2 || !got[3] || !got[5] {
		t.Errorf("NoDT = %v, want units 3 and 5", got)
	}

	// What the findings make of the units depends on the policy alone.
	for _, tc := range []struct {
		policy Policy
		want   topology.Status
		why    string
	}{
		{PolicyPrefer, topology.StatusDegraded, "has no ATS capability: no Direct Translated P2P for this unit"},
		{PolicyRequire, topology.StatusFailed, "has no ATS capability (passage.ats=require)"},
		{"", topology.StatusDegraded, "has no ATS capability: no Direct Translated P2P for this unit"},
	} {
		t.Run(string(tc.policy), func(t *testing.T) {
			got := map[int]topology.Status{}
			for _, f := range fs {
				s, why := f.Verdict(tc.policy)
				if !f.Missing() {
					if s != "" || why != "" {
						t.Errorf("%s has ATS, yet %s %q", f.Addr, s, why)
					}
					continue
				}
				got[int(f.Unit)] = s
				if s != tc.want || !strings.HasPrefix(why, "ats: ") || !strings.Contains(why, f.Addr.String()) ||
					!strings.Contains(why, f.IDs) || !strings.Contains(why, f.Role) || !strings.Contains(why, tc.why) {
					t.Errorf("unit %d: %s %q, want %s, naming %s and %q", f.Unit, s, why, tc.want, f.Addr, tc.why)
				}
			}
			if len(got) != 2 || got[3] != tc.want || got[5] != tc.want {
				t.Errorf("verdicts %v, want units 3 and 5 %s", got, tc.want)
			}
		})
	}
	unchanged(t, us)
}

// The QEMU profile's NIC stand-ins are virtio-net (1af4:1041): which functions need ATS
// follows the unit's membership, not ConnectX IDs.
func TestCheckATSQEMUStandIn(t *testing.T) {
	nic := func(name string, dev uint8, ats *pcitest.ATS) pcitest.Fn {
		return pcitest.Fn{Name: name, Dev: dev, Vendor: 0x1af4, Device: 0x1041, Class: 0x020000, Port: pci.PortEndpoint,
			Link: pcitest.Link{Speed: 1, Width: 1}, ATS: ats}
	}
	port := func(name string, dev uint8, below pcitest.Fn) pcitest.Fn {
		return pcitest.Fn{Name: "rp-" + name, Dev: dev, Vendor: 0x1b36, Device: 0x000c, Class: pcitest.ClassBridge,
			Port: pci.PortRootPort, ACS: &pcitest.ACS{Cap: 0x5f, Ctl: 0x1d}, Below: []pcitest.Fn{below}}
	}
	s := pcitest.Spec{Hosts: []pcitest.Host{{Fns: []pcitest.Fn{
		port("gpu0", 1, pcitest.Fn{Name: "gpu0", Vendor: 0x1b36, Device: 0x0010, Class: pcitest.ClassNVMe, Port: pci.PortEndpoint}),
		port("nic0", 2, nic("nic0", 0, &pcitest.ATS{Enable: true, STU: 0})),
		port("gpu1", 3, pcitest.Fn{Name: "gpu1", Vendor: 0x1b36, Device: 0x0010, Class: pcitest.ClassNVMe, Port: pci.PortEndpoint}),
		port("nic1", 4, nic("nic1", 0, nil)),
	}}}}
	n, tr := scan(t, s)
	us := []*topology.Unit{
		{ID: 0, GPU: tr.Lookup(n.Addr("gpu0")), NICs: []*pci.Device{tr.Lookup(n.Addr("nic0"))}, Status: topology.StatusReady},
		{ID: 1, GPU: tr.Lookup(n.Addr("gpu1")), NICs: []*pci.Device{tr.Lookup(n.Addr("nic1"))}, Status: topology.StatusReady},
	}
	fs := CheckATS(us)
	if len(fs) != 2 {
		t.Fatalf("findings %v", fs)
	}
	if !fs[0].ATS || !fs[0].Enable || fs[0].Note != "" || !strings.Contains(fs[0].String(), "Enable+") {
		t.Errorf("unit 0: %+v", fs[0])
	}
	if fs[1].ATS || fs[1].IDs != "1af4:1041" {
		t.Errorf("unit 1: %+v", fs[1])
	}
	if s, why := fs[0].Verdict(PolicyPrefer); s != "" || why != "" {
		t.Errorf("unit 0 verdict %s %q", s, why)
	}
	if s, why := fs[1].Verdict(PolicyPrefer); s != topology.StatusDegraded || !strings.Contains(why, n.Addr("nic1").String()) || !strings.Contains(why, "1af4:1041") {
		t.Errorf("unit 1 verdict %s %q", s, why)
	}
	if got := NoDT(fs); len(got) != 1 || !got[1] {
		t.Errorf("NoDT = %v, want unit 1", got)
	}
	unchanged(t, us)
}

func TestCheckATSNilSafe(t *testing.T) {
	u := &topology.Unit{ID: 0, NICs: []*pci.Device{nil, {Addr: pci.MustParseAddress("01:00.0"), Config: make(pci.Config, pci.HeaderSize)}}}
	fs := CheckATS([]*topology.Unit{nil, u})
	if len(fs) != 1 || fs[0].ATS || !fs[0].Missing() || !strings.Contains(fs[0].Note, "64 bytes") {
		t.Fatalf("findings %+v", fs)
	}
	// Unknown capabilities count as missing: under require the unit fails.
	if s, why := fs[0].Verdict(PolicyRequire); s != topology.StatusFailed || !strings.Contains(why, "01:00.0") {
		t.Errorf("verdict %s %q", s, why)
	}
	if u.Status != "" || len(u.Reasons) != 0 {
		t.Errorf("unit changed: %s %v", u.Status, u.Reasons)
	}
}

func TestDropDT(t *testing.T) {
	all := pci.ACSSV | pci.ACSTB | pci.ACSRR | pci.ACSCR | pci.ACSUF | pci.ACSDT
	iso := pci.ACSIsolation
	ports := []topology.ACSPort{
		{Unit: 0, Position: "nic-port", Cap: all, Current: iso, Mask: iso | pci.ACSDT, Flags: iso | pci.ACSDT},
		{Unit: 0, Position: "gpu-port", Cap: all, Current: iso, Mask: iso, Flags: iso},
		{Unit: 1, Position: "nic-port", Cap: all, Current: iso, Mask: iso | pci.ACSDT, Flags: iso | pci.ACSDT, Reason: "policy"},
		{Unit: 1, Position: "root-port", Cap: iso, Current: iso, Mask: iso, Flags: iso},
	}
	orig := append([]topology.ACSPort(nil), ports...)
	got := DropDT(ports, []Finding{{Unit: 0, ATS: true}, {Unit: 1, ATS: false}})
	for i := range ports {
		if !reflect.DeepEqual(ports[i], orig[i]) {
			t.Fatalf("input port %d modified", i)
		}
	}
	for i := 0; i < 2; i++ {
		if !reflect.DeepEqual(got[i], ports[i]) {
			t.Errorf("unit 0 port %d changed: %+v", i, got[i])
		}
	}
	if got[2].Flags != iso || got[2].Mask != iso|pci.ACSDT || got[2].Target() != iso || !strings.Contains(got[2].Reason, "policy; DT dropped") {
		t.Errorf("unit 1 nic port: %+v target %s", got[2], got[2].Target())
	}
	// DT was set by someone else on a unit without ATS: the plan clears it.
	p := got[2]
	p.Current = iso | pci.ACSDT
	if p.Target() != iso {
		t.Errorf("target %s from %s", p.Target(), p.Current)
	}
	if !reflect.DeepEqual(got[3], ports[3]) {
		t.Errorf("root port without DT changed: %+v", got[3])
	}
}

func TestParsePolicy(t *testing.T) {
	for in, want := range map[string]Policy{"": PolicyPrefer, "prefer": PolicyPrefer, "require": PolicyRequire} {
		if got, err := ParsePolicy(in); err != nil || got != want {
			t.Errorf("ParsePolicy(%q) = %q, %v", in, got, err)
		}
	}
	if _, err := ParsePolicy("always"); err == nil || !strings.Contains(err.Error(), `"always"`) {
		t.Errorf("ParsePolicy(always) error %v", err)
	}
}
