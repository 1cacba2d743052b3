package vfiobind_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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
	ready := 0
	for i, u := range units {
		ur := rep.Unit(u.ID)
		if u.Status != topology.StatusReady || ur.Status != topology.StatusReady {
			t.Errorf("unit %d: status %s / report %s: %v", u.ID, u.Status, ur.Status, u.Reasons)
			continue
		}
		ready++
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
			if fr.DriverBefore != before || fr.DriverAfter != vfiobind.VFIODriver || fr.Group != d.IOMMUGroup || fr.Err != "" {
				t.Errorf("%s: report %+v, want %s -> vfio-pci in group %d", name, *fr, before, d.IOMMUGroup)
			}
		}
	}
	if ready != 8 {
		t.Errorf("%d of 8 units ready", ready)
	}
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
	if units[0].Status != topology.StatusReady {
		t.Fatalf("second run: %s %v", units[0].Status, units[0].Reasons)
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
	dsp := findFn(&spec, "gpu-dsp3")
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
	dsp := findFn(&spec, "bcm-dsp-nvme6")
	dsp.ACS = &pcitest.ACS{Cap: pci.ACSIsolation | pci.ACSTB, Ctl: pci.ACSSV | pci.ACSUF}
	sw := *findFn(&spec, "nvswitch2")
	sw.Name, sw.Dev = "nvswitch-x", 1
	dsp.Below = append(dsp.Below, sw)
	return spec
}

func TestSharedGroupRefusesUnitAndTouchesNothing(t *testing.T) {
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
			rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
			if err != nil {
				t.Fatal(err)
			}
			var refusal *vfiobind.Finding
			for i, f := range rep.Findings {
				if f.Kind == vfiobind.KindGroupShared {
					if f.Unit != tc.unit || refusal != nil {
						t.Errorf("unexpected %s", f)
					}
					refusal = &rep.Findings[i]
				}
			}
			if refusal == nil {
				t.Fatalf("no %s finding: %v", vfiobind.KindGroupShared, rep.Findings)
			}
			listed := map[pci.Address]string{}
			for _, m := range refusal.Members {
				listed[m.Addr] = m.Owner
			}
			if listed[host.Addr] != "host" || listed[shared.Addr] != fmt.Sprintf("unit %d", tc.unit) || len(listed) != 3 {
				t.Errorf("members %v: want %s (host), %s (unit %d) and the port", refusal.Members, tc.host, tc.withFunc, tc.unit)
			}
			u := units[tc.unit]
			if u.Status != topology.StatusFailed || rep.Unit(tc.unit).Status != topology.StatusFailed {
				t.Errorf("unit %d: %s, want failed", tc.unit, u.Status)
			}
			if !strings.Contains(strings.Join(u.Reasons, "\n"), host.Addr.String()) {
				t.Errorf("reasons do not name %s: %v", host.Addr, u.Reasons)
			}
			// No file of the refused unit's devices, nor of the host device, was written.
			for _, d := range append(u.Functions(), host) {
				if w := n.k.Touched(d.Addr); len(w) != 0 {
					t.Errorf("%s of refused unit touched: %v", d.Addr, w)
				}
			}
			after := n.rescan(t)
			for _, d := range u.Functions() {
				if got := after.Lookup(d.Addr).Driver; got != d.Driver {
					t.Errorf("%s: driver %q -> %q", d.Addr, d.Driver, got)
				}
			}
			for _, o := range units {
				if o.ID != tc.unit && o.Status == topology.StatusFailed {
					t.Errorf("unit %d failed too: %v", o.ID, o.Reasons)
				}
				if o.ID != tc.unit && after.Lookup(o.GPU.Addr).Driver != vfiobind.VFIODriver {
					t.Errorf("unit %d GPU not on vfio-pci", o.ID)
				}
			}
		})
	}
}

func TestIsolationGapDegradesUnit(t *testing.T) {
	spec := pcitest.B300()
	// RR off on the CX-8 downstream port above unit 5's GPU: Linux still gives the GPU
	// a group of its own bridges, but peer requests no longer reach the IOMMU.
	findFn(&spec, "cx-dsp-gpu5").ACS = &pcitest.ACS{Cap: pci.ACSIsolation | pci.ACSDT, Ctl: pci.ACSSV | pci.ACSCR | pci.ACSUF}
	// And a port with no ACS at all above unit 1's NVMe.
	findFn(&spec, "bcm-dsp-nvme1").ACS = nil
	n := newNode(t, spec)
	units := allUnits(n)
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	gaps := map[pci.Address]vfiobind.Finding{}
	for _, f := range rep.Findings {
		if f.Kind != vfiobind.KindIsolationGap {
			t.Errorf("unexpected finding %s", f)
			continue
		}
		gaps[f.Addr] = f
	}
	for _, want := range []struct {
		port, detail string
		unit         int
	}{{"cx-dsp-gpu5", "RR off", 5}, {"bcm-dsp-nvme1", "no ACS capability", 1}} {
		f, ok := gaps[n.Addr(want.port)]
		if !ok || f.Unit != want.unit || !strings.Contains(f.Detail, want.detail) || f.Status != topology.StatusDegraded {
			t.Errorf("%s: finding %+v, want unit %d %q degraded", want.port, f, want.unit, want.detail)
		}
	}
	if len(gaps) != 2 {
		t.Errorf("%d gaps, want 2", len(gaps))
	}
	after := n.rescan(t)
	for _, u := range units {
		want := topology.StatusReady
		if u.ID == 5 || u.ID == 1 {
			want = topology.StatusDegraded
		}
		if u.Status != want {
			t.Errorf("unit %d: %s, want %s (%v)", u.ID, u.Status, want, u.Reasons)
		}
		// Degraded is still usable: the unit is bound.
		for _, d := range u.Functions() {
			if after.Lookup(d.Addr).Driver != vfiobind.VFIODriver {
				t.Errorf("unit %d %s not bound", u.ID, d.Addr)
			}
		}
	}
}

func TestBadUnits(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := n.units(0, 1, 2)
	units[0].GPU = nil
	units[1].NVMe = append(units[1].NVMe, units[2].GPU) // one function in two units
	ghost := &pci.Device{Addr: pci.MustParseAddress("0000:ff:1f.7"), IOMMUGroup: 99}
	units = append(units, &topology.Unit{ID: 9, GPU: ghost}, nil)
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[int][]string{}
	for _, f := range rep.Findings {
		kinds[f.Unit] = append(kinds[f.Unit], f.Kind)
	}
	want := map[int]string{0: vfiobind.KindBadUnit, 1: vfiobind.KindSharedFunction, 2: vfiobind.KindSharedFunction, 9: vfiobind.KindBadUnit}
	for id, k := range want {
		if !strings.Contains(strings.Join(kinds[id], " "), k) {
			t.Errorf("unit %d: findings %v, want %s", id, kinds[id], k)
		}
		if u := rep.Unit(id); u == nil || u.Status != topology.StatusFailed {
			t.Errorf("unit %d: report %+v, want failed", id, u)
		}
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("nothing viable, yet %d writes: %v", len(w), w)
	}
	if _, err := vfiobind.Bind(context.Background(), n.k, nil, units, vfiobind.Options{}); err == nil {
		t.Error("nil tree: no error")
	}
}

func TestNoIOMMURefuses(t *testing.T) {
	spec := pcitest.B300()
	spec.NoIOMMU = true
	n := newNode(t, spec)
	units := n.units(4)
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if units[0].Status != topology.StatusFailed || len(rep.Findings) != 4 || rep.Findings[0].Kind != vfiobind.KindNoGroup {
		t.Errorf("no IOMMU: status %s, findings %v", units[0].Status, rep.Findings)
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("writes without an IOMMU: %v", w)
	}
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
		if u.Status != topology.StatusFailed || rep.Unit(u.ID).Status != topology.StatusFailed {
			t.Errorf("unit %d: %s after cancel", u.ID, u.Status)
		}
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("writes after cancel: %v", w)
	}
}

// Two units whose functions share a group: neither can go to a VM alone, so both are
// refused and neither is touched.
func TestGroupSharedBetweenUnits(t *testing.T) {
	spec := pcitest.B300()
	dsp := findFn(&spec, "gpu-dsp3")
	dsp.ACS = nil
	nvme := *findFn(&spec, "nvme4")
	nvme.Name, nvme.Dev = "nvme-x", 1
	dsp.Below = append(dsp.Below, nvme)
	n := newNode(t, spec)
	units := n.units(2, 3, 4)
	units[2].NVMe = []*pci.Device{n.dev("nvme-x")}
	if _, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{})); err != nil {
		t.Fatal(err)
	}
	for _, u := range units {
		want := topology.StatusFailed
		if u.ID == 2 {
			want = topology.StatusReady
		}
		if u.Status != want {
			t.Errorf("unit %d: %s, want %s (%v)", u.ID, u.Status, want, u.Reasons)
		}
		if u.ID == 2 {
			continue
		}
		if !strings.Contains(strings.Join(u.Reasons, " "), "(unit 3)") || !strings.Contains(strings.Join(u.Reasons, " "), "(unit 4)") {
			t.Errorf("unit %d reasons do not list both units' members: %v", u.ID, u.Reasons)
		}
		for _, d := range u.Functions() {
			if w := n.k.Touched(d.Addr); len(w) != 0 {
				t.Errorf("unit %d %s touched: %v", u.ID, d.Addr, w)
			}
		}
	}
}

// A unit an earlier stage failed (ATS required and missing, say) is left alone.
func TestPreviouslyFailedUnitUntouched(t *testing.T) {
	n := newNode(t, pcitest.B300())
	units := n.units(0, 1)
	units[1].Degrade(topology.StatusFailed, "ats: required and missing")
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	if r := rep.Unit(1); r.Status != topology.StatusFailed || len(r.Functions) != 0 || len(r.Reasons) != 1 {
		t.Errorf("failed unit: %+v", r)
	}
	for _, d := range units[1].Functions() {
		if w := n.k.Touched(d.Addr); len(w) != 0 {
			t.Errorf("%s touched: %v", d.Addr, w)
		}
	}
	if units[0].Status != topology.StatusReady {
		t.Errorf("unit 0: %s", units[0].Status)
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
	bound := 0
	for _, ur := range rep.Units {
		if ur.Status != topology.StatusReady {
			t.Errorf("unit %d: %s %v", ur.ID, ur.Status, ur.Reasons)
		}
		bound += len(ur.Functions)
	}
	if bound != 32 {
		t.Errorf("%d functions bound, want 32", bound)
	}
}

// The audit judges ACS as the ports hold it when binding starts, not as the (earlier)
// scan saw it.
func TestAuditLiveACS(t *testing.T) {
	spec := pcitest.B300()
	findFn(&spec, "cx-dsp-gpu5").ACS = &pcitest.ACS{Cap: pci.ACSIsolation | pci.ACSDT, Ctl: pci.ACSSV | pci.ACSCR | pci.ACSUF}
	n := newNode(t, spec)
	cfg := pci.SysfsConfig{Root: n.Root}
	fixed, broken := n.dev("cx-dsp-gpu5"), n.dev("cx-dsp-gpu6")
	// The acs stage turns RR on above unit 5; something turns RR off above unit 6.
	if _, err := pci.WriteRegister(cfg, fixed.Addr, fixed.ACS.CtlOffset(), 2, uint32(pci.ACSIsolation)); err != nil {
		t.Fatal(err)
	}
	if _, err := pci.WriteRegister(cfg, broken.Addr, broken.ACS.CtlOffset(), 2, uint32(pci.ACSSV|pci.ACSCR|pci.ACSUF)); err != nil {
		t.Fatal(err)
	}
	units := n.units(5, 6)
	stale := vfiobind.Audit(n.tree, units)
	if len(stale) != 1 || stale[0].Addr != fixed.Addr {
		t.Errorf("audit of the scanned tree: %v, want the gap above unit 5 only", stale)
	}
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, vfiobind.Options{Modules: n.k, Clock: &fakeClock{}, Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Findings) != 1 || rep.Findings[0].Addr != broken.Addr || rep.Findings[0].Unit != 6 || !strings.Contains(rep.Findings[0].Detail, "RR off") {
		t.Errorf("live audit: %v, want RR off above unit 6 only", rep.Findings)
	}
	if units[0].Status != topology.StatusReady || units[1].Status != topology.StatusDegraded {
		t.Errorf("statuses %s %s, want ready degraded", units[0].Status, units[1].Status)
	}
	// An unreadable register is a gap, not a pass.
	if err := os.Remove(filepath.Join(n.Root, "sys/bus/pci/devices", fixed.Addr.String(), "config")); err != nil {
		t.Fatal(err)
	}
	f := vfiobind.AuditLive(n.tree, n.units(5), cfg)
	if len(f) != 1 || !strings.Contains(f[0].Detail, "unreadable") {
		t.Errorf("unreadable ACSCtl: %v", f)
	}
}

// TestSRIOVActiveRefusesUnit: a unit whose CX-8 PF has VFs enabled is refused, named with
// its VFs and how to turn them off, and nothing of it is written; the other units bind.
func TestSRIOVActiveRefusesUnit(t *testing.T) {
	spec := pcitest.B300()
	findFn(&spec, "nic2.1").SRIOV = &pcitest.SRIOV{Total: 8, Num: 4, VFDevice: pcitest.DevCX8VF, VFDriver: "mlx5_core"}
	n := newNode(t, spec)
	units := allUnits(n)
	rep, err := vfiobind.Bind(context.Background(), n.k, n.tree, units, n.opts(&fakeClock{}))
	if err != nil {
		t.Fatal(err)
	}
	pf := n.dev("nic2.1")
	var got []vfiobind.Finding
	for _, f := range rep.Findings {
		if f.Kind == vfiobind.KindSRIOVActive {
			got = append(got, f)
		}
	}
	if len(got) != 1 || got[0].Unit != 2 || got[0].Addr != pf.Addr || !got[0].Refuses() ||
		!strings.Contains(got[0].Detail, "4 SR-IOV VFs") || !strings.Contains(got[0].Detail, "sriov_numvfs") {
		t.Fatalf("findings %v, want one sriov-active refusal of unit 2 naming %s", got, pf.Addr)
	}
	if units[2].Status != topology.StatusFailed {
		t.Errorf("unit 2: %s, want failed", units[2].Status)
	}
	for _, d := range units[2].Functions() {
		if w := n.k.Touched(d.Addr); len(w) != 0 {
			t.Errorf("%s of refused unit touched: %v", d.Addr, w)
		}
	}
	for _, o := range units {
		if o.ID != 2 && o.Status == topology.StatusFailed {
			t.Errorf("unit %d failed too: %v", o.ID, o.Reasons)
		}
	}
}
