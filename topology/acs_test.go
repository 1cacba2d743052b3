package topology

import (
	"fmt"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

func TestACSPlanB300(t *testing.T) {
	n, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	ports := ACSPlan(l.Units)
	dt := 0
	for _, p := range ports {
		if p.Flags&pci.ACSDT != 0 {
			dt++
			if p.Position != PosNICPort {
				t.Errorf("%s: DT at %s", p.Addr, p.Position)
			}
		}
		target := p.Target()
		// Nothing that was on among the isolation bits may end up off.
		if lost := p.Current & pci.ACSIsolation &^ target; lost != 0 {
			t.Errorf("%s: plan clears %s", p.Addr, lost)
		}
		if target&pci.ACSRR == 0 || target&pci.ACSCR == 0 {
			t.Errorf("%s (%s): target %s lacks RR/CR", p.Addr, p.Position, target)
		}
		if (target^p.Current)&^(pci.ACSIsolation|pci.ACSDT) != 0 {
			t.Errorf("%s: plan touches bits outside SV RR CR UF DT: %s -> %s", p.Addr, p.Current, target)
		}
	}
	if dt != 8 {
		t.Errorf("%d DT ports, want 8", dt)
	}
	for i := 0; i < 8; i++ {
		var found bool
		for _, p := range ports {
			if p.Addr == n.Addr(fmt.Sprintf("cx-dsp-nic%d", i)) {
				found = true
				if p.Position != PosNICPort || p.Target() != pci.ACSIsolation|pci.ACSDT || p.Unit != UnitID(i) {
					t.Errorf("unit %d NIC port: %+v target %s", i, p, p.Target())
				}
			}
		}
		if !found {
			t.Errorf("unit %d: NIC port not planned", i)
		}
	}
	for _, u := range l.Units {
		if u.Status != StatusReady {
			t.Errorf("unit %d: %s %v", u.ID, u.Status, u.Reasons)
		}
	}
}

// TestKernelArgB300 holds the plan's kernel argument against one written out by hand
// from the policy: DT on the CX-8 downstream port above the NIC PFs ("1x111x1": DT, EC
// kept, UF CR RR, TB kept, SV); every other downstream-facing port on the unit's paths
// gets SV RR CR UF with DT off ("0x111x1"); the root ports do not advertise DT
// ("xx111x1"). Upstream ports are not listed.
func TestKernelArgB300(t *testing.T) {
	n, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	var want []string
	for i := 0; i < 8; i++ {
		a := func(s string) string { return n.Addr(fmt.Sprintf(s, i)).String() }
		// Unit by unit; within a unit the isolation-only ports in address order (the
		// bridges are numbered depth first below each root port), the DT port last.
		want = append(want,
			"xx111x1@"+a("rp%d"),
			"0x111x1@"+a("bcm-dsp-cx%d"),
			"0x111x1@"+a("bcm-dsp-nvme%d"),
			"0x111x1@"+a("cx-dsp-gpu%d"),
			"0x111x1@"+a("gpu-dsp%d"),
			"1x111x1@"+a("cx-dsp-nic%d"),
		)
	}
	got := KernelArg(ACSPlan(l.Units))
	if w := "pci=config_acs=" + strings.Join(want, ";"); got != w {
		t.Errorf("kernel argument\n got %s\nwant %s", got, w)
	}
	// Unit 7 laid out as B300.md shows it: the NIC port is ee:00.0.
	if !strings.Contains(got, "1x111x1@0000:ee:00.0") {
		t.Errorf("B300.md's NIC port ee:00.0 not planned with DT: %s", got)
	}
}

// TestACSPlanOrderDTLast: within every unit the ports that gain DT come after all the
// ports that only isolate, so an executor stopping at a unit's first failure never leaves
// DT open above a unit it could not isolate. Units stay in ID order.
func TestACSPlanOrderDTLast(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	ports := ACSPlan(l.Units)
	lastUnit, seenDT := -1, false
	for _, p := range ports {
		if p.Unit != UnitID(lastUnit) {
			if p.Unit < UnitID(lastUnit) {
				t.Errorf("%s: unit %d after unit %d", p.Addr, p.Unit, lastUnit)
			}
			lastUnit, seenDT = int(p.Unit), false
		}
		dt := p.Flags&pci.ACSDT != 0
		if seenDT && !dt {
			t.Errorf("unit %d: isolation-only port %s after a DT port", p.Unit, p.Addr)
		}
		seenDT = seenDT || dt
	}
	if len(ports) != 8*6 {
		t.Errorf("%d ports planned, want 48", len(ports))
	}
}

// TestACSMissingCapabilityReported: a port on a unit's path without the ACS capability
// is planned with no register to write and says its unit must fail; the plan leaves the
// unit itself alone (package decision gives verdicts).
func TestACSMissingCapabilityReported(t *testing.T) {
	spec := pcitest.B300()
	// Take the ACS capability off unit 2's CX-8 NIC port.
	u := &spec.Hosts[3].Fns[0]
	u.Below[0].Below[0].Below[0].Below[0].ACS = nil
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300")
	ports := ACSPlan(l.Units)
	nicPort := n.Addr("cx-dsp-nic2")
	var found bool
	for _, p := range ports {
		if p.Addr != nicPort {
			if p.Verdict != "" || p.Problem != "" {
				t.Errorf("%s (unit %d): verdict %q problem %q", p.Addr, p.Unit, p.Verdict, p.Problem)
			}
			continue
		}
		found = true
		if want := fmt.Sprintf("acs %s (%s): no ACS capability", nicPort, PosNICPort); p.Verdict != StatusFailed || p.Problem != want {
			t.Errorf("port without ACS: verdict %q problem %q, want failed %q", p.Verdict, p.Problem, want)
		}
		if p.Offset != 0 || p.Unit != 2 || !strings.Contains(p.Reason, "no ACS capability") {
			t.Errorf("port without ACS: %+v", p)
		}
	}
	if !found {
		t.Fatalf("port without ACS not in the plan")
	}
	for _, u := range l.Units {
		if u.Status != StatusReady || len(u.Reasons) != 0 {
			t.Errorf("ACSPlan changed unit %d: %s %v", u.ID, u.Status, u.Reasons)
		}
	}
	if strings.Contains(KernelArg(ports), nicPort.String()) {
		t.Errorf("port without ACS in the kernel argument")
	}
}

// TestACSNoDTReported: a NIC port that does not advertise DT is still planned for
// isolation, without DT, and says its unit is degraded (no direct GPU-NIC path).
func TestACSNoDTReported(t *testing.T) {
	spec := pcitest.B300()
	u := &spec.Hosts[5].Fns[0] // unit 4
	nic := &u.Below[0].Below[0].Below[0].Below[0]
	nic.ACS = &pcitest.ACS{Cap: pci.ACSSV | pci.ACSTB | pci.ACSRR | pci.ACSCR | pci.ACSUF, Ctl: pci.ACSIsolation}
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300")
	ports := ACSPlan(l.Units)
	nicPort := n.Addr("cx-dsp-nic4")
	var found bool
	for _, p := range ports {
		if p.Addr != nicPort {
			if p.Verdict != "" {
				t.Errorf("%s: verdict %q %q", p.Addr, p.Verdict, p.Problem)
			}
			continue
		}
		found = true
		if want := fmt.Sprintf("acs %s (%s): no DT capability", nicPort, PosNICPort); p.Verdict != StatusDegraded || p.Problem != want {
			t.Errorf("NIC port without DT: verdict %q problem %q, want degraded %q", p.Verdict, p.Problem, want)
		}
		if p.Target()&pci.ACSDT != 0 || p.Target()&pci.ACSIsolation != pci.ACSIsolation {
			t.Errorf("NIC port without DT: target %s", p.Target())
		}
	}
	if !found {
		t.Fatalf("NIC port not in the plan")
	}
	if u := l.Unit(4); u.Status != StatusReady {
		t.Errorf("ACSPlan changed unit 4: %s %v", u.Status, u.Reasons)
	}
}

func TestConfigACSFlags(t *testing.T) {
	for _, c := range []struct {
		mask, flags pci.ACSBits
		want        string
	}{
		{0x7f, 0x7b, "1111011"}, // the kernel documentation's example
		{pci.ACSIsolation | pci.ACSDT, pci.ACSIsolation | pci.ACSDT, "1x111x1"},
		{pci.ACSIsolation, pci.ACSIsolation, "xx111x1"},
		{0, 0, "xxxxxxx"},
	} {
		if got := ConfigACSFlags(c.mask, c.flags); got != c.want {
			t.Errorf("%#x/%#x: %s, want %s", c.mask, c.flags, got, c.want)
		}
	}
}
