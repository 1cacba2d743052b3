package decision_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// planDecide builds spec, scans it and decides on it under the built-in profile,
// nothing live: no lockdown, no config_acs on the command line.
func planDecide(t *testing.T, spec pcitest.Spec, profile string, guest topology.GuestOptions) (*pcitest.Node, *decision.Decision) {
	t.Helper()
	p, err := topology.Builtin(profile)
	if err != nil {
		t.Fatal(err)
	}
	return planDecideWith(t, spec, p, guest)
}

func planDecideWith(t *testing.T, spec pcitest.Spec, p *topology.Profile, guest topology.GuestOptions) (*pcitest.Node, *decision.Decision) {
	t.Helper()
	n := pcitest.New(t, spec)
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	if err := tree.Err(); err != nil {
		t.Fatalf("scan problems: %v", err)
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: p, Guest: guest})
	if err != nil {
		t.Fatal(err)
	}
	return n, d
}

func planUnitReasons(d *decision.Decision, id int) string {
	for _, u := range d.Units() {
		if u.ID == topology.UnitID(id) {
			return strings.Join(u.Reasons, "; ")
		}
	}
	return ""
}

// TestDecidePlanB300: the reference node decides every unit ready, and the plan it lays
// out is the one topology plans (labels, ACS, kernel argument, matrices, guest), as
// `passage plan --json` prints it.
func TestDecidePlanB300(t *testing.T) {
	n, d := planDecide(t, pcitest.B300(), "b300", topology.GuestOptions{Units: []topology.UnitID{0, 1}})
	if d.LabelErr != nil || d.GuestErr != nil {
		t.Fatalf("label %v, guest %v", d.LabelErr, d.GuestErr)
	}
	if len(d.Units()) != 8 {
		t.Fatalf("%d units", len(d.Units()))
	}
	for _, v := range d.Decided() {
		if v.Status != topology.StatusReady || len(v.Reasons) != 0 {
			t.Errorf("unit %d: %s %v", v.Unit, v.Status, v.Reasons)
		}
	}
	pl := d.Plan()
	if pl.Labels != d.Labels || pl.Host != d.Host || pl.Guest != d.Guest || pl.GuestMatrix != d.GuestMatrix || pl.KernelArg != d.KernelArg {
		t.Errorf("Plan does not carry the decision's parts")
	}
	if want := topology.KernelArg(topology.ACSPlan(d.Units())); d.KernelArg != want {
		t.Errorf("kernel argument\n got %s\nwant %s (every port of every unit)", d.KernelArg, want)
	}
	for _, p := range d.ACS {
		if p.Skip != "" || p.Verdict != "" {
			t.Errorf("%s: skip %q verdict %q", p.Addr, p.Skip, p.Verdict)
		}
	}

	var js bytes.Buffer
	if err := d.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Profile string              `json:"profile"`
		Units   []topology.UnitJSON `json:"units"`
		ACS     []struct {
			Addr    string `json:"addr"`
			Unit    string `json:"unit"`
			CtlFrom string `json:"ctl_current"`
			CtlTo   string `json:"ctl_target"`
			Flags   string `json:"config_acs"`
			Skip    string `json:"skip"`
		} `json:"acs"`
		Guest struct {
			Units []struct {
				Functions []struct {
					Host string `json:"host"`
				} `json:"functions"`
			} `json:"units"`
		} `json:"guest"`
		KernelArg  string `json:"kernel_arg"`
		ATSPolicy  string `json:"ats_policy"`
		LabelError string `json:"label_error"`
		GuestError string `json:"guest_error"`
	}
	if err := json.Unmarshal(js.Bytes(), &doc); err != nil {
		t.Fatalf("%v\n%s", err, js.String())
	}
	if doc.Profile != "b300" || doc.KernelArg != d.KernelArg || doc.ATSPolicy != "prefer" || doc.LabelError != "" || doc.GuestError != "" {
		t.Errorf("doc: profile %q kernel_arg %q ats_policy %q label_error %q guest_error %q",
			doc.Profile, doc.KernelArg, doc.ATSPolicy, doc.LabelError, doc.GuestError)
	}
	if len(doc.Units) != 8 || doc.Units[3].GPU != n.Addr("gpu3").String() || doc.Units[3].Status != topology.StatusReady {
		t.Errorf("units %+v", doc.Units)
	}
	if len(doc.Guest.Units) != 2 || doc.Guest.Units[1].Functions[0].Host != n.Addr("gpu1").String() {
		t.Errorf("guest %+v", doc.Guest)
	}
	if len(doc.ACS) != len(d.ACS) {
		t.Fatalf("%d ACS entries, decision has %d", len(doc.ACS), len(d.ACS))
	}
	for i, a := range doc.ACS {
		p := d.ACS[i]
		if a.Addr != p.Addr.String() || a.Unit != p.Unit.String() || a.Skip != "" ||
			a.CtlFrom != fmt.Sprintf("0x%04x", uint16(p.Current)) || a.CtlTo != fmt.Sprintf("0x%04x", uint16(p.Target())) {
			t.Errorf("acs entry %d %+v, port %s current %s target %s", i, a, p.Addr, p.Current, p.Target())
		}
		// The kernel leaves SV RR CR UF (0x001d) on every port of the reference tree;
		// the NIC ports gain DT (0x005d), the rest stay.
		want := "0x001d"
		if a.Addr == n.Addr("cx-dsp-nic"+strings.TrimPrefix(a.Unit, "gpu")).String() {
			want = "0x005d"
		}
		if a.CtlFrom != "0x001d" || a.CtlTo != want {
			t.Errorf("%s: %s -> %s, want 0x001d -> %s", a.Addr, a.CtlFrom, a.CtlTo, want)
		}
	}

	var txt bytes.Buffer
	if err := d.WriteText(&txt); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"acs plan", "kernel argument: " + d.KernelArg, "guest matrix (units gpu0,gpu1; flat", "ats (policy prefer)"} {
		if !strings.Contains(txt.String(), want) {
			t.Errorf("text lacks %q", want)
		}
	}
}

// TestDecideMissingACSFailsUnit: a port without ACS fails its unit (its traffic would
// bypass the IOMMU); the unit's ports are then left as they are, every other unit is
// planned and ready.
func TestDecideMissingACSFailsUnit(t *testing.T) {
	spec := pcitest.B300()
	// Take the ACS capability off unit 2's CX-8 NIC port.
	spec.Hosts[3].Fns[0].Below[0].Below[0].Below[0].Below[0].ACS = nil
	n, d := planDecide(t, spec, "b300", topology.GuestOptions{})
	nicPort := n.Addr("cx-dsp-nic2")
	for _, v := range d.Decided() {
		reasons := strings.Join(v.Reasons, "; ")
		if v.Unit == 2 {
			if want := fmt.Sprintf("acs %s (%s): no ACS capability", nicPort, topology.PosNICPort); v.Status != topology.StatusFailed || !strings.Contains(reasons, want) {
				t.Errorf("unit 2: %s %q, want failed with %q", v.Status, reasons, want)
			}
			continue
		}
		if v.Status != topology.StatusReady {
			t.Errorf("unit %d: %s %q", v.Unit, v.Status, reasons)
		}
	}
	unit2 := 0
	for _, p := range d.ACS {
		if p.Unit == 2 {
			unit2++
			if !strings.HasPrefix(p.Skip, "unit failed") {
				t.Errorf("%s (unit 2): skip %q", p.Addr, p.Skip)
			}
			if strings.Contains(d.KernelArg, p.Addr.String()) {
				t.Errorf("%s of the failed unit in the kernel argument", p.Addr)
			}
		} else if p.Skip != "" || !strings.Contains(d.KernelArg, p.Addr.String()) {
			t.Errorf("%s (unit %d): skip %q, in kernel argument %v", p.Addr, p.Unit, p.Skip, strings.Contains(d.KernelArg, p.Addr.String()))
		}
	}
	if unit2 != 6 {
		t.Errorf("%d ports of unit 2 in the plan, want 6", unit2)
	}
	// The guest plan takes the units that pass through, not the failed one.
	if d.GuestErr != nil || d.Guest == nil || len(d.Guest.Units) != 7 {
		t.Errorf("guest %v", d.GuestErr)
	} else {
		for _, u := range d.Guest.Units {
			if u.Unit == 2 {
				t.Errorf("failed unit 2 in the guest plan")
			}
		}
	}
	var txt bytes.Buffer
	if err := d.WriteText(&txt); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(txt.String(), "not written: unit failed") {
		t.Errorf("text does not say the failed unit's ports are not written")
	}
}

// TestDecideNoDTDegradesUnit: a NIC port without DT leaves the unit usable, degraded:
// GPU-NIC traffic goes through the root complex.
func TestDecideNoDTDegradesUnit(t *testing.T) {
	spec := pcitest.B300()
	spec.Hosts[5].Fns[0].Below[0].Below[0].Below[0].Below[0].ACS = &pcitest.ACS{
		Cap: pci.ACSSV | pci.ACSTB | pci.ACSRR | pci.ACSCR | pci.ACSUF, Ctl: pci.ACSIsolation}
	n, d := planDecide(t, spec, "b300", topology.GuestOptions{})
	for _, v := range d.Decided() {
		want := topology.StatusReady
		if v.Unit == 4 {
			want = topology.StatusDegraded
			if r := fmt.Sprintf("acs %s (%s): no DT capability", n.Addr("cx-dsp-nic4"), topology.PosNICPort); !strings.Contains(planUnitReasons(d, 4), r) {
				t.Errorf("unit 4 reasons %q, want %q", planUnitReasons(d, 4), r)
			}
		}
		if v.Status != want {
			t.Errorf("unit %d: %s %v, want %s", v.Unit, v.Status, v.Reasons, want)
		}
	}
	for _, p := range d.ACS {
		if p.Skip != "" {
			t.Errorf("%s skipped: %s", p.Addr, p.Skip)
		}
	}
	// DT is not advertised, so left alone ("x"), as every bit a port lacks.
	if !strings.Contains(d.KernelArg, "xx111x1@"+n.Addr("cx-dsp-nic4").String()) {
		t.Errorf("NIC port without DT not planned for isolation: %s", d.KernelArg)
	}
}

// TestDecideNoNICDegradesUnit: a GPU with no NIC beside it is a unit without its direct
// network path: degraded, not failed (labelling alone leaves it ready).
func TestDecideNoNICDegradesUnit(t *testing.T) {
	spec := pcitest.B300()
	spec.Hosts[6].Fns[0].Below[0].Below[0].Below[0].Below[0].Below = nil // unit 5's CX-8 PFs
	n, d := planDecide(t, spec, "b300", topology.GuestOptions{})
	for _, v := range d.Decided() {
		want := topology.StatusReady
		if v.Unit == 5 {
			want = topology.StatusDegraded
			if r := "no GPU-adjacent NIC found for GPU " + n.Addr("gpu5").String(); !strings.Contains(planUnitReasons(d, 5), r) {
				t.Errorf("unit 5 reasons %q, want %q", planUnitReasons(d, 5), r)
			}
		}
		if v.Status != want {
			t.Errorf("unit %d: %s %v, want %s", v.Unit, v.Status, v.Reasons, want)
		}
	}
}

// TestDecideLabelConflictFailsAll: rules that contradict each other fail every unit and
// nothing is written; the error is in the decision and its JSON.
func TestDecideLabelConflictFailsAll(t *testing.T) {
	b300, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	// The b300 rules and one as specific as nvswitch-mgmt (vendor+device) giving the
	// same functions another role.
	clash := *b300
	clash.Name = "clash"
	clash.Rules = append(append([]topology.Rule{}, b300.Rules...), topology.Rule{Name: "nvswitch-other", Role: topology.RoleHostOther,
		Match: topology.Match{Vendor: topology.IDs{pcitest.VendorNVIDIA}, Device: topology.IDs{pcitest.DevNVSwitch}}})
	_, d := planDecideWith(t, pcitest.B300(), &clash, topology.GuestOptions{})
	if d.LabelErr == nil || !strings.Contains(d.LabelErr.Error(), "equally specific") {
		t.Fatalf("label error %v", d.LabelErr)
	}
	for _, v := range d.Decided() {
		if v.Status != topology.StatusFailed || !strings.Contains(strings.Join(v.Reasons, "; "), "nothing is written on a labelling that contradicts itself") {
			t.Errorf("unit %d: %s %v", v.Unit, v.Status, v.Reasons)
		}
	}
	if len(d.ACS) == 0 || d.KernelArg != "" {
		t.Errorf("%d ports, kernel argument %q", len(d.ACS), d.KernelArg)
	}
	for _, p := range d.ACS {
		if p.Skip == "" {
			t.Errorf("%s would be written", p.Addr)
		}
	}
	if doc := d.Doc(); !strings.Contains(doc.LabelError, "equally specific") {
		t.Errorf("doc label_error %q", doc.LabelError)
	}
}
