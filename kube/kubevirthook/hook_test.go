package kubevirthook

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	hooksinfo "kubevirt.io/kubevirt/pkg/hooks/info"
	hooksv1alpha3 "kubevirt.io/kubevirt/pkg/hooks/v1alpha3"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/hypervisor/libvirttest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci"
)

// launcher plays virt-launcher's hook manager (pkg/hooks/manager.go): a fresh insecure
// gRPC connection over the unix socket per call, Info with a 1 s timeout, then the
// v1alpha3 Callbacks.
type launcher struct{ socket string }

// ncclDiskDir is the hook's --nccl-dir as the compute container sees it (the first
// sidecar's); libvirt defines a domain without opening its disks.
const ncclDiskDir = "/var/run/kubevirt-hooks/hook-sidecar-0/passage"

func startHook(t *testing.T, c Config) *launcher {
	t.Helper()
	// virt-launcher finds sockets one directory below /var/run/kubevirt-hooks.
	sock := filepath.Join(t.TempDir(), "passage", "passage.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, sock, &Server{Config: c, NCCLDir: filepath.Dir(sock), NCCLDiskDir: ncclDiskDir})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no hook socket")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return &launcher{socket: sock}
}

func (l *launcher) conn(t *testing.T) *grpc.ClientConn {
	c, err := grpc.NewClient("unix://"+l.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (l *launcher) info(t *testing.T) *hooksinfo.InfoResult {
	t.Helper()
	c := l.conn(t)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	r, err := hooksinfo.NewInfoClient(c).Info(ctx, &hooksinfo.InfoParams{})
	if err != nil {
		t.Fatalf("Info: %v", err)
	}
	return r
}

func (l *launcher) define(t *testing.T, dom []byte) ([]byte, error) {
	t.Helper()
	c := l.conn(t)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vmi, _ := json.Marshal(map[string]any{"metadata": map[string]string{"name": "vm", "namespace": "tenant"}})
	r, err := hooksv1alpha3.NewCallbacksClient(c).OnDefineDomain(ctx, &hooksv1alpha3.OnDefineDomainParams{DomainXML: dom, Vmi: vmi})
	if err != nil {
		return nil, err
	}
	return r.GetDomainXML(), nil
}

// unitView is one unit as the guest will have it, read from a domain.
type unitView struct {
	unit    string
	node    int    // guest NUMA node of its expander, -1 none
	busNr   int    // its expander's busNr
	switch_ string // guest bus of the switch's internal bus
	fns     []string
}

func (u unitView) String() string {
	return fmt.Sprintf("%s node %d pxb %#x switch bus %s: %s", u.unit, u.node, u.busNr, u.switch_, strings.Join(u.fns, " "))
}

// units reads each passage unit's place in the domain and checks its shape: every
// function at device 0 of a downstream port of its own, all of one upstream port, on a
// root port, on an expander or (without guest NUMA) on pcie.0.
func units(t *testing.T, m *manifest.Manifest, dom []byte) []string {
	t.Helper()
	d := mustParse(t, dom)
	buses, err := GuestBuses(dom)
	if err != nil {
		t.Fatal(err)
	}
	ctl := map[int]libvirtxml.DomainController{}
	for _, c := range d.Devices.Controllers {
		if c.Type == "pci" && c.Index != nil {
			ctl[int(*c.Index)] = c
		}
	}
	parent := func(i int) (libvirtxml.DomainController, bool) {
		c, ok := ctl[pciBus(ctl[i].Address)]
		return c, ok
	}
	owner := map[pci.Address][2]string{}
	for _, u := range m.Units {
		for _, f := range u.Functions {
			a, _ := pci.ParseAddress(f.BDF)
			owner[a] = [2]string{u.ID, f.Role}
		}
	}
	views := map[string]*unitView{}
	upOf := map[string]int{}
	seenDS := map[int]bool{}
	for _, h := range d.Devices.Hostdevs {
		a := srcOf(h)
		o, ok := owner[a]
		if !ok {
			continue
		}
		bus := pciBus(h.Address)
		s, f := pciSlot(h.Address)
		ds, ok := ctl[bus]
		if !ok || ds.Model != "pcie-switch-downstream-port" || s != 0 || f != 0 || seenDS[bus] {
			t.Fatalf("%s (%s %s) at bus %d %d.%d: want device 0 of a downstream port of its own", a, o[0], o[1], bus, s, f)
		}
		seenDS[bus] = true
		us, ok := parent(bus)
		if !ok || us.Model != "pcie-switch-upstream-port" {
			t.Fatalf("%s: downstream port %d not on an upstream port", a, bus)
		}
		rp, ok := parent(int(*us.Index))
		if !ok || rp.Model != "pcie-root-port" {
			t.Fatalf("%s: switch %d not on a root port", a, *us.Index)
		}
		// Without guest NUMA the root port is on pcie.0 (index 0: "pxb 0" in the view).
		pxb, ok := parent(int(*rp.Index))
		if pciBus(rp.Address) == 0 {
			pxb, ok = libvirtxml.DomainController{Model: "pcie-root"}, true
		}
		if !ok || pxb.Model != "pcie-expander-bus" && pxb.Model != "pcie-root" {
			t.Fatalf("%s: root port %d neither on an expander nor on pcie.0", a, *rp.Index)
		}
		v := views[o[0]]
		if v == nil {
			v = &unitView{unit: o[0], node: -1, switch_: fmt.Sprintf("%#x", buses[int(*us.Index)])}
			if pxb.Model == "pcie-expander-bus" {
				v.busNr = int(*pxb.PCI.Target.BusNr)
				if pxb.PCI.Target.NUMANode != nil {
					v.node = int(*pxb.PCI.Target.NUMANode)
				}
			}
			views[o[0]] = v
			upOf[o[0]] = int(*us.Index)
		} else if upOf[o[0]] != int(*us.Index) {
			t.Fatalf("%s (%s): under switch %d, the unit's other functions under %d", a, o[0], *us.Index, upOf[o[0]])
		}
		v.fns = append(v.fns, fmt.Sprintf("%s=%s@%02x:00.0", a, o[1], buses[bus]))
	}
	var out []string
	for _, v := range views {
		sort.Strings(v.fns)
		out = append(out, v.String())
	}
	sort.Strings(out)
	return out
}

// validate runs libvirt's virt-xml-validate on dom.
func validate(t *testing.T, dom []byte) {
	t.Helper()
	f := filepath.Join(t.TempDir(), "domain.xml")
	if err := os.WriteFile(f, dom, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("virt-xml-validate", f, "domain").CombinedOutput(); err != nil {
		t.Fatalf("virt-xml-validate: %v\n%s\n%s", err, out, dom)
	}
}

// defineAndRead defines dom on the test's libvirtd and returns libvirt's read-back of it
// as virt-launcher keeps it (through api.DomainSpec).
func defineAndRead(t *testing.T, uri string, dom []byte) []byte {
	t.Helper()
	f := filepath.Join(t.TempDir(), "domain.xml")
	if err := os.WriteFile(f, dom, 0o644); err != nil {
		t.Fatal(err)
	}
	libvirttest.TCG.Define(t, uri, f)
	// libvirt keeps the type it was defined with, which a host where KVM is not proven
	// makes qemu (libvirttest.Host.Define): the read-back gets dom's own back, so what is
	// compared and kept in testdata is the hook's domain, not a fact of this host.
	var asked, back api.DomainSpec
	if err := xml.Unmarshal(dom, &asked); err != nil {
		t.Fatalf("api.DomainSpec: %v\n%s", err, dom)
	}
	if err := xml.Unmarshal([]byte(libvirttest.Virsh(t, uri, "dumpxml", "--inactive", "tenant_vm")), &back); err != nil {
		t.Fatalf("dumpxml: api.DomainSpec: %v", err)
	}
	back.Type = asked.Type
	out, err := xml.MarshalIndent(back, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// otherDevices are the parts of the domain the hook must leave alone.
func otherDevices(t *testing.T, dom []byte) string {
	t.Helper()
	d := mustParse(t, dom)
	// The hook's NCCL disk is its own addition (checkNCCLDisk), the domain's disks stay.
	var disks []libvirtxml.DomainDisk
	for _, k := range d.Devices.Disks {
		if k.Alias == nil || k.Alias.Name != NCCLDiskAlias {
			disks = append(disks, k)
		}
	}
	d.Devices.Disks = disks
	b, err := json.Marshal(struct {
		Disks []libvirtxml.DomainDisk
		Ball  *libvirtxml.DomainMemBalloon
		CPU   *libvirtxml.DomainCPU
		NT    *libvirtxml.DomainNUMATune
	}{d.Devices.Disks, d.Devices.MemBalloon, d.CPU, d.NUMATune})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// addBareRootPorts adds n pcie-root-ports without addresses, as virt-launcher does for
// hotplug before its third call.
func addBareRootPorts(t *testing.T, dom []byte, n int) []byte {
	t.Helper()
	d := mustParse(t, dom)
	next := 0
	for _, c := range d.Devices.Controllers {
		if c.Type == "pci" && c.Index != nil && int(*c.Index) >= next {
			next = int(*c.Index) + 1
		}
	}
	for i := 0; i < n; i++ {
		d.Devices.Controllers = append(d.Devices.Controllers, libvirtxml.DomainController{Type: "pci", Index: ptr(uint(next + i)), Model: "pcie-root-port"})
	}
	s, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return roundTrip(t, []byte(s))
}

// TestOnDefineDomainThreeCalls plays virt-launcher through the hook's socket for 1 unit,
// 2 units, 2 units on two NUMA nodes with guest NUMA, and 8 units (B300's BARs: a 46-bit
// guest, so host-passthrough on a 46-bit node), on the domain KubeVirt's own DRA host
// device code makes: call 1 the converter's domain, call 2 libvirt's read-back of the
// hook's result after virsh define (and the variant where libvirt placed every hostdev
// itself beside the hook's earlier controllers), call 3 that plus bare root ports. Each
// returned domain, after api.DomainSpec, is valid (virt-xml-validate), is defined by
// libvirt, and shows the same unit tree; the rest of the domain is untouched. The 8-unit
// domain's last call on a node one bit narrower is refused, naming both widths.
func TestOnDefineDomainThreeCalls(t *testing.T) {
	m, path, keys := signed(t, nil)
	l := startHook(t, Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID})
	info := l.info(t)
	if info.Name != Name || len(info.Versions) != 1 || info.Versions[0] != hooksv1alpha3.Version ||
		len(info.HookPoints) != 1 || info.HookPoints[0].Name != hooksinfo.OnDefineDomainHookPointName {
		t.Fatalf("Info: %+v", info)
	}
	uri := libvirttest.Start(t)
	for _, tc := range []struct {
		name  string
		units []string
		numa  bool
		nodes []int // each unit's guest node (-1: no guest NUMA)
		// cpu is spec.domain.cpu.model ("": none) and hostBits the node's width (0: the
		// hook does not check the guest's).
		cpu      string
		hostBits int
		// The last call with host-passthrough on a node of accept bits passes, on one
		// of refuse bits is refused naming refuseErr (0: not checked). The domain's
		// other root ports by then (libvirt's for KubeVirt's devices, and 3 bare) take
		// OVMF's padding from the units' window (topology.MMIO).
		accept, refuse int
		refuseErr      string
	}{
		{"1unit", []string{"gpu0"}, false, []int{-1}, "", 0, 43, 42,
			"guest: 1 units beside the domain's 7 other root ports (OVMF pads each of the 7 hotplug-capable ones with 4 GiB of the window at 43 bits, 28 GiB in all) need 556 GiB of 64-bit MMIO, a 43-bit physical address width; the width given is 42 bits, whose OVMF window is 512 GiB"},
		{"2units", []string{"gpu0", "gpu1"}, false, []int{-1, -1}, "", 0, 0, 0, ""},
		{"2units-2numa", []string{"gpu0", "gpu4"}, true, []int{0, 1}, "", 0, 0, 0, ""},
		// Eight units fill OVMF's 8 TiB window but for the last one's alignment gap,
		// where the 224 GiB of padding of KubeVirt's ports goes: their root ports and
		// the units' share pcie.0 (topology.Placement.RootSlots).
		{"8units", []string{"gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6", "gpu7"}, false,
			[]int{-1, -1, -1, -1, -1, -1, -1, -1}, "host-passthrough", 0, 46, 45,
			"guest: 8 units beside the domain's 7 other root ports (OVMF pads each of the 7 hotplug-capable ones with 32 GiB of the window at 46 bits, 224 GiB in all) need 8032 GiB of 64-bit MMIO, a 46-bit physical address width; the width given is 45 bits, whose OVMF window is 4 TiB"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := l
			if tc.hostBits != 0 {
				l = startHook(t, Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID, HostPhysBits: tc.hostBits})
			}
			dom1 := kubevirtDomain(t, m, tc.units, tc.numa)
			if tc.cpu != "" {
				dom1 = withCPUMode(t, dom1, tc.cpu)
			}
			out1, err := l.define(t, dom1)
			if err != nil {
				t.Fatalf("call 1: %v", err)
			}
			rt1 := roundTrip(t, out1)
			want := units(t, m, rt1)
			if len(want) != len(tc.units) {
				t.Fatalf("call 1: %d units in the tree, want %d:\n%s", len(want), len(tc.units), want)
			}
			for i, u := range want {
				if !strings.HasPrefix(u, tc.units[i]+" node "+fmt.Sprint(tc.nodes[i])+" ") {
					t.Errorf("call 1: %s: want %s on guest node %d", u, tc.units[i], tc.nodes[i])
				}
			}
			if a, b := otherDevices(t, dom1), otherDevices(t, rt1); a != b {
				t.Errorf("call 1 changed the rest of the domain:\n%s\n%s", a, b)
			}
			validate(t, rt1)
			back := defineAndRead(t, uri, rt1)
			if got := units(t, m, back); !equal(got, want) {
				t.Fatalf("libvirt's read-back of call 1:\n%s\nwant\n%s", got, want)
			}

			calls := map[string][]byte{"2 (read-back)": back,
				// libvirt placing every hostdev on a root port of its own, beside the hook's
				// earlier controllers (KUBEVIRT.md's second call).
				"2 (hostdevs placed by libvirt)": defineAndRead(t, uri, unplaced(t, dom1, rt1))}
			var last []byte
			for _, name := range []string{"2 (read-back)", "2 (hostdevs placed by libvirt)"} {
				out, err := l.define(t, calls[name])
				if err != nil {
					t.Fatalf("call %s: %v", name, err)
				}
				rt := roundTrip(t, out)
				if got := units(t, m, rt); !equal(got, want) {
					t.Fatalf("call %s:\n%s\nwant\n%s", name, got, want)
				}
				validate(t, rt)
				last = defineAndRead(t, uri, rt)
			}
			dom3 := addBareRootPorts(t, last, 3)
			out3, err := l.define(t, dom3)
			if err != nil {
				t.Fatalf("call 3: %v", err)
			}
			rt3 := roundTrip(t, out3)
			if got := units(t, m, rt3); !equal(got, want) {
				t.Fatalf("call 3:\n%s\nwant\n%s", got, want)
			}
			if n := strings.Count(string(rt3), "pcie-root-port"); n < 3+len(tc.units) {
				t.Errorf("call 3: %d root ports: the bare ones were removed", n)
			}
			validate(t, rt3)
			final := defineAndRead(t, uri, rt3)
			// libvirt adds a root port for a device without an address and for a gap in
			// the controller indexes: after three calls the domain has those of call 1's
			// read-back (its other devices), the 3 bare ones and the units', no more.
			if got, want := rootPorts(final), rootPorts(back)+3; got != want {
				t.Errorf("final domain: %d root ports besides the units', want %d (call 1's read-back's and 3 bare)", got, want)
			}
			if got := units(t, m, final); !equal(got, want) {
				t.Fatalf("libvirt's final domain:\n%s\nwant\n%s", got, want)
			}
			// The NCCL file virt-launcher's last call left names the buses the final
			// domain gives the GPU and NICs.
			nccl, err := os.ReadFile(filepath.Join(filepath.Dir(l.socket), "tenant_vm.nccl-topo.xml"))
			if err != nil {
				t.Fatal(err)
			}
			checkNCCL(t, m, final, nccl)
			img := filepath.Join(filepath.Dir(l.socket), "tenant_vm.nccl-topo.img")
			checkNCCLDisk(t, final, nccl, img)
			checkNCCLDrive(t, uri, final)
			// What qemu-tests boots (TestKubeVirtHookGuest): the final domain as libvirt
			// keeps it and the NCCL file, held here to what the hook gives now.
			golden(t, tc.name+".final.xml", final)
			golden(t, tc.name+".nccl-topo.xml", nccl)
			b, err := os.ReadFile(img)
			if err != nil {
				t.Fatal(err)
			}
			golden(t, tc.name+".nccl-topo.img", b)
			libvirttest.Virsh(t, uri, "undefine", "tenant_vm")
			hp := withCPUMode(t, dom3, "host-passthrough")
			if tc.accept != 0 {
				ok := startHook(t, Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID, HostPhysBits: tc.accept})
				if _, err := ok.define(t, hp); err != nil {
					t.Errorf("call 3 on a %d-bit node: %v", tc.accept, err)
				}
			}
			if tc.refuse != 0 {
				// Refused at the last call, before QEMU starts (TestDefineDomainGuestWidth).
				narrow := startHook(t, Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID, HostPhysBits: tc.refuse})
				if _, err := narrow.define(t, hp); err == nil || !strings.Contains(err.Error(), tc.refuseErr) {
					t.Errorf("call 3 on a %d-bit node: %v, want %q", tc.refuse, err, tc.refuseErr)
				}
			}
		})
	}
}

var update = flag.Bool("update", false, "rewrite testdata/ from what the hook gives")

// golden holds b to testdata/name (rewritten with -update).
func golden(t *testing.T, name string, b []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test -run ThreeCalls -update writes it)", err)
	}
	if !bytes.Equal(b, want) {
		t.Errorf("%s differs from what the hook gives now (go test -run ThreeCalls -update):\n%s", path, b)
	}
}

// rootPorts counts the pcie-root-ports that are not the hook's.
func rootPorts(dom []byte) int {
	var d libvirtxml.Domain
	if err := d.Unmarshal(string(dom)); err != nil {
		return -1
	}
	n := 0
	for _, c := range d.Devices.Controllers {
		if c.Model == "pcie-root-port" && !own(c) {
			n++
		}
	}
	return n
}

// unplaced is the converter's domain with the hook's earlier controllers from out and
// no guest address on any hostdev: libvirt then places each one itself.
func unplaced(t *testing.T, dom1, out []byte) []byte {
	t.Helper()
	a, b := mustParse(t, dom1), mustParse(t, out)
	a.Devices.Controllers = b.Devices.Controllers
	for i := range a.Devices.Hostdevs {
		a.Devices.Hostdevs[i].Address = nil
	}
	s, err := a.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return []byte(s)
}

// checkNCCL holds the NCCL file's bus IDs to the guest buses of the domain's GPU and
// NIC functions.
func checkNCCL(t *testing.T, m *manifest.Manifest, dom, nccl []byte) {
	t.Helper()
	want := map[string]bool{}
	for _, u := range units(t, m, dom) {
		for _, f := range strings.Fields(u[strings.Index(u, ": ")+2:]) {
			if strings.Contains(f, "=gpu@") || strings.Contains(f, "=gpu-nic@") {
				want["0000:"+f[strings.Index(f, "@")+1:]] = true
			}
		}
	}
	got := map[string]bool{}
	var sys struct {
		CPUs []struct {
			PCIs []node `xml:"pci"`
		} `xml:"cpu"`
	}
	if err := xml.Unmarshal(nccl, &sys); err != nil {
		t.Fatalf("nccl: %v\n%s", err, nccl)
	}
	var walk func(n *node)
	walk = func(n *node) {
		if len(n.PCIs) == 0 {
			got[n.BusID] = true
		}
		for i := range n.PCIs {
			walk(&n.PCIs[i])
		}
	}
	for _, c := range sys.CPUs {
		for i := range c.PCIs {
			walk(&c.PCIs[i])
		}
	}
	if !equalSet(got, want) {
		t.Errorf("NCCL file bus IDs %v, the domain's GPUs and NICs %v\n%s", keys(got), keys(want), nccl)
	}
}

type node struct {
	BusID string `xml:"busid,attr"`
	PCIs  []node `xml:"pci"`
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func equalSet(a, b map[string]bool) bool { return equal(keys(a), keys(b)) }

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestOnDefineDomainRefusals: each a gRPC error naming the function and why, so the VM
// is not defined; a VM without passage devices passes through byte for byte.
func TestOnDefineDomainRefusals(t *testing.T) {
	m, path, keys := signed(t, nil)
	good := Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID}
	dom := kubevirtDomain(t, m, []string{"gpu0"}, false)

	tampered := filepath.Join(t.TempDir(), "tampered.dsse.json")
	env, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var e struct {
		PayloadType string `json:"payloadType"`
		Payload     []byte `json:"payload"`
		Signatures  any    `json:"signatures"`
	}
	if err := json.Unmarshal(env, &e); err != nil {
		t.Fatal(err)
	}
	e.Payload = bytes.Replace(e.Payload, []byte(`"ready"`), []byte(`"ready" `), 1)
	b, _ := json.Marshal(e)
	if err := os.WriteFile(tampered, b, 0o644); err != nil {
		t.Fatal(err)
	}
	degraded := func(status string) Config {
		m, path, keys := signed(t, func(m *manifest.Manifest) {
			m.Units[0].Status = status
			m.Units[0].Reasons = []string{"gpu-nic 0000:1f:00.1: link x8, want x16"}
		})
		return Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID}
	}
	other := good
	other.NodeUUID = "4c4c4544-0042-3810-8057-000000000001"

	// Two units' functions in one switch: gpu1's GPU moved onto a port of gpu0's switch,
	// a tree the hook did not lay out.
	two := kubevirtDomain(t, m, []string{"gpu0", "gpu1"}, false)
	l := startHook(t, good)
	out, err := l.define(t, two)
	if err != nil {
		t.Fatal(err)
	}
	d := mustParse(t, out)
	var nvme0, gpu1 int = -1, -1
	for i, h := range d.Devices.Hostdevs {
		switch srcOf(h).String() {
		case "0000:24:00.0":
			nvme0 = i
		case "0000:42:00.0":
			gpu1 = i
		}
	}
	if nvme0 < 0 || gpu1 < 0 {
		t.Fatalf("hostdevs not found:\n%s", out)
	}
	d.Devices.Hostdevs[gpu1].Address = &libvirtxml.DomainAddress{PCI: &libvirtxml.DomainAddressPCI{
		Domain: ptr(uint(0)), Bus: d.Devices.Hostdevs[nvme0].Address.PCI.Bus, Slot: ptr(uint(0)), Function: ptr(uint(1))}}
	// Someone else's switch, not the hook's own (which it lays out again): no alias.
	for i := range d.Devices.Controllers {
		d.Devices.Controllers[i].Alias = nil
	}
	mixed, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name string
		c    Config
		dom  []byte
		want []string
	}{
		{"tampered", Config{Manifest: tampered, Keys: keys, NodeUUID: m.Node.DMIUUID}, dom, []string{"0000:22:00.0", "does not verify", "signature"}},
		{"another node", other, dom, []string{"0000:22:00.0", "does not verify", "this node is dmi_uuid"}},
		// The kernel's boot ID alone is the node identity passage-hook uses by default.
		{"another boot", Config{Manifest: path, Keys: keys, BootID: "0c6f7a52-95a4-4f0e-8b1d-3f2e9d7c4a10"}, dom,
			[]string{"0000:22:00.0", "does not verify", "boot id mismatch"}},
		{"no node identity", Config{Manifest: path, Keys: keys}, dom, []string{"0000:22:00.0", "no node identity"}},
		{"degraded", degraded("degraded"), dom, []string{"hostdev 0000:22:00.0", "gpu0 is degraded", "link x8"}},
		{"failed", degraded("failed"), dom, []string{"hostdev 0000:22:00.0", "gpu0 is failed"}},
		{"two units in one switch", good, roundTrip(t, []byte(mixed)), []string{"0000:42:00.0 (gpu1)", "with 0000:22:00.0 (gpu0)", "one unit"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := startHook(t, tc.c)
			out, err := l.define(t, tc.dom)
			if err == nil {
				t.Fatalf("accepted:\n%s", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}

	t.Run("this boot", func(t *testing.T) {
		if _, err := startHook(t, Config{Manifest: path, Keys: keys, BootID: manifesttest.BootID}).define(t, dom); err != nil {
			t.Fatalf("the manifest of this boot: %v", err)
		}
	})

	t.Run("part of a unit", func(t *testing.T) {
		d := mustParse(t, dom)
		d.Devices.Hostdevs = d.Devices.Hostdevs[:3]
		s, _ := d.Marshal()
		_, err := startHook(t, good).define(t, []byte(s))
		if err == nil || !strings.Contains(err.Error(), "0000:24:00.0") || !strings.Contains(err.Error(), "whole") {
			t.Fatalf("error %v: want the missing NVMe named", err)
		}
	})

	// No passage device: unchanged, even when the manifest does not verify (no PCI
	// hostdev at all) or when it does (a hostdev that is no unit's function).
	t.Run("no passage device", func(t *testing.T) {
		d := mustParse(t, dom)
		d.Devices.Hostdevs = nil
		s, _ := d.Marshal()
		plain := roundTrip(t, []byte(s))
		for _, c := range []Config{good, {Manifest: tampered, Keys: keys, NodeUUID: m.Node.DMIUUID}} {
			out, err := startHook(t, c).define(t, plain)
			if err != nil || !bytes.Equal(out, plain) {
				t.Fatalf("a domain without hostdevs: err %v, changed: %v", err, !bytes.Equal(out, plain))
			}
		}
		d.Devices.Hostdevs = []libvirtxml.DomainHostdev{{Managed: "no", SubsysPCI: &libvirtxml.DomainHostdevSubsysPCI{
			Source: &libvirtxml.DomainHostdevSubsysPCISource{Address: &libvirtxml.DomainAddressPCI{Domain: ptr(uint(0)), Bus: ptr(uint(5)), Slot: ptr(uint(0)), Function: ptr(uint(0))}}}}}
		s, _ = d.Marshal()
		foreign := roundTrip(t, []byte(s))
		out, err := startHook(t, good).define(t, foreign)
		if err != nil || !bytes.Equal(out, foreign) {
			t.Fatalf("a hostdev of no unit: err %v, changed: %v", err, !bytes.Equal(out, foreign))
		}
	})
}

func mustParse(t *testing.T, b []byte) libvirtxml.Domain {
	t.Helper()
	d, err := parseDomain(b)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// checkNCCLDisk: the final domain (through api.DomainSpec and libvirt) carries one
// read-only SATA CD-ROM of the hook, on the image the hook wrote, and that image read
// whole is the NCCL file, still one well-formed XML document.
func checkNCCLDisk(t *testing.T, dom, nccl []byte, image string) {
	t.Helper()
	d := mustParse(t, dom)
	var disks []libvirtxml.DomainDisk
	for _, k := range d.Devices.Disks {
		if k.Alias != nil && k.Alias.Name == NCCLDiskAlias {
			disks = append(disks, k)
		}
	}
	if len(disks) != 1 {
		t.Fatalf("%d NCCL disks in the final domain, want 1", len(disks))
	}
	k := disks[0]
	want := filepath.Join(ncclDiskDir, "tenant_vm.nccl-topo.img")
	if k.Device != "cdrom" || k.ReadOnly == nil || k.Target == nil || k.Target.Bus != "sata" || k.Serial != NCCLDiskSerial ||
		k.Source == nil || k.Source.File == nil || k.Source.File.File != want {
		b, _ := xml.Marshal(k)
		t.Fatalf("NCCL disk %s: want a read-only sata cdrom on %s, serial %s", b, want, NCCLDiskSerial)
	}
	if k.Address == nil || k.Address.Drive == nil || k.Address.PCI != nil {
		t.Errorf("NCCL disk address %+v: want a drive address on the AHCI, no PCI device", k.Address)
	}
	img, err := os.ReadFile(image)
	if err != nil {
		t.Fatal(err)
	}
	if len(img)%NCCLDiskSector != 0 || !bytes.Equal(bytes.TrimRight(img, "\n"), bytes.TrimRight(nccl, "\n")) {
		t.Fatalf("image %s: %d bytes, not the NCCL file padded to a %d-byte sector", image, len(img), NCCLDiskSector)
	}
	dec := xml.NewDecoder(bytes.NewReader(img))
	for {
		if _, err := dec.Token(); err != nil {
			if err.Error() != "EOF" {
				t.Fatalf("image %s read whole is not well-formed XML: %v", image, err)
			}
			break
		}
	}
}

// checkNCCLDrive: libvirt's own QEMU command line for the final domain gives the guest
// the image as a read-only ide-cd on the q35 AHCI with the disk's serial. What this
// host cannot give is taken out first, nothing of the disk (libvirttest.ForCommandLine).
func checkNCCLDrive(t *testing.T, uri string, dom []byte) {
	t.Helper()
	d := mustParse(t, dom)
	libvirttest.TCG.ForCommandLine(&d)
	s, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "native.xml")
	if err := os.WriteFile(f, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	argv := libvirttest.Virsh(t, uri, "domxml-to-native", "--format", "qemu-argv", "--xml", f)
	var cd map[string]any
	nodes := map[any]map[string]any{}
	for _, m := range regexp.MustCompile(`-(device|blockdev) '(\{[^']*\})'`).FindAllStringSubmatch(argv, -1) {
		var o map[string]any
		if err := json.Unmarshal([]byte(m[2]), &o); err != nil {
			t.Fatalf("%s %s: %v", m[1], m[2], err)
		}
		if m[1] == "device" && o["serial"] == NCCLDiskSerial {
			cd = o
		}
		if m[1] == "blockdev" {
			nodes[o["node-name"]] = o
		}
	}
	if cd == nil {
		t.Fatalf("no NCCL drive in libvirt's command line:\n%s", argv)
	}
	// The device's drive is the raw format node over the file node.
	format := nodes[cd["drive"]]
	file := nodes[format["file"]]
	if cd["driver"] != "ide-cd" || !strings.HasPrefix(fmt.Sprint(cd["bus"]), "ide.") || format["driver"] != "raw" || format["read-only"] != true ||
		file["filename"] != filepath.Join(ncclDiskDir, "tenant_vm.nccl-topo.img") {
		t.Errorf("NCCL drive: device %v, format %v, file %v: want a read-only raw ide-cd on the AHCI on the image", cd, format, file)
	}
}

// srcOf is a PCI hostdev's host function (the zero address for any other hostdev).
func srcOf(h libvirtxml.DomainHostdev) pci.Address {
	a, _, _ := hostPCI(h)
	return a
}

// pciBus is the guest bus an address plugs into (-1: no PCI address).
func pciBus(a *libvirtxml.DomainAddress) int {
	g, ok, _ := readGuest(a)
	if !ok {
		return -1
	}
	return g.bus
}

func pciSlot(a *libvirtxml.DomainAddress) (int, int) {
	g, _, _ := readGuest(a)
	return g.slot, g.fn
}
