package topology

import (
	"fmt"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// qemuGuestSpec is the PCI tree the guest kernel showed for a flat two-unit B300 guest
// plan rendered with EmulatedDevice (qemu-tests' guest-plan round trip recorded it):
// root ports 00:10.0 and 00:11.0, each -> x3130-upstream -> four xio3130-downstream
// (no ACS) -> virtio-gpu, two virtio-net, nvme.
func qemuGuestSpec() pcitest.Spec {
	link := pcitest.Link{Speed: 1, Width: 1}
	host := pcitest.Host{Bus: 0, Fns: []pcitest.Fn{{Name: "q35", Vendor: 0x8086, Device: 0x29c0, Class: 0x060000, Conventional: true}}}
	for i := 0; i < 2; i++ {
		n := func(s string) string { return fmt.Sprintf("u%d%s", i, s) }
		ep := func(name string, vendor, device uint16, class uint32) pcitest.Fn {
			return pcitest.Fn{Name: n(name), Vendor: vendor, Device: device, SubVendor: 0x1af4, SubDevice: 0x1100, Class: class,
				Port: pci.PortEndpoint, Link: link}
		}
		var ds []pcitest.Fn
		for k, f := range []pcitest.Fn{ep("gpu", 0x1af4, 0x1050, 0x038000), ep("nic0", 0x1af4, 0x1041, 0x020000),
			ep("nic1", 0x1af4, 0x1041, 0x020000), ep("nvme", 0x1b36, 0x0010, pcitest.ClassNVMe)} {
			ds = append(ds, pcitest.Fn{Name: n(fmt.Sprintf("ds%d", k)), Dev: uint8(k), Vendor: 0x104c, Device: 0x8233,
				Class: pcitest.ClassBridge, Port: pci.PortDownstream, Link: link, Driver: "pcieport", Below: []pcitest.Fn{f}})
		}
		host.Fns = append(host.Fns, pcitest.Fn{Name: n("rp"), Dev: uint8(0x10 + i), Vendor: 0x1b36, Device: 0x000c,
			Class: pcitest.ClassBridge, Port: pci.PortRootPort, Link: link, ACS: &pcitest.ACS{Cap: 0x5f, Ctl: 0x1d}, Driver: "pcieport",
			Below: []pcitest.Fn{{Name: n("us"), Vendor: 0x104c, Device: 0x8232, Class: pcitest.ClassBridge, Port: pci.PortUpstream,
				Link: link, Driver: "pcieport", Below: ds}}})
	}
	host.Fns = append(host.Fns,
		pcitest.Fn{Name: "lpc", Dev: 0x1f, Vendor: 0x8086, Device: 0x2918, Class: 0x060100, Conventional: true},
		pcitest.Fn{Name: "ahci", Dev: 0x1f, Func: 2, Vendor: 0x8086, Device: 0x2922, Class: 0x010601, Conventional: true},
		pcitest.Fn{Name: "smbus", Dev: 0x1f, Func: 3, Vendor: 0x8086, Device: 0x2930, Class: 0x0c0500, Conventional: true})
	return pcitest.Spec{Hosts: []pcitest.Host{host}}
}

// TestQEMUGuestProfile labels the guest tree with qemu-guest and holds the distances it
// measures against the guest matrix the B300 plan expects: the offline half of the
// qemu-tests round trip.
func TestQEMUGuestProfile(t *testing.T) {
	n, gtree := scan(t, qemuGuestSpec())
	gp, err := Builtin("qemu-guest")
	if err != nil {
		t.Fatal(err)
	}
	l, err := Label(gtree, gp)
	if err != nil {
		t.Fatalf("label the guest: %v", err)
	}
	if len(l.Units) != 2 {
		t.Fatalf("%d guest units", len(l.Units))
	}
	for i, u := range l.Units {
		a := func(s string) pci.Address { return n.Addr(fmt.Sprintf("u%d%s", i, s)) }
		if u.GPU.Addr != a("gpu") || len(u.NICs) != 2 || u.NICs[0].Addr != a("nic0") || u.NICs[1].Addr != a("nic1") ||
			len(u.NVMe) != 1 || u.NVMe[0].Addr != a("nvme") {
			t.Errorf("guest unit %d: gpu %s nics %v nvme %v", i, u.GPU.Addr, u.NICs, u.NVMe)
		}
	}
	if r := l.RoleOf(n.Addr("u0ds1")); r != RoleSwitchPort {
		t.Errorf("xio3130-downstream: %s", r)
	}
	got := HostMatrix(l.Units, gp.NVLinks)

	_, htree := reference(t, "b300")
	hl := mustLabel(t, htree, "b300")
	g, err := GuestPlan(hl.Units, GuestOptions{Units: []UnitID{0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	want := g.Matrix(0)
	if fmt.Sprint(got.Names) != fmt.Sprint(want.Names) || fmt.Sprint(got.Addrs) != fmt.Sprint(want.Addrs) {
		t.Fatalf("guest matrix %v at %v, plan %v at %v", got.Names, got.Addrs, want.Names, want.Addrs)
	}
	for i := range want.Cells {
		for j := range want.Cells[i] {
			if got.Cells[i][j] != want.Cells[i][j] {
				t.Errorf("%s-%s: guest %s, plan %s", want.Names[i], want.Names[j], got.Cells[i][j], want.Cells[i][j])
			}
		}
	}
	// Written out: GPU0-NIC0 one switch, GPU0-NIC2 (unit 1) through the host bridge.
	if got.At(n.Addr("u0gpu"), n.Addr("u0nic1")) != PIX || got.At(n.Addr("u0gpu"), n.Addr("u1nic0")) != PHB {
		t.Errorf("guest matrix:\n%s", got.Text())
	}
}

func TestEmulatedDevice(t *testing.T) {
	for role, want := range map[Role]string{
		RoleGPU:        "virtio-gpu-pci,id=u0f0,bus=u0ds0,addr=0x0,ats=on,iommu_platform=on,disable-legacy=on",
		RoleGPUNIC:     "virtio-net-pci,id=u0f0,bus=u0ds0,addr=0x0,ats=on,iommu_platform=on,disable-legacy=on,romfile=",
		RoleDataDirect: "virtio-net-pci,id=u0f0,bus=u0ds0,addr=0x0,ats=on,iommu_platform=on,disable-legacy=on,romfile=",
		RoleGPUNVMe:    "nvme,id=u0f0,bus=u0ds0,addr=0x0,serial=u0f0",
	} {
		if got := EmulatedDevice(GuestFunction{Role: role, ID: "u0f0"}, "u0ds0"); got != want {
			t.Errorf("%s: %s", role, got)
		}
	}
}

// TestPlanGuestPlacement: inside an existing domain the plan gives each unit the switch
// the fresh plan gives it (root port, upstream, one downstream port per function, the
// same guest buses below the root port's), its controllers take the free indexes first
// and then those above, a unit goes under the expander of its guest node after what that
// expander holds, and expander bus numbers run down from 0xff above every index.
func TestPlanGuestPlacement(t *testing.T) {
	src := func(id UnitID, node int) GuestSource {
		s := GuestSource{ID: id, Status: StatusReady, NUMANode: node}
		for _, r := range []Role{RoleGPU, RoleGPUNIC, RoleGPUNIC, RoleGPUNVMe} {
			s.Functions = append(s.Functions, HostFunction{Addr: pci.Address{Bus: uint8(0x10*int(id) + len(s.Functions))}, Role: r})
		}
		return s
	}
	units := []GuestSource{src(0, 0), src(4, 1)}
	fresh, err := PlanGuest(units, GuestOptions{})
	if err != nil {
		t.Fatal(err)
	}
	in := &Placement{Free: []int{2, 5}, FirstIndex: 9, GuestNodes: map[int]int{0: 1, 1: 0},
		Expanders: []PlacedExpander{{Index: 3, GuestNUMA: 1, NextSlot: 2, Reserved: 2}}}
	g, err := PlanGuest(units, GuestOptions{In: in})
	if err != nil {
		t.Fatal(err)
	}
	if !g.Placed || !g.NUMA || len(g.Units) != 2 || len(g.Expanders) != 2 {
		t.Fatalf("placed plan: %+v", g)
	}
	kept, added := g.Expanders[0], g.Expanders[1]
	// Kept: index 3, holds gpu0 (host node 0 -> guest 1): 1 + 2 reserved + 6 buses.
	if !kept.Kept || kept.Index != 3 || kept.BusNr != 0xff-9+1 || kept.NUMANode != 1 {
		t.Errorf("kept expander %+v", kept)
	}
	// Added for guest node 0 (gpu4): the first free index, below the kept one's range.
	if added.Kept || added.Index != 2 || added.NUMANode != 0 || added.BusNr != kept.BusNr-7 {
		t.Errorf("added expander %+v (kept at %#x)", added, kept.BusNr)
	}
	u0, u4 := g.Units[0], g.Units[1]
	if u0.Expander != "pxb3" || u0.RootPort.Dev != 2 || u0.RootPort.Parent != 3 || u0.RootPort.Secondary != kept.BusNr+3 || u0.GuestNUMA != 1 {
		t.Errorf("gpu0 root port %+v on %s node %d", u0.RootPort, u0.Expander, u0.GuestNUMA)
	}
	if u4.RootPort.Parent != 2 || u4.RootPort.Dev != 0 || u4.RootPort.Secondary != added.BusNr+1 {
		t.Errorf("gpu4 root port %+v", u4.RootPort)
	}
	// Indexes: 2 (added expander) and 5 from Free, then 9 upward, each once, a child's
	// above its parent's.
	seen := map[int]bool{}
	var idx []int
	for _, c := range g.LibvirtControllers() {
		i := int(*c.Index)
		if seen[i] || i == 3 {
			t.Errorf("index %d given twice or the kept expander's", i)
		}
		seen[i] = true
		idx = append(idx, i)
		if c.Alias == nil || c.PCI.Target != nil && (c.PCI.Target.Chassis != nil || c.PCI.Target.Port != nil) {
			t.Errorf("controller %d: alias %v, chassis/port %+v: want an alias and no chassis/port", i, c.Alias, c.PCI.Target)
		}
		if c.Address != nil && int(*c.Address.PCI.Bus) >= i && int(*c.Address.PCI.Bus) != 3 {
			t.Errorf("controller %d plugs into %d", i, *c.Address.PCI.Bus)
		}
	}
	if fmt.Sprint(idx[:3]) != "[2 5 9]" || len(idx) != 1+2*6 {
		t.Errorf("indexes %v", idx)
	}
	// The switch below each root port is the fresh plan's.
	for i, u := range g.Units {
		f := fresh.Units[i]
		for k, fn := range u.Functions {
			d := int(fn.Addr.Bus) - u.RootPort.Secondary
			fd := int(f.Functions[k].Addr.Bus) - f.RootPort.Secondary
			if d != fd || fn.Port.Dev != f.Functions[k].Port.Dev || fn.Role != f.Functions[k].Role || fn.HostID != f.Functions[k].HostID {
				t.Errorf("%s function %d: %+v, fresh plan %+v", u.Unit, k, fn, f.Functions[k])
			}
		}
	}
	// A host node the domain has no cell for is an error naming the unit.
	in.GuestNodes = map[int]int{0: 0}
	if _, err := PlanGuest(units, GuestOptions{In: in}); err == nil || !strings.Contains(err.Error(), "gpu4") {
		t.Errorf("no cell for host node 1: %v", err)
	}
}
