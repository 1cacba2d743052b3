package pcitest

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
)

func TestVPDBytesParse(t *testing.T) {
	in := &pci.VPD{Name: "NVIDIA ConnectX-8", Keywords: map[string]string{"PN": "900-9X81E", "SN": "MT1", "V3": "abc"}}
	b := VPDBytes(in)
	v, err := pci.ParseVPD(b)
	if err != nil || v.Name != in.Name || v.PN() != "900-9X81E" || v.SN() != "MT1" || v.V3() != "abc" {
		t.Fatalf("%+v %v", v, err)
	}
	// RV makes the bytes up to and including it sum to zero (PCI 3.0 I.3.1.1).
	var sum byte
	for _, x := range b[:len(b)-1] {
		sum += x
	}
	if sum != 0 {
		t.Errorf("checksum leaves %#x", sum)
	}
}

// TestGroups checks the kernel's grouping rules on a small node: isolation below ports
// with ACS, one group for a subtree below a port without it, and one group for the
// functions of a multi-function device without ACS.
func TestGroups(t *testing.T) {
	ep := func(name string, dev, fn uint8) Fn {
		return Fn{Name: name, Dev: dev, Func: fn, Vendor: VendorMellanox, Device: DevCX8, Class: ClassEthernet, Port: pci.PortEndpoint}
	}
	spec := Spec{Hosts: []Host{{Fns: []Fn{
		{Name: "rp-acs", Dev: 1, Class: ClassBridge, Port: pci.PortRootPort, ACS: rootACS, Below: []Fn{{
			Name: "usp", Class: ClassBridge, Port: pci.PortUpstream, Below: []Fn{
				{Name: "dsp-acs", Dev: 0, Class: ClassBridge, Port: pci.PortDownstream, ACS: rootACS, Below: []Fn{ep("a", 0, 0)}},
				{Name: "dsp-none", Dev: 1, Class: ClassBridge, Port: pci.PortDownstream, Below: []Fn{ep("b", 0, 0)}},
				{Name: "dsp-mf", Dev: 2, Class: ClassBridge, Port: pci.PortDownstream, ACS: rootACS, Below: []Fn{ep("pf0", 0, 0), ep("pf1", 0, 1)}},
			}}}},
		{Name: "rp-none", Dev: 2, Class: ClassBridge, Port: pci.PortRootPort, Below: []Fn{ep("c", 0, 0)}},
	}}}}
	n := New(t, spec)
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	g := func(name string) int { return tree.Lookup(n.Addr(name)).IOMMUGroup }
	if g("a") == g("dsp-acs") || g("a") == g("b") {
		t.Errorf("a not isolated: a %d dsp %d b %d", g("a"), g("dsp-acs"), g("b"))
	}
	if g("b") != g("dsp-none") {
		t.Errorf("b %d should share dsp-none's group %d (no ACS on its port)", g("b"), g("dsp-none"))
	}
	if g("pf0") != g("pf1") || g("pf0") == g("dsp-mf") {
		t.Errorf("pf0 %d pf1 %d dsp-mf %d: want the two functions together, apart from the port", g("pf0"), g("pf1"), g("dsp-mf"))
	}
	if g("c") != g("rp-none") {
		t.Errorf("c %d should share rp-none's group %d", g("c"), g("rp-none"))
	}
	// The group's devices directory lists exactly the group's functions.
	for id, devs := range tree.Groups() {
		ents, err := os.ReadDir(filepath.Join(n.Root, "sys/kernel/iommu_groups", strconv.Itoa(id), "devices"))
		if err != nil || len(ents) != len(devs) {
			t.Errorf("group %d: %d entries (%v), %d functions", id, len(ents), err, len(devs))
		}
	}
	noIOMMU := New(t, Spec{Hosts: spec.Hosts, NoIOMMU: true})
	tree, _ = pci.Scan(noIOMMU.Root)
	if len(tree.Groups()) != 0 {
		t.Error("groups without an IOMMU")
	}
}

func TestBuildErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec Spec
		want string
	}{
		{"device 32", Spec{Hosts: []Host{{Fns: []Fn{{Dev: 32}}}}}, "bad device 32"},
		{"name twice", Spec{Hosts: []Host{{Fns: []Fn{{Name: "x", Dev: 1}, {Name: "x", Dev: 2}}}}}, `name "x" used twice`},
		{"endpoint with children", Spec{Hosts: []Host{{Fns: []Fn{{Dev: 1, Below: []Fn{{}}}}}}}, "has functions below but is not a bridge"},
		{"VFs past bus 255", Spec{Hosts: []Host{{Bus: 0xff, Fns: []Fn{{SRIOV: &SRIOV{Total: 300, Num: 300}}}}}}, "run past bus 255"},
		{"more VFs than total", Spec{Hosts: []Host{{Fns: []Fn{{SRIOV: &SRIOV{Total: 1, Num: 2}}}}}}, "2 VFs of 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Build(t.TempDir(), tc.spec)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %v, want %q", err, tc.want)
			}
		})
	}
}
