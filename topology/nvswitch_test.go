package topology

import (
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// TestVPDMatch: vpd holds on the exact value (equals) or on one whole colon-separated
// field of the keyword's value (field), and never without VPD.
func TestVPDMatch(t *testing.T) {
	va := func(v string) *pci.VPD { return &pci.VPD{Keywords: map[string]string{"VA": v, "SN": "SMDL=SW_MNG"}} }
	field := &VPDMatch{Keyword: "VA", Field: "SMDL=SW_MNG"}
	for _, c := range []struct {
		m    *VPDMatch
		vpd  *pci.VPD
		want bool
	}{
		{field, va(pcitest.SWMngVA), true},
		{field, va("MLX:SMDL=SW_MNG"), true},
		{field, va("SMDL=SW_MNG"), true},
		{field, va("MLX:SMDL=SW_MNG_OTHER"), false},
		{field, va("MLX:OTHER_SMDL=SW_MNG"), false},
		{field, va("MLX:MN=MLNX:MODL=CX713106A"), false},
		{field, &pci.VPD{Keywords: map[string]string{"V3": "SMDL=SW_MNG"}}, false}, // another keyword
		{field, &pci.VPD{}, false},
		{field, nil, false}, // unreadable or absent
		{&VPDMatch{Keyword: "SN", Equals: "SMDL=SW_MNG"}, va(""), true},
		{&VPDMatch{Keyword: "SN", Equals: "SMDL=SW_MN"}, va(""), false},
	} {
		if got := c.m.matches(c.vpd); got != c.want {
			t.Errorf("%+v on %+v: %v, want %v", c.m, c.vpd, got, c.want)
		}
	}
	for _, c := range []struct{ m, want string }{
		{`{keyword: V}`, `vpd: keyword "V": want two letters or digits`},
		{`{keyword: va, field: X}`, `vpd: keyword "va"`},
		{`{keyword: VA}`, "vpd VA: give exactly one of equals and field"},
		{`{keyword: VA, field: X, equals: Y}`, "vpd VA: give exactly one of equals and field"},
		{`{keyword: VA, field: "A:B"}`, `field "A:B" holds a colon`},
		{`{keyword: VA, contains: X}`, "field contains not found"},
	} {
		src := "name: x\nrules: [{name: a, role: nvswitch-mgmt, match: {vendor: 0x15b3, vpd: " + c.m + "}}]\n"
		_, err := ParseProfile("op.yaml", []byte(src))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("vpd %s: err = %v, want %q", c.m, err, c.want)
		}
	}
}

// bridgeNode is a reference node with the HGX baseboard's NVSwitch bridge below GPU
// complex 0's Broadcom switch (pcitest.WithNVSwitchBridge).
func bridgeNode(t *testing.T, spec pcitest.Spec) (*pcitest.Node, *pci.Tree) {
	t.Helper()
	return scan(t, pcitest.WithNVSwitchBridge(spec))
}

// TestNVSwitchBridgeLabels: on b300 and b200 the bridge's limited PFs, told by
// SMDL=SW_MNG in VPD VA, and the full-capability PFs beside them are nvswitch-mgmt, in no
// unit, without a conflict, although they are ConnectX-7 PFs below a GPU complex's
// Broadcom switch (which b200's gpu-nic rule would otherwise take); every unit is as on
// the node without the bridge. A marker that is not the whole field is not the marker.
func TestNVSwitchBridgeLabels(t *testing.T) {
	for _, c := range []struct {
		profile string
		spec    func() pcitest.Spec
		nics    int
	}{{"b300", pcitest.B300, 2}, {"b200", pcitest.B200, 1}} {
		t.Run(c.profile, func(t *testing.T) {
			n, tree := bridgeNode(t, c.spec())
			l := mustLabel(t, tree, c.profile) // fails on any conflict
			for _, name := range pcitest.NVSwitchBridgeFns {
				rule := "nvswitch-bridge-fc"
				if strings.HasPrefix(name, "nvsw-lpf") {
					rule = "nvswitch-bridge"
				}
				if fl := l.Of(n.Addr(name)); fl.Role != RoleNVSwitchMgmt || fl.Rule != rule || fl.Unit != -1 {
					t.Errorf("%s: %+v, want nvswitch-mgmt by %s in no unit", name, fl, rule)
				}
			}
			if len(l.Units) != 8 || len(l.Problems) != 0 {
				t.Fatalf("%d units, problems %v", len(l.Units), l.Problems)
			}
			for _, u := range l.Units {
				if len(u.NICs) != c.nics || len(u.NVMe) != 1 {
					t.Errorf("unit %s: %d NICs, %d NVMe", u.ID, len(u.NICs), len(u.NVMe))
				}
			}
		})
	}
	spec := pcitest.WithNVSwitchBridge(pcitest.B300())
	for _, name := range []string{"nvsw-lpf0", "nvsw-lpf1"} {
		spec.Fn(name).VPD.Keywords["VA"] = "MLX:MN=MLNX:SMDL=SW_MNG_NOT:MODL=CX7"
	}
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300")
	for _, name := range pcitest.NVSwitchBridgeFns {
		if fl := l.Of(n.Addr(name)); fl.Role == RoleNVSwitchMgmt {
			t.Errorf("%s without the marker labelled %+v", name, fl)
		}
	}
}

// TestResetRefusal: the guard every reset passes through allows a unit's passthrough
// functions and refuses everything the host keeps, the NVSwitch bridge's PFs with the
// reason, bridges, and what labelling does not know.
func TestResetRefusal(t *testing.T) {
	n, tree := bridgeNode(t, pcitest.B300())
	l := mustLabel(t, tree, "b300")
	for _, name := range []string{"gpu0", "nic0.0", "nic0.1", "nvme0", "gpu7"} {
		if err := l.ResetRefusal(n.Addr(name)); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	for name, want := range map[string]string{
		"nvsw-lpf0":       `is nvswitch-mgmt (rule "nvswitch-bridge"): an FLR of an NVSwitch management function resets its NVSwitch`,
		"nvsw-fc1":        `is nvswitch-mgmt (rule "nvswitch-bridge-fc")`,
		"mgmt0":           "is mgmt-nic: passage resets only the functions it passes through",
		"holder0":         "is placeholder",
		"rp0":             "is switch-port",
		"nvsw-bridge-dsp": "is switch-port",
	} {
		a := n.Addr(name)
		err := l.ResetRefusal(a)
		if err == nil || !strings.Contains(err.Error(), a.String()) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want refused: %q", name, err, want)
		}
	}
	if err := l.ResetRefusal(pci.MustParseAddress("0000:fe:1f.7")); err == nil || !strings.Contains(err.Error(), "not in the labelled tree") {
		t.Errorf("unknown function: %v", err)
	}
	var none *Labels
	if err := none.ResetRefusal(n.Addr("gpu0")); err == nil || !strings.Contains(err.Error(), "no labelling") {
		t.Errorf("no labels: %v", err)
	}
}
