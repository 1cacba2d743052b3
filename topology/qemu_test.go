package topology

import (
	"bytes"
	"context"
	"encoding/xml"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// qemuSpec is the qemu-tests topology (qemu-tests/README.md's table, two units) as pcitest
// builds it, with the IDs and ACS registers QEMU 7.2 shows (QEMU.md): pcie-root-port
// advertises SV TB RR CR UF DT and the kernel leaves SV RR CR UF on.
func qemuSpec() pcitest.Spec { return qemuVariant(false, false) }

// qemuVariant adds qemu-tests' scenarios to unit 1: sharedGroup puts a pcie-pci-bridge
// with an e1000 passthrough stand-in (01.0) and a management e1000 (02.0) on the outer
// switch's port 01.0; noACSPort puts the NVMe below an xio3130-downstream port.
func qemuVariant(sharedGroup, noACSPort bool) pcitest.Spec {
	rpACS := &pcitest.ACS{Cap: 0x5f, Ctl: 0x1d}
	link := pcitest.Link{Speed: 1, Width: 1}
	rp := func(name string, dev uint8, below ...pcitest.Fn) pcitest.Fn {
		return pcitest.Fn{Name: name, Dev: dev, Vendor: 0x1b36, Device: 0x000c, Class: pcitest.ClassBridge, Port: pci.PortRootPort,
			Link: link, ACS: rpACS, Driver: "pcieport", Below: below}
	}
	usp := func(name string, below ...pcitest.Fn) pcitest.Fn {
		return pcitest.Fn{Name: name, Vendor: 0x104c, Device: 0x8232, Class: pcitest.ClassBridge, Port: pci.PortUpstream,
			Link: link, Driver: "pcieport", Below: below}
	}
	ep := func(name string, fn uint8, vendor, device uint16, class uint32, ats bool) pcitest.Fn {
		f := pcitest.Fn{Name: name, Func: fn, Vendor: vendor, Device: device, SubVendor: 0x1af4, SubDevice: 0x1100, Class: class,
			Port: pci.PortEndpoint, Link: link}
		if ats {
			f.ATS = &pcitest.ATS{}
		}
		return f
	}
	host := pcitest.Host{Bus: 0, NUMA: 0, Fns: []pcitest.Fn{
		{Name: "q35", Vendor: 0x8086, Device: 0x29c0, Class: 0x060000, Conventional: true},
		rp("rp-mgmt", 2, ep("mgmt0", 0, 0x8086, 0x10d3, 0x020000, false)),
	}}
	for i := 0; i < 2; i++ {
		n := func(s string) string { return fmt.Sprintf("u%d%s", i, s) }
		sw := usp(n("sw"),
			rp(n("p0"), 0, usp(n("cx"),
				rp(n("cxp0"), 0, ep(n("pf0"), 0, 0x1af4, 0x1041, 0x020000, true), ep(n("pf1"), 1, 0x1af4, 0x1041, 0x020000, true)),
				rp(n("cxp2"), 2, usp(n("gs"), rp(n("gp"), 0, ep(n("gpu"), 0, 0x1af4, 0x1050, 0x038000, true)))))),
			rp(n("p2"), 2, ep(n("nvme"), 0, 0x1b36, 0x0010, pcitest.ClassNVMe, false)))
		if i == 1 && noACSPort {
			p2 := &sw.Below[1]
			p2.Device, p2.Port, p2.ACS = 0x8233, pci.PortDownstream, nil
		}
		if i == 1 && sharedGroup {
			e1000 := func(name string, dev uint8) pcitest.Fn {
				return pcitest.Fn{Name: name, Dev: dev, Vendor: 0x8086, Device: 0x100e, SubVendor: 0x1af4, SubDevice: 0x1100,
					Class: 0x020000, Conventional: true}
			}
			// Firmware numbers buses in slot order: port 01.0 goes before the NVMe's 02.0.
			p1 := rp(n("p1"), 1, pcitest.Fn{Name: n("ppb"), Vendor: 0x1b36, Device: 0x000e,
				Class: pcitest.ClassBridge, Port: pci.PortPCIeToPCI, Link: link, Below: []pcitest.Fn{e1000(n("pt"), 1), e1000("mgmt1", 2)}})
			sw.Below = []pcitest.Fn{sw.Below[0], p1, sw.Below[1]}
		}
		host.Fns = append(host.Fns, rp(n("rp"), uint8(3+i), sw))
	}
	host.Fns = append(host.Fns,
		pcitest.Fn{Name: "disk", Dev: 0x10, Vendor: 0x1af4, Device: 0x1042, Class: 0x010000, Port: pci.PortEndpoint, Link: link},
		pcitest.Fn{Name: "lpc", Dev: 0x1f, Vendor: 0x8086, Device: 0x2918, Class: 0x060100, Conventional: true},
		pcitest.Fn{Name: "ahci", Dev: 0x1f, Func: 2, Vendor: 0x8086, Device: 0x2922, Class: 0x010601, Conventional: true},
		pcitest.Fn{Name: "smbus", Dev: 0x1f, Func: 3, Vendor: 0x8086, Device: 0x2930, Class: 0x0c0500, Conventional: true})
	return pcitest.Spec{Hosts: []pcitest.Host{host}}
}

func TestQEMUProfile(t *testing.T) {
	n, tree := reference(t, "qemu")
	p, _ := Builtin("qemu")
	if !p.UnlabeledIsError {
		t.Error("the qemu profile must make unlabeled functions an error")
	}
	l, err := Label(tree, p)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Units) != 2 {
		t.Fatalf("%d units", len(l.Units))
	}
	// The BDFs qemu-tests/README.md recorded inside the guest.
	for name, bdf := range map[string]string{"mgmt0": "01:00.0", "u0cxp0": "05:00.0", "u0gpu": "09:00.0", "u0nvme": "0a:00.0",
		"u1cxp0": "0e:00.0", "u1pf1": "0f:00.1", "u1gpu": "12:00.0", "u1nvme": "13:00.0"} {
		if got := n.Addr(name).String(); got != "0000:"+bdf {
			t.Errorf("%s at %s, README says %s", name, got, bdf)
		}
	}
	for i, u := range l.Units {
		a := func(s string) pci.Address { return n.Addr(fmt.Sprintf("u%d%s", i, s)) }
		if u.GPU.Addr != a("gpu") || len(u.NICs) != 2 || u.NICs[0].Addr != a("pf0") || u.NICs[1].Addr != a("pf1") ||
			len(u.NVMe) != 1 || u.NVMe[0].Addr != a("nvme") {
			t.Errorf("unit %d: gpu %s nics %v nvme %v", i, u.GPU.Addr, u.NICs, u.NVMe)
		}
	}
	if r := l.RoleOf(n.Addr("mgmt0")); r != RoleMgmtNIC {
		t.Errorf("e1000e: %s", r)
	}
	// The NIC port is a Root Port by type; the plan finds it by position.
	ports := ACSPlan(l.Units)
	var dt []pci.Address
	for _, pt := range ports {
		if pt.Flags&pci.ACSDT != 0 {
			dt = append(dt, pt.Addr)
		}
	}
	if len(dt) != 2 || dt[0] != n.Addr("u0cxp0") || dt[1] != n.Addr("u1cxp0") {
		t.Errorf("DT ports %v, want u0cxp0 u1cxp0", dt)
	}
	if m := HostMatrix(l.Units, p.NVLinks); m.At(n.Addr("u0gpu"), n.Addr("u0pf0")) != PXB || m.At(n.Addr("u0gpu"), n.Addr("u1pf0")) != PHB {
		t.Errorf("qemu host matrix:\n%s", m.Text())
	}
}

func TestQEMUScenarios(t *testing.T) {
	n, tree := scan(t, qemuVariant(true, true))
	p, _ := Builtin("qemu")
	l, err := Label(tree, p)
	if err != nil {
		t.Fatal(err)
	}
	if n.Addr("u1pt").String() != "0000:14:01.0" || n.Addr("u1nvme").String() != "0000:15:00.0" {
		t.Errorf("shared-group BDFs differ from qemu-tests/README.md: %s %s", n.Addr("u1pt"), n.Addr("u1nvme"))
	}
	if r := l.Of(n.Addr("u1pt")); r.Role != RoleGPUNIC || r.Unit != 1 {
		t.Errorf("passthrough e1000: %+v", r)
	}
	if r := l.Of(n.Addr("mgmt1")); r.Role != RoleMgmtNIC || r.Unit != -1 {
		t.Errorf("management e1000 behind the unit's bridge: %+v", r)
	}
	// Both e1000s sit behind one PCIe-to-PCI bridge: one IOMMU group (vfiobind refuses
	// the unit; here only the fact the refusal rests on).
	if a, b := tree.Lookup(n.Addr("u1pt")), tree.Lookup(n.Addr("mgmt1")); a.IOMMUGroup != b.IOMMUGroup {
		t.Errorf("groups %d %d", a.IOMMUGroup, b.IOMMUGroup)
	}
	// The xio3130 port above unit 1's NVMe has no ACS: the plan says unit 1 must fail
	// (package decision fails it), and nothing of unit 0.
	var failing []string
	for _, pt := range ACSPlan(l.Units) {
		if pt.Verdict != "" {
			failing = append(failing, fmt.Sprintf("unit %d %s: %s", pt.Unit, pt.Verdict, pt.Problem))
		}
	}
	if want := "unit 1 failed: acs " + n.Addr("u1p2").String() + " (nvme-port): no ACS capability"; len(failing) != 1 || failing[0] != want {
		t.Errorf("port verdicts %q, want [%q]", failing, want)
	}
}

func TestGuestPlanB300(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	g, err := GuestPlan(l.Units, GuestOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := g.Matrix(18)
	gpuNIC, sameUnit, other := 0, 0, 0
	for _, u := range g.Units {
		var gpu pci.Address
		var nics []pci.Address
		for _, f := range u.Functions {
			switch f.Role {
			case RoleGPU:
				gpu = f.Addr
			case RoleGPUNIC:
				nics = append(nics, f.Addr)
			}
		}
		for _, nic := range nics {
			if got := m.At(gpu, nic); got != PIX {
				t.Errorf("unit %d guest GPU-NIC %s", u.Unit, got)
			}
			gpuNIC++
		}
		if got := m.At(nics[0], nics[1]); got != PIX {
			t.Errorf("unit %d guest NIC-NIC %s", u.Unit, got)
		}
		sameUnit++
		for _, o := range g.Units {
			if o.Unit != u.Unit {
				if got := m.At(gpu, o.Functions[1].Addr); got != PHB {
					t.Errorf("guest GPU%d-NIC of unit %d: %s, want PHB", u.Unit, o.Unit, got)
				}
				other++
			}
		}
	}
	if gpuNIC != 16 || sameUnit != 8 || other != 56 {
		t.Errorf("checked %d GPU-NIC, %d NIC pairs, %d other", gpuNIC, sameUnit, other)
	}

	gn, err := GuestPlan(l.Units, GuestOptions{NUMA: true})
	if err != nil {
		t.Fatal(err)
	}
	mn := gn.Matrix(18)
	u0, u1, u4 := gn.Units[0], gn.Units[1], gn.Units[4]
	for _, c := range []struct {
		a, b GuestFunction
		want string
	}{
		{u0.Functions[0], u0.Functions[1], PIX},
		{u0.Functions[0], u1.Functions[1], NODE},
		{u0.Functions[0], u4.Functions[2], SYS},
	} {
		if got := mn.At(c.a.Addr, c.b.Addr); got != c.want {
			t.Errorf("numa guest %s-%s = %s, want %s", c.a.ID, c.b.ID, got, c.want)
		}
	}
}

func TestGuestUnitsSubset(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	g, err := GuestPlan(l.Units, GuestOptions{Units: []UnitID{5, 2}})
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Units) != 2 || g.Units[0].Unit != 2 || g.Units[1].Unit != 5 {
		t.Errorf("units %+v", g.Units)
	}
	if _, err := GuestPlan(l.Units, GuestOptions{Units: []UnitID{9}}); err == nil || !strings.Contains(err.Error(), "no unit gpu9") {
		t.Errorf("unknown unit: %v", err)
	}
	l.Units[3].Degrade(StatusFailed, "test")
	if _, err := GuestPlan(l.Units, GuestOptions{Units: []UnitID{3}}); err == nil || !strings.Contains(err.Error(), "gpu3 is failed") {
		t.Errorf("failed unit: %v", err)
	}
}

func TestQEMUAcceptsRendering(t *testing.T) {
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Fatalf("qemu-system-x86_64 not installed (make installs it via image/deps.sh): %v", err)
	}
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	for _, numa := range []bool{false, true} {
		g, err := GuestPlan(l.Units, GuestOptions{NUMA: numa})
		if err != nil {
			t.Fatal(err)
		}
		args := []string{"-machine", "q35", "-accel", "tcg", "-nodefaults", "-display", "none", "-S", "-monitor", "stdio", "-m", "256M"}
		if numa {
			for host, node := range g.GuestNodes {
				_ = host
				args = append(args, "-object", fmt.Sprintf("memory-backend-ram,id=mem%d,size=128M", node),
					"-numa", fmt.Sprintf("node,nodeid=%d,memdev=mem%d", node, node))
			}
		}
		args = append(args, g.QEMUArgs(EmulatedDevice)...)
		qtree := runQEMU(t, qemu, args)
		for _, u := range g.Units {
			want := []string{u.RootPort.ID, u.Upstream.ID}
			for _, f := range u.Functions {
				want = append(want, f.Port.ID, f.ID)
			}
			for _, id := range want {
				if !strings.Contains(qtree, fmt.Sprintf("id %q", id)) {
					t.Errorf("numa=%v: QEMU's device tree lacks %s", numa, id)
				}
			}
		}
		if numa && strings.Count(qtree, "dev: pxb-pcie") != 8 {
			t.Errorf("numa: %d pxb-pcie in QEMU's tree, want 8", strings.Count(qtree, "dev: pxb-pcie"))
		}
	}
	// The harness tells refusal from acceptance: two ports with one chassis/slot pair.
	g, _ := GuestPlan(l.Units, GuestOptions{Units: []UnitID{0, 1}})
	g.Units[1].RootPort.Chassis = g.Units[0].RootPort.Chassis
	bad := append([]string{"-machine", "q35", "-accel", "tcg", "-nodefaults", "-display", "none", "-S", "-monitor", "stdio"}, g.QEMUArgs(EmulatedDevice)...)
	if _, err := startQEMU(qemu, bad); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("duplicate chassis/slot accepted: %v", err)
	}
}

// runQEMU starts QEMU paused, asks the monitor for its device tree and quits; it fails
// the test when QEMU refuses the arguments. quit is sent only once the answer to a later
// command (info status) has arrived: QEMU drops monitor output still queued at exit.
func runQEMU(t *testing.T, qemu string, args []string) string {
	t.Helper()
	out, err := startQEMU(qemu, args)
	if err != nil {
		t.Fatalf("%v\nargs: %s", err, strings.Join(args, " "))
	}
	return out
}

func startQEMU(qemu string, args []string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, qemu, args...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", err
	}
	var errb bytes.Buffer
	cmd.Stderr = &errb
	if err := cmd.Start(); err != nil {
		return "", err
	}
	const marker = "VM status: paused"
	var out bytes.Buffer
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 64<<10)
		sent := false
		for {
			n, err := stdout.Read(buf)
			out.Write(buf[:n])
			if !sent && bytes.Contains(out.Bytes(), []byte(marker)) {
				io.WriteString(stdin, "quit\n")
				sent = true
			}
			if err != nil {
				return
			}
		}
	}()
	io.WriteString(stdin, "info qtree\ninfo status\n")
	<-done
	err = cmd.Wait()
	if ctx.Err() != nil {
		return "", fmt.Errorf("qemu did not reach the paused state and quit within the timeout; stderr: %s", errb.String())
	}
	if err != nil {
		return "", fmt.Errorf("qemu refused the rendering: %v: %s", err, errb.String())
	}
	if !bytes.Contains(out.Bytes(), []byte(marker)) {
		return "", fmt.Errorf("qemu quit before reporting its paused state: %s", errb.String())
	}
	return out.String(), nil
}

// TestGuestAddressesAsFirmwareNumbers boots the rendering into SeaBIOS (no guest OS) and
// reads back where firmware put each stand-in: the guest addresses the plan predicts
// (and the NCCL topology file names) must be the ones the guest gets.
func TestGuestAddressesAsFirmwareNumbers(t *testing.T) {
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Fatalf("qemu-system-x86_64 not installed (make installs it via image/deps.sh): %v", err)
	}
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	for _, numa := range []bool{false, true} {
		g, err := GuestPlan(l.Units, GuestOptions{Units: []UnitID{0, 1, 4}, NUMA: numa})
		if err != nil {
			t.Fatal(err)
		}
		args := []string{"-machine", "q35", "-accel", "tcg", "-nodefaults", "-display", "none", "-monitor", "stdio", "-m", "256M"}
		if numa {
			for _, node := range g.GuestNodes {
				args = append(args, "-object", fmt.Sprintf("memory-backend-ram,id=mem%d,size=128M", node),
					"-numa", fmt.Sprintf("node,nodeid=%d,memdev=mem%d", node, node))
			}
		}
		args = append(args, g.QEMUArgs(EmulatedDevice)...)
		var want []pci.Address
		for _, u := range g.Units {
			want = append(want, u.Upstream.Addr)
			for _, f := range u.Functions {
				want = append(want, f.Addr)
			}
		}
		seen, err := firmwarePCI(qemu, args, want)
		if err != nil {
			t.Errorf("numa=%v: %v", numa, err)
		}
		for _, u := range g.Units {
			for _, f := range u.Functions {
				want := map[Role]string{RoleGPU: "1af4:1050", RoleGPUNIC: "1af4:1041", RoleGPUNVMe: "1b36:0010"}[f.Role]
				if got := seen[f.Addr]; got != want {
					t.Errorf("numa=%v: %s (%s) predicted at %s; firmware put %q there", numa, f.ID, f.Role, f.Addr, got)
				}
			}
			if got := seen[u.Upstream.Addr]; got != "104c:8232" {
				t.Errorf("numa=%v: upstream port of unit %d predicted at %s; firmware put %q there", numa, u.Unit, u.Upstream.Addr, got)
			}
		}
	}
}

// firmwarePCI runs the VM until SeaBIOS has numbered the buses (polling the monitor's
// info pci until something sits at every wanted address, or a deadline) and returns
// what sits at each address. A plan that predicts wrongly ends in the deadline.
func firmwarePCI(qemu string, args []string, want []pci.Address) (map[pci.Address]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, qemu, args...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var errb bytes.Buffer
	cmd.Stderr = &errb
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	defer cmd.Wait()
	defer cmd.Process.Kill()
	lines := make(chan string, 1024)
	go func() {
		defer close(lines)
		buf := make([]byte, 64<<10)
		var acc []byte
		for {
			n, err := stdout.Read(buf)
			acc = append(acc, buf[:n]...)
			for {
				i := bytes.IndexByte(acc, '\n')
				if i < 0 {
					break
				}
				lines <- strings.TrimSpace(string(acc[:i]))
				acc = acc[i+1:]
			}
			if err != nil {
				return
			}
		}
	}()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	seen := map[pci.Address]string{}
	var cur *pci.Address
	for {
		select {
		case <-ctx.Done():
			var missing []string
			for _, a := range want {
				if seen[a] == "" {
					missing = append(missing, a.String())
				}
			}
			return seen, fmt.Errorf("nothing at %s after the timeout; stderr: %s", strings.Join(missing, " "), errb.String())
		case <-tick.C:
			io.WriteString(stdin, "info pci\n")
		case ln, ok := <-lines:
			if !ok {
				return nil, fmt.Errorf("qemu exited: %s", errb.String())
			}
			var bus, dev, fn int
			if k, _ := fmt.Sscanf(ln, "Bus %d, device %d, function %d:", &bus, &dev, &fn); k == 3 {
				a := pci.Address{Bus: uint8(bus), Device: uint8(dev), Function: uint8(fn)}
				cur = &a
				continue
			}
			if i := strings.Index(ln, "PCI device "); i >= 0 && cur != nil {
				seen[*cur] = strings.TrimSpace(ln[i+len("PCI device "):])
				cur = nil
				all := true
				for _, a := range want {
					all = all && seen[a] != ""
				}
				if all {
					io.WriteString(stdin, "quit\n")
					return seen, nil
				}
			}
		}
	}
}

func TestLibvirtWellFormed(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	for _, numa := range []bool{false, true} {
		g, err := GuestPlan(l.Units, GuestOptions{NUMA: numa})
		if err != nil {
			t.Fatal(err)
		}
		b, err := g.Libvirt()
		if err != nil {
			t.Fatal(err)
		}
		dec := xml.NewDecoder(bytes.NewReader(b))
		for {
			_, err := dec.Token()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("libvirt xml not well-formed: %v\n%s", err, b)
			}
		}
		var d libvirtxml.DomainDeviceList
		if err := xml.Unmarshal(b, &d); err != nil {
			t.Fatal(err)
		}
		if len(d.Hostdevs) != 32 {
			t.Errorf("%d hostdevs, want 32", len(d.Hostdevs))
		}
		idx := map[uint]bool{}
		for _, c := range d.Controllers {
			if c.Index == nil || idx[*c.Index] {
				t.Errorf("controller %+v: no index, or its index twice", c)
				continue
			}
			idx[*c.Index] = true
		}
		wantCtl := 8 * (2 + 4)
		if numa {
			wantCtl += 8
		}
		if len(d.Controllers) != wantCtl {
			t.Errorf("numa=%v: %d controllers, want %d", numa, len(d.Controllers), wantCtl)
		}
	}
}

func TestNCCLTopology(t *testing.T) {
	n, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	g, err := GuestPlan(l.Units, GuestOptions{NUMA: true})
	if err != nil {
		t.Fatal(err)
	}
	b, err := g.NCCLTopology()
	if err != nil {
		t.Fatal(err)
	}
	var sys ncclSystem
	if err := xml.Unmarshal(b, &sys); err != nil {
		t.Fatal(err)
	}
	if len(sys.CPUs) != 2 || len(sys.CPUs[0].PCIs) != 4 || len(sys.CPUs[1].PCIs) != 4 {
		t.Fatalf("shape: %s", b)
	}
	sw := sys.CPUs[0].PCIs[0]
	// Host links, not QEMU's 2.5 GT/s x1: Gen5 x16 to the CPU, Gen6 x16 GPU and NICs.
	if sw.LinkSpeed != "32.0 GT/s PCIe" || sw.LinkWidth != 16 || sw.BusID != g.Units[0].Upstream.Addr.String() {
		t.Errorf("switch node %+v", sw)
	}
	if len(sw.PCIs) != 3 {
		t.Fatalf("switch holds %d functions, want GPU + 2 NICs", len(sw.PCIs))
	}
	gpu := sw.PCIs[0]
	host := tree.Lookup(n.Addr("gpu0"))
	if gpu.Class != "0x030200" || gpu.Vendor != "0x10de" || gpu.Device != "0x3182" || gpu.LinkSpeed != "64.0 GT/s PCIe" ||
		gpu.LinkWidth != 16 || gpu.BusID != g.Units[0].Functions[0].Addr.String() || host.DeviceID != 0x3182 {
		t.Errorf("gpu node %+v", gpu)
	}
}
