package vfiobind_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

func TestAuditB300AllViable(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := allUnits(n)
	if f := vfiobind.Audit(n.tree, units); len(f) != 0 {
		t.Fatalf("reference B300: want no findings, got %d:\n%v", len(f), f)
	}
	checkUnjudged(t, "Audit", units)
	// The audit's premise, checked independently: each passthrough function's group
	// holds only its unit's functions and bridges.
	groups := n.tree.Groups()
	for _, u := range units {
		mine := map[pci.Address]bool{}
		for _, d := range u.Functions() {
			mine[d.Addr] = true
		}
		for _, d := range u.Functions() {
			if d.IOMMUGroup < 0 {
				t.Fatalf("unit %d: %s has no group", u.ID, d.Addr)
			}
			for _, m := range groups[d.IOMMUGroup] {
				if !mine[m.Addr] && !m.IsBridge() {
					t.Errorf("unit %d: group %d holds %s", u.ID, d.IOMMUGroup, m.Addr)
				}
			}
		}
	}
}

func TestBindB300(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := allUnits(n)
	clk := &fakeClock{}
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(clk))
	if err != nil {
		t.Fatal(err)
	}
	if rep.ModulesErr != "" {
		t.Errorf("modules: %s", rep.ModulesErr)
	}
	for _, m := range vfiobind.Modules {
		if !n.k.Loaded(m) {
			t.Errorf("module %s not loaded", m)
		}
	}
	if len(rep.Units) != 8 {
		t.Fatalf("want 8 unit reports, got %d", len(rep.Units))
	}
	after := n.rescan(t)
	bound := 0
	for i, u := range units {
		ur := rep.Unit(u.ID)
		if ur == nil || !ur.Bound() {
			t.Errorf("unit %d: report %+v, want bound", u.ID, ur)
			continue
		}
		bound++
		if len(ur.Functions) != 4 {
			t.Errorf("unit %d: %d function reports, want 4", u.ID, len(ur.Functions))
		}
		wantBefore := map[string]string{fmt.Sprintf("gpu%d", i): "nvidia", fmt.Sprintf("nic%d.0", i): "mlx5_core",
			fmt.Sprintf("nic%d.1", i): "mlx5_core", fmt.Sprintf("nvme%d", i): "nvme"}
		for name, before := range wantBefore {
			a := n.Addr(name)
			d := after.Lookup(a)
			if d.Driver != vfiobind.VFIODriver || d.DriverOverride != vfiobind.VFIODriver {
				t.Errorf("%s: driver %q override %q after bind", name, d.Driver, d.DriverOverride)
			}
			if !n.devNode(d.IOMMUGroup) {
				t.Errorf("%s: /dev/vfio/%d missing", name, d.IOMMUGroup)
			}
			var fr *vfiobind.FunctionReport
			for j := range ur.Functions {
				if ur.Functions[j].Addr == a {
					fr = &ur.Functions[j]
				}
			}
			if fr == nil {
				t.Errorf("%s: no function report", name)
				continue
			}
			if fr.DriverBefore != before || fr.DriverAfter != vfiobind.VFIODriver || fr.Group != d.IOMMUGroup || fr.Err != "" || fr.RolledBack {
				t.Errorf("%s: report %+v, want %s -> vfio-pci in group %d", name, *fr, before, d.IOMMUGroup)
			}
		}
	}
	if bound != 8 {
		t.Errorf("%d of 8 units bound", bound)
	}
	// Bind reports; it does not judge the units (package decision does).
	checkUnjudged(t, "Bind", units)
	// Host-kept functions keep their drivers and get no write at all.
	for _, name := range []string{"mgmt0", "mgmt1", "nvswitch0", "nvswitch3", "holder0"} {
		if w := n.k.Touched(n.Addr(name)); len(w) != 0 {
			t.Errorf("%s touched: %v", name, w)
		}
		if a, b := n.tree.Lookup(n.Addr(name)).Driver, after.Lookup(n.Addr(name)).Driver; a != b {
			t.Errorf("%s: driver %q -> %q", name, a, b)
		}
	}
	// vfio-pci.ids= or new_id would bind by PCI ID, catching any function with that ID.
	for _, w := range n.k.Writes() {
		if strings.HasSuffix(w.Path, "/new_id") || strings.HasSuffix(w.Path, "/bind") {
			t.Errorf("binding by ID or driver bind file: %s <- %q", w.Path, w.Data)
		}
	}
}

func TestBindIsIdempotent(t *testing.T) {
	n := newNode(t, pcitest.B300())
	if _, err := vfiobind.Bind(context.Background(), n.k, n.tree, n.units(0), n.opts(&fakeClock{})); err != nil {
		t.Fatal(err)
	}
	tree := n.rescan(t)
	n.tree = tree
	n.k.ResetWrites()
	units := n.units(0)
	rep, err := vfiobind.Bind(context.Background(), n.k, tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Units[0].Bound() {
		t.Fatalf("second run: %s", rep.Units[0].Error)
	}
	if len(rep.Units[0].Functions) != 4 {
		t.Fatalf("second run: %d function reports, want 4", len(rep.Units[0].Functions))
	}
	for _, fr := range rep.Units[0].Functions {
		if fr.DriverBefore != vfiobind.VFIODriver || len(fr.Writes) != 1 {
			t.Errorf("%s: second run did %v (before %q); want only the override write", fr.Addr, fr.Writes, fr.DriverBefore)
		}
	}
}

// withHostDevInGroup puts a management NIC beside unit 3's GPU below the GPU's
// downstream port and strips that port's ACS: the kernel then puts both in one group.
func withHostDevInGroup() pcitest.Spec {
	spec := pcitest.B300()
	dsp := spec.Fn("gpu-dsp3")
	dsp.ACS = nil
	mgmt := pcitest.MgmtNIC("mgmt2", 0, pcitest.VendorBCMNet, pcitest.DevBCM57414).Below[0]
	mgmt.Dev = 1
	dsp.Below = append(dsp.Below, mgmt)
	return spec
}

// withNVSwitchBesideNVMe moves an NVSwitch management function below unit 6's NVMe
// port, a port with ACS advertised but RR and CR left off.
func withNVSwitchBesideNVMe() pcitest.Spec {
	spec := pcitest.B300()
	dsp := spec.Fn("bcm-dsp-nvme6")
	dsp.ACS = &pcitest.ACS{Cap: pci.ACSIsolation | pci.ACSTB, Ctl: pci.ACSSV | pci.ACSUF}
	sw := *spec.Fn("nvswitch2")
	sw.Name, sw.Dev = "nvswitch-x", 1
	dsp.Below = append(dsp.Below, sw)
	return spec
}

// A group shared with a host-kept function: the audit refuses the unit, naming the
// group's members and who holds each. Bind, given the units the audit did not refuse
// (what package decision hands it), binds those and writes nothing of the refused unit
// nor of the host function, though it shares a group with nothing bound.
func TestSharedGroupRefusesUnit(t *testing.T) {
	for _, tc := range []struct {
		name     string
		spec     pcitest.Spec
		unit     int
		host     string
		withFunc string // the passthrough function whose group is shared
	}{
		{"mgmt NIC with GPU", withHostDevInGroup(), 3, "mgmt2", "gpu3"},
		{"NVSwitch mgmt with NVMe", withNVSwitchBesideNVMe(), 6, "nvswitch-x", "nvme6"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, tc.spec)
			host, shared := n.dev(tc.host), n.dev(tc.withFunc)
			if host.IOMMUGroup != shared.IOMMUGroup {
				t.Fatalf("variant tree: %s group %d, %s group %d; want one group", tc.host, host.IOMMUGroup, tc.withFunc, shared.IOMMUGroup)
			}
			units := allUnits(n)
			findings := vfiobind.Audit(n.tree, units)
			got := ofKind(findings, vfiobind.KindGroupShared)
			if len(got) != 1 || got[0].Unit != topology.UnitID(tc.unit) {
				t.Fatalf("%s findings %v, want one, of unit %d", vfiobind.KindGroupShared, got, tc.unit)
			}
			refusal := got[0]
			if !refusal.Refuses() || refusal.Status != topology.StatusFailed || refusal.Addr != shared.Addr || refusal.Group != shared.IOMMUGroup {
				t.Errorf("finding %+v: want a refusal at %s in group %d", refusal, shared.Addr, shared.IOMMUGroup)
			}
			listed := map[pci.Address]string{}
			for _, m := range refusal.Members {
				listed[m.Addr] = m.Owner
			}
			if listed[host.Addr] != "host" || listed[shared.Addr] != fmt.Sprintf("gpu%d", tc.unit) || len(listed) != 3 {
				t.Errorf("members %v: want %s (host), %s (unit %d) and the port", refusal.Members, tc.host, tc.withFunc, tc.unit)
			}
			if !strings.Contains(refusal.String(), host.Addr.String()) {
				t.Errorf("finding does not name %s: %s", host.Addr, refusal)
			}
			drop := refused(findings)
			if len(drop) != 1 || !drop[tc.unit] {
				t.Errorf("refused units %v, want only %d", drop, tc.unit)
			}
			checkUnjudged(t, "Audit", units)

			rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, without(units, drop), n.opts(&fakeClock{}))
			if err != nil {
				t.Fatal(err)
			}
			if r := rep.Unit(topology.UnitID(tc.unit)); r != nil {
				t.Errorf("unit %d, not given, has a report: %+v", tc.unit, r)
			}
			u := units[tc.unit]
			// No file of the refused unit's devices, nor of the host device, was written.
			for _, d := range append(u.Functions(), host) {
				if w := n.k.Touched(d.Addr); len(w) != 0 {
					t.Errorf("%s of refused unit touched: %v", d.Addr, w)
				}
			}
			after := n.rescan(t)
			for _, d := range append(u.Functions(), host) {
				if got := after.Lookup(d.Addr).Driver; got != d.Driver {
					t.Errorf("%s: driver %q -> %q", d.Addr, d.Driver, got)
				}
			}
			for _, o := range units {
				if o.ID == topology.UnitID(tc.unit) {
					continue
				}
				if r := rep.Unit(o.ID); r == nil || !r.Bound() {
					t.Errorf("unit %d: report %+v, want bound", o.ID, r)
				}
				for _, d := range o.Functions() {
					if after.Lookup(d.Addr).Driver != vfiobind.VFIODriver {
						t.Errorf("unit %d: %s not on vfio-pci", o.ID, d.Addr)
					}
				}
			}
		})
	}
}

// An isolation gap degrades a unit, it does not refuse it: a degraded unit still goes to
// Bind, and Bind binds it.
func TestIsolationGapDegradesUnit(t *testing.T) {
	spec := pcitest.B300()
	// RR off on the CX-8 downstream port above unit 5's GPU: Linux still gives the GPU
	// a group of its own bridges, but peer requests no longer reach the IOMMU.
	spec.Fn("cx-dsp-gpu5").ACS = &pcitest.ACS{Cap: pci.ACSIsolation | pci.ACSDT, Ctl: pci.ACSSV | pci.ACSCR | pci.ACSUF}
	// And a port with no ACS at all above unit 1's NVMe.
	spec.Fn("bcm-dsp-nvme1").ACS = nil
	n := newNode(t, spec)
	units := allUnits(n)
	findings := vfiobind.Audit(n.tree, units)
	gaps := map[pci.Address]vfiobind.Finding{}
	for _, f := range findings {
		if f.Kind != vfiobind.KindIsolationGap {
			t.Errorf("unexpected finding %s", f)
			continue
		}
		if f.Refuses() {
			t.Errorf("isolation gap refuses: %s", f)
		}
		gaps[f.Addr] = f
	}
	for _, want := range []struct {
		port, detail string
		unit         int
	}{{"cx-dsp-gpu5", "RR off", 5}, {"bcm-dsp-nvme1", "no ACS capability", 1}} {
		f, ok := gaps[n.Addr(want.port)]
		if !ok || f.Unit != topology.UnitID(want.unit) || !strings.Contains(f.Detail, want.detail) || f.Status != topology.StatusDegraded {
			t.Errorf("%s: finding %+v, want unit %d %q degraded", want.port, f, want.unit, want.detail)
		}
	}
	if len(gaps) != 2 {
		t.Errorf("%d gaps, want 2", len(gaps))
	}
	if r := refused(findings); len(r) != 0 {
		t.Errorf("refused %v, want none", r)
	}
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, without(units, refused(findings)), n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	after := n.rescan(t)
	for _, u := range units {
		if r := rep.Unit(u.ID); r == nil || !r.Bound() {
			t.Errorf("unit %d: report %+v, want bound", u.ID, r)
		}
		for _, d := range u.Functions() {
			if after.Lookup(d.Addr).Driver != vfiobind.VFIODriver {
				t.Errorf("unit %d %s not bound", u.ID, d.Addr)
			}
		}
	}
	checkUnjudged(t, "Audit and Bind", units)
}

// A bridge type the kernel's pci_acs_enabled never counts as isolating, on the path of a
// passthrough function, is an isolation gap, whatever the ports around it hold. No real
// RCEC has a bus below it; the case checks that the rule follows the port type. An
// upstream port in the same place is the control: the finding is the type's, not the
// extra bridge's.
func TestNonIsolatingBridgeIsGap(t *testing.T) {
	for _, tc := range []struct {
		name   string
		port   pci.PortType
		detail string // "" for no finding
	}{
		{"PCI-to-PCIe bridge", pci.PortPCIToPCIe, "PCI-to-PCIe bridge"},
		{"RCEC", pci.PortRCEC, "root complex event collector"},
		{"upstream port", pci.PortUpstream, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := pcitest.B300()
			dsp := spec.Fn("gpu-dsp5")
			gpu := dsp.Below[0]
			dsp.Below = []pcitest.Fn{{Name: "xbridge", Vendor: pcitest.VendorBroadcom, Device: pcitest.DevPEX890xx,
				Class: pcitest.ClassBridge, Port: tc.port, Link: pcitest.Link{Speed: pcitest.Gen6, Width: 16}, Driver: "pcieport",
				Below: []pcitest.Fn{gpu}}}
			n := newNode(t, spec)
			br, g := n.dev("xbridge"), n.dev("gpu5")
			if pt, ok := br.PortType(); !ok || pt != tc.port || !br.IsBridge() || g.Parent != br {
				t.Fatalf("variant tree: %s port type %v (express %v), bridge %v, GPU parent %v", br.Addr, pt, ok, br.IsBridge(), g.Parent)
			}
			units := allUnits(n)
			findings := vfiobind.Audit(n.tree, units)
			if tc.detail == "" {
				if len(findings) != 0 {
					t.Errorf("findings %v, want none", findings)
				}
				return
			}
			if len(findings) != 1 {
				t.Fatalf("findings %v, want one isolation gap", findings)
			}
			f := findings[0]
			if f.Kind != vfiobind.KindIsolationGap || f.Unit != 5 || f.Addr != br.Addr || f.Status != topology.StatusDegraded ||
				!strings.Contains(f.Detail, tc.detail) || !strings.Contains(f.Detail, g.Addr.String()) {
				t.Errorf("finding %+v: want unit 5 degraded by the %s at %s above %s", f, tc.name, br.Addr, g.Addr)
			}
			// A plan cannot close it: there is no ACS Control to write.
			if p := vfiobind.AuditPlanned(n.tree, units, map[pci.Address]pci.ACSBits{br.Addr: pci.ACSIsolation}); !reflect.DeepEqual(p, findings) {
				t.Errorf("planned ACS on the %s: %v, want %v", tc.name, p, findings)
			}
		})
	}
}

// AuditPlanned judges a port the plan names by the ACS Control the plan gives it, before
// anything is written, and every other port by the tree; it changes neither the tree nor
// the units.
func TestAuditPlannedACS(t *testing.T) {
	spec := pcitest.B300()
	// RR off in the tree above unit 5.
	spec.Fn("cx-dsp-gpu5").ACS = &pcitest.ACS{Cap: pci.ACSIsolation | pci.ACSDT, Ctl: pci.ACSSV | pci.ACSCR | pci.ACSUF}
	// No ACS capability above unit 7's NVMe.
	spec.Fn("bcm-dsp-nvme7").ACS = nil
	n := newNode(t, spec)
	off, on, bare := n.dev("cx-dsp-gpu5"), n.dev("cx-dsp-gpu6"), n.dev("bcm-dsp-nvme7")
	units := n.units(5, 6, 7)
	gapsOf := func(what string, fs []vfiobind.Finding) map[pci.Address]vfiobind.Finding {
		out := map[pci.Address]vfiobind.Finding{}
		for _, f := range fs {
			if f.Kind != vfiobind.KindIsolationGap || f.Status != topology.StatusDegraded {
				t.Errorf("%s: unexpected finding %+v", what, f)
			}
			out[f.Addr] = f
		}
		return out
	}

	scanned := vfiobind.Audit(n.tree, units)
	tree := gapsOf("tree", scanned)
	if f, ok := tree[off.Addr]; !ok || f.Unit != 5 || !strings.Contains(f.Detail, "RR off") {
		t.Errorf("tree: finding %+v, want RR off above unit 5", f)
	}
	if _, ok := tree[on.Addr]; ok {
		t.Errorf("tree: gap at %s, whose ACS is on", on.Addr)
	}
	if len(tree) != 2 {
		t.Errorf("tree: %d gaps, want 2: %v", len(tree), scanned)
	}
	if p := vfiobind.AuditPlanned(n.tree, units, nil); !reflect.DeepEqual(p, scanned) {
		t.Errorf("nil plan: %v, want Audit's %v", p, scanned)
	}

	// The plan turns RR on above unit 5 and off above unit 6, and names the bare port,
	// which has no ACS capability for a plan to set.
	offCtl := pci.ACSSV | pci.ACSCR | pci.ACSUF
	planned := map[pci.Address]pci.ACSBits{off.Addr: pci.ACSIsolation, on.Addr: offCtl, bare.Addr: pci.ACSIsolation}
	planFindings := vfiobind.AuditPlanned(n.tree, units, planned)
	plan := gapsOf("plan", planFindings)
	if f, ok := plan[off.Addr]; ok {
		t.Errorf("plan: %s, planned with every isolation flag on, still a gap: %s", off.Addr, f)
	}
	f, ok := plan[on.Addr]
	if !ok || f.Unit != 6 || !strings.Contains(f.Detail, "RR off") || !strings.Contains(f.Detail, fmt.Sprintf("ACSCtl %s)", offCtl)) {
		t.Errorf("plan: finding %+v, want RR off above unit 6, quoting the planned ACSCtl %s", f, offCtl)
	}
	if f, ok := plan[bare.Addr]; !ok || f.Unit != 7 || !strings.Contains(f.Detail, "no ACS capability") {
		t.Errorf("plan: finding %+v, want no ACS capability above unit 7", f)
	}
	if len(plan) != 2 {
		t.Errorf("plan: %d gaps, want 2: %v", len(plan), planFindings)
	}
	// The plan is judged, not written into the tree.
	if off.ACS.Ctl != offCtl || on.ACS.Ctl != pci.ACSIsolation {
		t.Errorf("tree changed: %s ACSCtl %s, %s ACSCtl %s", off.Addr, off.ACS.Ctl, on.Addr, on.ACS.Ctl)
	}
	checkUnjudged(t, "AuditPlanned", units)
}

func TestBadUnits(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := n.units(0, 1, 2)
	units[0].GPU = nil
	units[1].NVMe = append(units[1].NVMe, units[2].GPU) // one function in two units
	ghost := &pci.Device{Addr: pci.MustParseAddress("0000:ff:1f.7"), IOMMUGroup: 99}
	units = append(units, &topology.Unit{ID: 9, GPU: ghost}, nil)
	findings := vfiobind.Audit(n.tree, units)
	kinds := map[int][]string{}
	for _, f := range findings {
		kinds[int(f.Unit)] = append(kinds[int(f.Unit)], f.Kind)
	}
	drop := refused(findings)
	want := map[int]string{0: vfiobind.KindBadUnit, 1: vfiobind.KindSharedFunction, 2: vfiobind.KindSharedFunction, 9: vfiobind.KindBadUnit}
	for id, k := range want {
		if !strings.Contains(strings.Join(kinds[id], " "), k) {
			t.Errorf("unit %d: findings %v, want %s", id, kinds[id], k)
		}
		if !drop[id] {
			t.Errorf("unit %d not refused", id)
		}
	}
	if len(drop) != len(want) {
		t.Errorf("refused %v, want %v", drop, want)
	}
	// Nothing is left to bind, and Bind given nothing neither loads the vfio stack nor
	// writes.
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, without(units, drop), n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Units) != 0 || n.k.Loaded("vfio_pci") {
		t.Errorf("nothing to bind: %d unit reports, vfio_pci loaded %v", len(rep.Units), n.k.Loaded("vfio_pci"))
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("nothing to bind, yet %d writes: %v", len(w), w)
	}
	if _, err := vfiobind.Bind(context.Background(), n.k, nil, units, vfiobind.Options{}); err == nil {
		t.Error("nil tree: no error")
	}
	if _, err := vfiobind.Bind(context.Background(), nil, n.tree, units, vfiobind.Options{}); err == nil {
		t.Error("nil sysfs: no error")
	}
}

// Without an IOMMU the audit refuses every function. Bind, handed the unit anyway (it
// judges nothing), cannot bind it: vfio-pci's probe fails without a group, the bounded
// wait runs out, and the unit goes back to its host drivers.
func TestNoIOMMU(t *testing.T) {
	spec := pcitest.B300()
	spec.NoIOMMU = true
	n := newNode(t, spec)
	units := n.units(4)
	findings := vfiobind.Audit(n.tree, units)
	if len(findings) != 4 {
		t.Errorf("no IOMMU: findings %v, want 4", findings)
	}
	for _, f := range findings {
		if f.Kind != vfiobind.KindNoGroup || !f.Refuses() {
			t.Errorf("no IOMMU: finding %s, want a %s refusal", f, vfiobind.KindNoGroup)
		}
	}
	if r := refused(findings); len(r) != 1 || !r[4] {
		t.Errorf("refused %v, want unit 4", r)
	}

	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	ur := rep.Unit(4)
	if ur == nil || ur.Bound() || !strings.Contains(ur.Error, "no driver bound after drivers_probe") {
		t.Fatalf("unit 4 report %+v, want not bound: no driver after drivers_probe", ur)
	}
	if len(ur.Functions) != 1 || !ur.Functions[0].RolledBack || ur.Functions[0].RollbackErr != "" {
		t.Errorf("function reports %+v, want the GPU's alone, rolled back cleanly", ur.Functions)
	}
	after := n.rescan(t)
	for _, d := range units[0].Functions() {
		if a := after.Lookup(d.Addr); a.Driver != d.Driver || a.DriverOverride != "" {
			t.Errorf("%s: driver %q override %q, want %q and none", d.Addr, a.Driver, a.DriverOverride, d.Driver)
		}
	}
	checkUnjudged(t, "Bind", units)
}

func TestCancelled(t *testing.T) {
	n := newNode(t, pcitest.B300())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	units := n.units(0, 1)
	rep, err := vfiobind.Bind(ctx, n.k, n.tree, units, n.opts(&fakeClock{}))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v, want context.Canceled", err)
	}
	for _, u := range units {
		ur := rep.Unit(u.ID)
		if ur == nil || ur.Bound() || !strings.Contains(ur.Error, context.Canceled.Error()) || len(ur.Functions) != 0 {
			t.Errorf("unit %d: report %+v after cancel", u.ID, ur)
		}
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("writes after cancel: %v", w)
	}
	checkUnjudged(t, "Bind", units)
}

// Two units whose functions share a group: neither can go to a VM alone, so the audit
// refuses both, each finding listing both units' members; the third unit is bound and
// the two are not touched.
func TestGroupSharedBetweenUnits(t *testing.T) {
	spec := pcitest.B300()
	dsp := spec.Fn("gpu-dsp3")
	dsp.ACS = nil
	nvme := *spec.Fn("nvme4")
	nvme.Name, nvme.Dev = "nvme-x", 1
	dsp.Below = append(dsp.Below, nvme)
	n := newNode(t, spec)
	units := n.units(2, 3, 4)
	units[2].NVMe = []*pci.Device{n.dev("nvme-x")}
	findings := vfiobind.Audit(n.tree, units)
	drop := refused(findings)
	if len(drop) != 2 || !drop[3] || !drop[4] {
		t.Errorf("refused %v, want units 3 and 4", drop)
	}
	for _, id := range []int{3, 4} {
		var shared []string
		for _, f := range ofKind(findings, vfiobind.KindGroupShared) {
			if f.Unit == topology.UnitID(id) {
				shared = append(shared, f.String())
			}
		}
		s := strings.Join(shared, " ")
		if len(shared) != 1 || !strings.Contains(s, "(gpu3)") || !strings.Contains(s, "(gpu4)") {
			t.Errorf("unit %d: %s findings %v, want one listing both units' members", id, vfiobind.KindGroupShared, shared)
		}
	}
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, without(units, drop), n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Units) != 1 || rep.Units[0].ID != 2 || !rep.Units[0].Bound() {
		t.Errorf("reports %+v, want unit 2 bound alone", rep.Units)
	}
	for _, u := range units[1:] {
		for _, d := range u.Functions() {
			if w := n.k.Touched(d.Addr); len(w) != 0 {
				t.Errorf("unit %d %s touched: %v", u.ID, d.Addr, w)
			}
		}
	}
}

// Bind binds exactly the units it is given and judges none: a unit an earlier stage
// marked failed, if handed over, is bound (keeping it back is package decision's job)
// and keeps its status and reasons; a unit not handed over is not written.
func TestBindJudgesNothing(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := n.units(0, 1, 2)
	units[1].Degrade(topology.StatusFailed, "ats: required and missing")
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units[:2], n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Units) != 2 || rep.Unit(2) != nil {
		t.Errorf("reports %+v, want units 0 and 1 only", rep.Units)
	}
	after := n.rescan(t)
	for _, u := range units[:2] {
		if r := rep.Unit(u.ID); r == nil || !r.Bound() || len(r.Functions) != 4 {
			t.Errorf("unit %d: report %+v, want bound", u.ID, r)
		}
		for _, d := range u.Functions() {
			if after.Lookup(d.Addr).Driver != vfiobind.VFIODriver {
				t.Errorf("unit %d: %s not on vfio-pci", u.ID, d.Addr)
			}
		}
	}
	if u := units[1]; u.Status != topology.StatusFailed || len(u.Reasons) != 1 || u.Reasons[0] != "ats: required and missing" {
		t.Errorf("unit 1: status %s reasons %v, want as the earlier stage left them", u.Status, u.Reasons)
	}
	checkUnjudged(t, "Bind", []*topology.Unit{units[0], units[2]})
	for _, d := range units[2].Functions() {
		if w := n.k.Touched(d.Addr); len(w) != 0 {
			t.Errorf("%s, of a unit not given, touched: %v", d.Addr, w)
		}
	}
}

// The same reference node, with units as topology labels them rather than by hand.
func TestLabelledB300AllViable(t *testing.T) {
	n := newNode(t, pcitest.B300())
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	labels, err := topology.Label(n.tree, p)
	if err != nil {
		t.Fatal(err)
	}
	if len(labels.Units) != 8 {
		t.Fatalf("%d units labelled, want 8", len(labels.Units))
	}
	if f := vfiobind.Audit(n.tree, labels.Units); len(f) != 0 {
		t.Fatalf("findings on the labelled reference: %v", f)
	}
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, labels.Units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Units) != 8 {
		t.Errorf("%d unit reports, want 8", len(rep.Units))
	}
	bound := 0
	for _, ur := range rep.Units {
		if !ur.Bound() {
			t.Errorf("unit %d: %s", ur.ID, ur.Error)
		}
		for _, fr := range ur.Functions {
			if fr.DriverAfter == vfiobind.VFIODriver && fr.Err == "" {
				bound++
			}
		}
	}
	if bound != 32 {
		t.Errorf("%d functions bound, want 32", bound)
	}
}

// TestSRIOVActiveRefusesUnit: the audit refuses a unit whose CX-8 PF has VFs enabled,
// naming its VFs and how to turn them off; the other units bind, and nothing of the
// refused unit (PF, VFs, or the rest) is written.
func TestSRIOVActiveRefusesUnit(t *testing.T) {
	spec := pcitest.B300()
	spec.Fn("nic2.1").SRIOV = &pcitest.SRIOV{Total: 8, Num: 4, VFDevice: pcitest.DevCX8VF, VFDriver: "mlx5_core"}
	n := newNode(t, spec)
	units := allUnits(n)
	pf := n.dev("nic2.1")
	findings := vfiobind.Audit(n.tree, units)
	got := ofKind(findings, vfiobind.KindSRIOVActive)
	if len(got) != 1 || got[0].Unit != 2 || got[0].Addr != pf.Addr || !got[0].Refuses() ||
		!strings.Contains(got[0].Detail, "4 SR-IOV VFs") || !strings.Contains(got[0].Detail, "sriov_numvfs") {
		t.Fatalf("findings %v, want one sriov-active refusal of unit 2 naming %s", got, pf.Addr)
	}
	drop := refused(findings)
	if len(drop) != 1 || !drop[2] {
		t.Errorf("refused %v, want unit 2 alone", drop)
	}
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, without(units, drop), n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	vfs := pf.VFs()
	if len(vfs) != 4 {
		t.Fatalf("variant tree: %d VFs, want 4", len(vfs))
	}
	for _, a := range vfs {
		if w := n.k.Touched(a); len(w) != 0 {
			t.Errorf("VF %s touched: %v", a, w)
		}
	}
	for _, d := range units[2].Functions() {
		if w := n.k.Touched(d.Addr); len(w) != 0 {
			t.Errorf("%s of refused unit touched: %v", d.Addr, w)
		}
	}
	for _, o := range units {
		if o.ID == 2 {
			continue
		}
		if r := rep.Unit(o.ID); r == nil || !r.Bound() {
			t.Errorf("unit %d: report %+v, want bound", o.ID, r)
		}
	}
}

// Reports carry addresses as the kernel writes them, and read back.
func TestReportJSON(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := n.units(0)
	units[0].NICs, units[0].NVMe = nil, nil
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	gpu := n.Addr("gpu0")
	b, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	if want := `"addr":"` + gpu.String() + `"`; !strings.Contains(string(b), want) {
		t.Errorf("report JSON %s: want %s", b, want)
	}
	var back vfiobind.Report
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(&back, rep) {
		t.Errorf("round trip: %+v, want %+v", back, *rep)
	}
	f := vfiobind.Finding{Kind: vfiobind.KindNoGroup, Addr: gpu, Group: -1, Members: []vfiobind.Member{{Addr: gpu, Owner: "unit 0"}}}
	b, err = json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	if want := `"addr":"` + gpu.String() + `"`; strings.Count(string(b), want) != 2 {
		t.Errorf("finding JSON %s: want %s for the finding and its member", b, want)
	}
}
