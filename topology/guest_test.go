package topology

import (
	"fmt"
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
