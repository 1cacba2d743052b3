package topology

import (
	"fmt"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

func TestBuiltinsParse(t *testing.T) {
	names := Builtins()
	if strings.Join(names, ",") != "b200,b300,qemu,qemu-guest" {
		t.Errorf("builtins %v", names)
	}
	for _, n := range names {
		p, err := Builtin(n)
		if err != nil {
			t.Fatal(err)
		}
		if p.Name != n {
			t.Errorf("%s: name %q", n, p.Name)
		}
	}
	if p, _ := Builtin("b300"); p.NVLinks != 18 {
		t.Errorf("b300 nvlinks %d", p.NVLinks)
	}
}

func TestProfileErrors(t *testing.T) {
	for _, c := range []struct{ src, want string }{
		{"rules: [{name: a, role: gpu, match: {}}]", "no name"},
		{"name: x\nrules: []", "no rules"},
		{"name: x\nrules: [{name: a, role: gpuu, match: {}}]", `unknown role "gpuu"`},
		{"name: x\nrules: [{name: a, role: gpu, match: {vendor: zz}}]", `"zz" is not a hex number`},
		{"name: x\nrules: [{name: a, role: gpu, match: {vendor: 0x12345}}]", "wider than 16 bits"},
		{"name: x\nrules: [{name: a, role: gpu, match: {vendr: 0x10de}}]", "field vendr not found"},
		{"name: x\nrules: [{name: a, role: gpu, match: {port_type: [sideways]}}]", `unknown port_type "sideways"`},
		{"name: x\nrules: [{name: a, role: gpu, match: {below: [{port_type: [sideways]}]}}]", `unknown port_type "sideways"`},
		{"name: x\nrules: [{name: a, role: gpu, match: {}}, {name: a, role: gpu, match: {}}]", `rule "a": name used twice`},
		{"name: x\nrules: [{name: a, role: gpu, match: {class_mask: 0xff0000}}]", "class_mask without class"},
		{"name: x\nslots: {\"00:01.0\": 1, \"00:02.0\": 1}\nrules: [{name: a, role: gpu, match: {}}]", "unit 1 given to both"},
		{"name: x\nslots: {\"zz\": 1}\nrules: [{name: a, role: gpu, match: {}}]", "pci address"},
		{"{\"name\": \"x\", \"rules\": [{\"name\": \"a\", \"role\": \"gpu\", \"match\": {\"vendor\": [1, {}]}}]}", "hex number"},
	} {
		_, err := ParseProfile("op.yaml", []byte(c.src))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "profile op.yaml") {
			t.Errorf("%q: err = %v, want %q", c.src, err, c.want)
		}
	}
}

func TestMatchIDsJSONAndYAML(t *testing.T) {
	d := &pci.Device{VendorID: 0x10de, DeviceID: 0x2901, Class: 0x030200}
	for _, src := range []string{
		`name: y
rules: [{name: a, role: gpu, match: {vendor: 0x10de, device: [0x3182, 0x2901], class: 030200}}]`,
		`{"name": "j", "rules": [{"name": "a", "role": "gpu", "match": {"vendor": "10de", "device": ["3182", "0x2901"], "class": "030200"}}]}`,
	} {
		p, err := ParseProfile("t", []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		if !p.Rules[0].Match.Matches(d) {
			t.Errorf("%s: does not match 10de:2901", p.Name)
		}
		d2 := *d
		d2.DeviceID = 0x2335
		if p.Rules[0].Match.Matches(&d2) {
			t.Errorf("%s: matches 10de:2335", p.Name)
		}
	}
}

// TestSlotMap numbers units by root port instead of GPU address.
func TestSlotMap(t *testing.T) {
	n, tree := reference(t, "b300")
	p, _ := Builtin("b300")
	p.Slots = map[string]int{n.Addr("rp0").String(): 7, n.Addr("gpu7").String(): 0, "0000:ff:1f.7": 3}
	if err := p.check(); err != nil {
		t.Fatal(err)
	}
	l, err := Label(tree, p)
	if err != nil {
		t.Fatal(err)
	}
	if u := l.Unit(7); u == nil || u.GPU.Addr != n.Addr("gpu0") {
		t.Errorf("unit 7 = %v, want gpu0", u)
	}
	if u := l.Unit(0); u == nil || u.GPU.Addr != n.Addr("gpu7") {
		t.Errorf("unit 0 = %v, want gpu7", u)
	}
	// The rest take the free IDs by the position of their root ports (slot-map IDs stay reserved).
	if u := l.Unit(1); u == nil || u.GPU.Addr != n.Addr("gpu1") {
		t.Errorf("unit 1 = %v", u)
	}
	if !strings.Contains(strings.Join(l.Problems, ";"), "0000:ff:1f.7 hold no GPU") {
		t.Errorf("problems %v", l.Problems)
	}
}

// TestDataDirect adds a ConnectX-8 data-direct function (15b3:2100) on a third port of
// each CX-8 switch: it joins the unit of the PF whose VPD V3 it carries.
func TestDataDirect(t *testing.T) {
	spec := pcitest.B300()
	for i := 0; i < 2; i++ {
		cxUSP := &spec.Hosts[1+i].Fns[0].Below[0].Below[0].Below[0]
		v3 := fmt.Sprintf("c8a1b2c3d4e5f6%02d", i)
		if i == 1 {
			v3 = "not-a-pf" // pairs with nothing
		}
		cxUSP.Below = append(cxUSP.Below, pcitest.Fn{Name: fmt.Sprintf("dd-dsp%d", i), Dev: 1, Vendor: pcitest.VendorMellanox,
			Device: pcitest.DevCX8Bridge, Class: pcitest.ClassBridge, Port: pci.PortDownstream,
			ACS: &pcitest.ACS{Cap: 0x5f, Ctl: 0x1d}, Below: []pcitest.Fn{{Name: fmt.Sprintf("dd%d", i),
				Vendor: pcitest.VendorMellanox, Device: pcitest.DevCX8DD, SubVendor: pcitest.VendorMellanox, Class: pcitest.ClassEthernet,
				Port: pci.PortEndpoint, ATS: &pcitest.ATS{}, VPD: &pci.VPD{Name: "CX-8 data direct", Keywords: map[string]string{"V3": v3}}}}})
	}
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300")
	if r := l.RoleOf(n.Addr("dd0")); r != RoleDataDirect {
		t.Fatalf("dd0 role %s", r)
	}
	u0 := l.Unit(0)
	if len(u0.DataDirect) != 1 || u0.DataDirect[0].Addr != n.Addr("dd0") {
		t.Errorf("unit 0 data-direct %v", u0.DataDirect)
	}
	if _, ok := l.UnitOf(n.Addr("dd1")); ok {
		t.Errorf("dd1 with an unknown V3 joined a unit")
	}
	if !strings.Contains(strings.Join(l.Problems, ";"), `no NIC PF carries VPD V3 "not-a-pf"`) {
		t.Errorf("problems %v", l.Problems)
	}
	// The data-direct port is a NIC-side port: DT there too.
	for _, p := range ACSPlan(l.Units) {
		if p.Addr == n.Addr("dd-dsp0") && (p.Position != PosNICPort || p.Flags&pci.ACSDT == 0) {
			t.Errorf("data-direct port %+v", p)
		}
	}
	g, err := GuestPlan(l.Units, GuestOptions{Units: []UnitID{0}})
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Units[0].Functions) != 5 || g.Units[0].Functions[3].Role != RoleDataDirect {
		t.Errorf("guest unit 0 functions %+v", g.Units[0].Functions)
	}
}

func FuzzParseProfile(f *testing.F) {
	for _, n := range Builtins() {
		b, _ := builtin.ReadFile("profiles/" + n + ".yaml")
		f.Add(b)
	}
	f.Add([]byte(`{"name":"j","rules":[{"name":"a","role":"gpu","match":{"not":{"not":{"vendor":"10de"}}}}]}`))
	d := &pci.Device{VendorID: 0x10de, DeviceID: 0x3182, Class: 0x030200, Parent: &pci.Device{HeaderType: 1},
		VPD: &pci.VPD{Keywords: map[string]string{"VA": pcitest.SWMngVA, "PN": "900-2G133"}}}
	d.Parent.Children = []*pci.Device{d}
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := ParseProfile("fuzz", b)
		if err != nil {
			return
		}
		for i := range p.Rules {
			p.Rules[i].Match.Matches(d)
		}
	})
}
