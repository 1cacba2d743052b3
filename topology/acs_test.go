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
				if p.Position != PosNICPort || p.Target() != pci.ACSIsolation|pci.ACSDT || p.Unit != i {
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
		// In address order, as the bridges are numbered depth first below each root port.
		want = append(want,
			"xx111x1@"+a("rp%d"),
			"0x111x1@"+a("bcm-dsp-cx%d"),
			"0x111x1@"+a("bcm-dsp-nvme%d"),
			"1x111x1@"+a("cx-dsp-nic%d"),
			"0x111x1@"+a("cx-dsp-gpu%d"),
			"0x111x1@"+a("gpu-dsp%d"),
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

func TestACSMissingCapabilityFailsUnit(t *testing.T) {
	spec := pcitest.B300()
	// Take the ACS capability off unit 2's CX-8 NIC port.
	u := &spec.Hosts[3].Fns[0]
	u.Below[0].Below[0].Below[0].Below[0].ACS = nil
	n, tree := scan(t, spec)
	l := mustLabel(t, tree, "b300")
	ports := ACSPlan(l.Units)
	if l.Units[2].Status != StatusFailed || !strings.Contains(strings.Join(l.Units[2].Reasons, ";"), "no ACS capability") {
		t.Errorf("unit 2: %s %v", l.Units[2].Status, l.Units[2].Reasons)
	}
	if l.Units[1].Status != StatusReady {
		t.Errorf("unit 1: %s", l.Units[1].Status)
	}
	if strings.Contains(KernelArg(ports), n.Addr("cx-dsp-nic2").String()) {
		t.Errorf("port without ACS in the kernel argument")
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
