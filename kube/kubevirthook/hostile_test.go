package kubevirthook

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	hooksinfo "kubevirt.io/kubevirt/pkg/hooks/info"
	hooksv1alpha3 "kubevirt.io/kubevirt/pkg/hooks/v1alpha3"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/topology"
)

// answerBound is how long a hostile domain may take to be answered in a pass/fail
// test: ten times the one second, so a loaded machine does not fail it, and
// raceFactor times that under the race detector; BenchmarkOnDefineDomain3000Controllers
// measures the real figure. The superlinear walks it guards against took over a minute
// at 3000 controllers.
const answerBound = raceFactor * 10 * time.Second

// edit is dom read into KubeVirt's DomainSpec (what virt-launcher keeps and sends),
// changed, and written back as virt-launcher writes it.
func edit(t testing.TB, dom []byte, change func(*api.DomainSpec)) []byte {
	t.Helper()
	var s api.DomainSpec
	if err := xml.Unmarshal(dom, &s); err != nil {
		t.Fatal(err)
	}
	change(&s)
	b, err := xml.MarshalIndent(s, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// chain is n PCI controllers from index 1, each plugged into the bus of the one before.
func chain(n int) []api.Controller {
	var cs []api.Controller
	for i := 1; i <= n; i++ {
		cs = append(cs, api.Controller{Type: "pci", Index: fmt.Sprint(i), Model: "pci-bridge",
			Address: &api.Address{Type: "pci", Domain: "0x0000", Bus: fmt.Sprintf("%#02x", i-1), Slot: "0x01", Function: "0x0"}})
	}
	return cs
}

// TestHostileDomains: each domain a tenant can make virt-launcher send (a VMI's own
// devices, or a hook sidecar before this one in its annotation) through the hook's socket;
// each is answered, placed or refused with the reason, within answerBound, and the next
// ordinary VM starts on the same hook.
func TestHostileDomains(t *testing.T) {
	m, path, keys := signed(t, nil)
	l := startHook(t, Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID})
	dom := kubevirtDomain(t, m, []string{"gpu0"}, false)
	usb := api.HostDevice{Type: "usb", Mode: "subsystem", Source: api.HostDeviceSource{Address: &api.Address{Bus: "1", Device: "2"}},
		Alias: api.NewUserDefinedAlias("usb-key")}
	mdev := api.HostDevice{Type: "mdev", Mode: "subsystem", Model: "vfio-pci", Source: api.HostDeviceSource{Address: &api.Address{UUID: "8d2e8f0c-2b1a-4a4e-9a55-0a8f1d4c6b21"}},
		Address: &api.Address{Type: "pci", Domain: "0x0000", Bus: "0x00", Slot: "0x09", Function: "0x0"}, Alias: api.NewUserDefinedAlias("vgpu")}
	gpuAt := func(s *api.DomainSpec, bdf string) int {
		for i, h := range s.Devices.HostDevices {
			a := h.Source.Address
			if a != nil && fmt.Sprintf("%s:%s:%s.%s", a.Domain[2:], a.Bus[2:], a.Slot[2:], a.Function[2:]) == bdf {
				return i
			}
		}
		t.Fatalf("no hostdev %s", bdf)
		return -1
	}
	many := make([]api.Controller, 3000)
	for i := range many {
		// virtio-serial controllers, each a PCI device on pcie.0.
		many[i] = api.Controller{Type: "virtio-serial", Index: fmt.Sprint(i + 1), Model: "virtio-non-transitional",
			Address: &api.Address{Type: "pci", Domain: "0x0000", Bus: "0x00", Slot: fmt.Sprintf("%#02x", 2+i%24), Function: fmt.Sprint(i % 8)}}
	}
	for _, tc := range []struct {
		name   string
		change func(*api.DomainSpec)
		want   []string // refused, the error saying these; nil: placed
		check  func(t *testing.T, out []byte)
	}{
		{"a USB hostdev beside the unit", func(s *api.DomainSpec) { s.Devices.HostDevices = append(s.Devices.HostDevices, usb) }, nil,
			func(t *testing.T, out []byte) {
				kept(t, out, "usb-key", func(h libvirtxml.DomainHostdev) bool { return h.SubsysUSB != nil })
			}},
		{"an mdev hostdev on pcie.0 beside the unit", func(s *api.DomainSpec) { s.Devices.HostDevices = append(s.Devices.HostDevices, mdev) }, nil,
			func(t *testing.T, out []byte) {
				kept(t, out, "vgpu", func(h libvirtxml.DomainHostdev) bool {
					return h.SubsysMDev != nil && h.Address != nil && h.Address.PCI != nil && *h.Address.PCI.Slot == 9
				})
			}},
		{"a USB hostdev alone", func(s *api.DomainSpec) { s.Devices.HostDevices = []api.HostDevice{usb} }, nil, nil},
		{"a controller on its own bus", func(s *api.DomainSpec) {
			s.Devices.Controllers = append(s.Devices.Controllers, api.Controller{Type: "pci", Index: "40", Model: "pcie-root-port",
				Address: &api.Address{Type: "pci", Domain: "0x0000", Bus: "0x28", Slot: "0x00", Function: "0x0"}})
		}, []string{"controller pci 40", "plugged into its own bus"}, nil},
		{"two controllers on each other's bus", func(s *api.DomainSpec) {
			s.Devices.Controllers = append(s.Devices.Controllers,
				api.Controller{Type: "pci", Index: "41", Model: "pci-bridge", Address: &api.Address{Type: "pci", Bus: "0x2a", Slot: "0x01"}},
				api.Controller{Type: "pci", Index: "42", Model: "pci-bridge", Address: &api.Address{Type: "pci", Bus: "0x29", Slot: "0x01"}})
		}, []string{"plugged into its own bus"}, nil},
		{"a controller index of 2^40", func(s *api.DomainSpec) {
			s.Devices.Controllers = append(s.Devices.Controllers, api.Controller{Type: "pci", Index: "1099511627776", Model: "pcie-root-port"})
		}, []string{"controller pci 1099511627776", "above libvirt's 255"}, nil},
		{"a controller index twice", func(s *api.DomainSpec) {
			s.Devices.Controllers = append(s.Devices.Controllers, api.Controller{Type: "pci", Index: "3", Model: "pcie-root-port"},
				api.Controller{Type: "pci", Index: "3", Model: "pcie-root-port"})
		}, []string{"controller pci 3", "listed twice"}, nil},
		{"a chain of 3000 PCI controllers", func(s *api.DomainSpec) { s.Devices.Controllers = append(s.Devices.Controllers, chain(3000)...) },
			[]string{"controller pci 256", "above libvirt's 255"}, nil},
		{"a chain of 200 PCI controllers", func(s *api.DomainSpec) { s.Devices.Controllers = append(s.Devices.Controllers, chain(200)...) }, nil, nil},
		{"a chain of 255 PCI controllers", func(s *api.DomainSpec) { s.Devices.Controllers = append(s.Devices.Controllers, chain(255)...) },
			[]string{"guest plan", "out of guest bus numbers"}, nil},
		{"3000 controllers of other types", func(s *api.DomainSpec) { s.Devices.Controllers = append(s.Devices.Controllers, many...) }, nil, nil},
		{"an expander busNr of 300", func(s *api.DomainSpec) {
			nr := uint32(300)
			s.Devices.Controllers = append(s.Devices.Controllers, api.Controller{Type: "pci", Index: "7", Model: "pcie-expander-bus",
				Target: &api.ControllerTarget{BusNr: &nr}})
		}, []string{"controller pci 7", "busNr 300"}, nil},
		{"a guest bus above 0xff", func(s *api.DomainSpec) {
			s.Devices.HostDevices[0].Address = &api.Address{Type: "pci", Domain: "0x0000", Bus: "0x128", Slot: "0x00", Function: "0x0"}
		}, []string{"guest address", "bus 0x128 is above PCI's 0xff"}, nil},
		{"the GPU twice and no NVMe", func(s *api.DomainSpec) {
			nvme := gpuAt(s, "0000:24:00.0")
			gpu := s.Devices.HostDevices[gpuAt(s, "0000:22:00.0")]
			s.Devices.HostDevices[nvme].Source = gpu.Source
		}, []string{"hostdev 0000:22:00.0 (gpu0 gpu)", "listed twice"}, nil},
		{"40 root ports without an address", func(s *api.DomainSpec) {
			for i := 0; i < 40; i++ {
				s.Devices.Controllers = append(s.Devices.Controllers, api.Controller{Type: "pci", Index: fmt.Sprint(100 + i), Model: "pcie-root-port"})
			}
		}, []string{"controller pci 100", "40 root ports without an address", "pcie.0 slots free above the units' root ports"}, nil},
		{"3 root ports without an address", func(s *api.DomainSpec) {
			for i := 0; i < 3; i++ {
				s.Devices.Controllers = append(s.Devices.Controllers, api.Controller{Type: "pci", Index: fmt.Sprint(100 + i), Model: "pcie-root-port"})
			}
		}, nil, func(t *testing.T, out []byte) {
			// Each gets function 0 of a pcie.0 slot of its own, above the unit's root port.
			d := mustParse(t, out)
			var unitSlot uint
			for _, c := range d.Devices.Controllers {
				if own(c) && c.Model == "pcie-root-port" {
					unitSlot = *c.Address.PCI.Slot
				}
			}
			seen := map[uint]bool{}
			for _, c := range d.Devices.Controllers {
				if c.Index == nil || *c.Index < 100 || *c.Index > 102 {
					continue
				}
				if c.Address == nil || c.Address.PCI == nil || *c.Address.PCI.Bus != 0 || *c.Address.PCI.Function != 0 ||
					*c.Address.PCI.Slot <= unitSlot || seen[*c.Address.PCI.Slot] {
					t.Errorf("root port %d: address %+v, want function 0 of a slot of its own above the unit's %#x", *c.Index, c.Address, unitSlot)
					continue
				}
				seen[*c.Address.PCI.Slot] = true
			}
			if len(seen) != 3 {
				t.Errorf("%d of 3 bare root ports addressed", len(seen))
			}
		}},
		{"a source bus above 0xff", func(s *api.DomainSpec) {
			s.Devices.HostDevices[gpuAt(s, "0000:22:00.0")].Source.Address.Bus = "0x122"
		}, []string{"source address", "bus 0x122 is above PCI's 0xff"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			out, err := l.define(t, edit(t, dom, tc.change))
			took := time.Since(start)
			t.Logf("answered in %v", took)
			if took > answerBound {
				t.Errorf("answered in %v, over %v", took, answerBound)
			}
			switch {
			case tc.want == nil && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != nil && err == nil:
				t.Fatalf("accepted:\n%.2000s", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if tc.check != nil {
				tc.check(t, out)
			}
			// The hook is still there, and the next ordinary VM starts.
			next, err := l.define(t, dom)
			if err != nil {
				t.Fatalf("the next ordinary VM: %v", err)
			}
			if got := units(t, m, next); len(got) != 1 || !strings.HasPrefix(got[0], "gpu0") {
				t.Fatalf("the next ordinary VM: units %v", got)
			}
		})
	}
}

// kept: the returned domain still has the hostdev aliased alias, as ok says it was.
func kept(t *testing.T, out []byte, alias string, ok func(libvirtxml.DomainHostdev) bool) {
	t.Helper()
	d := mustParse(t, out)
	for _, h := range d.Devices.Hostdevs {
		if h.Alias != nil && strings.HasSuffix(h.Alias.Name, alias) {
			if !ok(h) {
				t.Errorf("hostdev %s changed: %+v", alias, h)
			}
			return
		}
	}
	t.Errorf("hostdev %s dropped:\n%s", alias, out)
}

// panicky is a Callbacks server whose OnDefineDomain panics on a domain saying "panic".
type panicky struct{ *Server }

func (p panicky) OnDefineDomain(ctx context.Context, r *hooksv1alpha3.OnDefineDomainParams) (*hooksv1alpha3.OnDefineDomainResult, error) {
	if bytes.Contains(r.GetDomainXML(), []byte("panic")) {
		b := r.GetDomainXML()
		_ = b[len(b)] // a runtime error, the kind of bug a nil pointer was
	}
	return p.Server.OnDefineDomain(ctx, r)
}

// syncBuffer is a log destination the server's goroutines and the test share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestPanicRefused: a handler that panics behind the hook's server refuses that call,
// with its stack in the log, and the hook goes on serving.
func TestPanicRefused(t *testing.T) {
	m, path, keys := signed(t, nil)
	var logs syncBuffer
	s := &Server{Config: Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID}, Log: log.New(&logs, "passage-hook: ", 0)}
	sock := filepath.Join(t.TempDir(), "passage", "passage.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, sock, s, panicky{s}, s.Log) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no hook socket")
		}
	}
	l := &launcher{socket: sock}
	_, err := l.define(t, []byte("<domain><name>panic</name></domain>"))
	if err == nil || !strings.Contains(err.Error(), "internal error, refused") {
		t.Fatalf("a panicking call: %v", err)
	}
	if !strings.Contains(logs.String(), "index out of range") || !strings.Contains(logs.String(), "hostile_test.go") {
		t.Errorf("log without the panic and its stack:\n%s", logs.String())
	}
	if r := l.info(t); r.Name != Name || len(r.HookPoints) != 1 || r.HookPoints[0].Name != hooksinfo.OnDefineDomainHookPointName {
		t.Errorf("Info after the panic: %+v", r)
	}
	dom := kubevirtDomain(t, m, []string{"gpu0"}, false)
	if _, err := l.define(t, dom); err != nil {
		t.Fatalf("the next VM after the panic: %v", err)
	}
}

// TestLongVMIName: a VMI whose namespace and name take 253 characters together starts,
// its NCCL files under a bounded name the domain's disk names too; two such VMIs that
// differ only at the end get two files.
func TestLongVMIName(t *testing.T) {
	m, path, keys := signed(t, nil)
	l := startHook(t, Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID})
	dom := kubevirtDomain(t, m, []string{"gpu0"}, false)
	ns := strings.Repeat("n", 63)
	seen := map[string]bool{}
	for _, last := range []string{"a", "b"} {
		name := strings.Repeat("v", 252-len(ns)) + last // with the namespace: 253
		if len(ns)+len(name) != 253 {
			t.Fatal(len(ns) + len(name))
		}
		out, err := l.defineAs(t, dom, ns, name)
		if err != nil {
			t.Fatalf("%s/%s: %v", ns, name, err)
		}
		d := mustParse(t, out)
		var img string
		for _, dk := range d.Devices.Disks {
			if dk.Alias != nil && dk.Alias.Name == NCCLDiskAlias {
				img = filepath.Base(dk.Source.File.File)
			}
		}
		if img == "" || len(img) > 200 || !strings.HasPrefix(img, ns+"_") || seen[img] {
			t.Fatalf("nccl disk %q", img)
		}
		seen[img] = true
		for _, f := range []string{img, strings.TrimSuffix(img, ".img") + ".xml"} {
			if _, err := os.Stat(filepath.Join(filepath.Dir(l.socket), f)); err != nil {
				t.Errorf("nccl file: %v", err)
			}
		}
	}
}

// defineAs is define for the VMI namespace/name.
func (l *launcher) defineAs(t *testing.T, dom []byte, namespace, name string) ([]byte, error) {
	t.Helper()
	c := l.conn(t)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vmi, _ := json.Marshal(map[string]any{"metadata": map[string]string{"name": name, "namespace": namespace}})
	r, err := hooksv1alpha3.NewCallbacksClient(c).OnDefineDomain(ctx, &hooksv1alpha3.OnDefineDomainParams{DomainXML: dom, Vmi: vmi})
	if err != nil {
		return nil, err
	}
	return r.GetDomainXML(), nil
}

// BenchmarkOnDefineDomain3000Controllers: one unit in a domain that also has 3000
// controllers, through the hook's socket: 3000 other ones (placed) and a chain of 3000
// PCI ones (refused).
func BenchmarkOnDefineDomain3000Controllers(b *testing.B) {
	m, path, keys := signed(b, nil)
	dom := kubevirtDomain(b, m, []string{"gpu0"}, false)
	many := make([]api.Controller, 3000)
	for i := range many {
		many[i] = api.Controller{Type: "virtio-serial", Index: fmt.Sprint(i + 1), Model: "virtio-non-transitional",
			Address: &api.Address{Type: "pci", Domain: "0x0000", Bus: "0x00", Slot: fmt.Sprintf("%#02x", 2+i%24), Function: fmt.Sprint(i % 8)}}
	}
	for _, bc := range []struct {
		name string
		cs   []api.Controller
		ok   bool
	}{{"other", many, true}, {"pci-chain", chain(3000), false}} {
		b.Run(bc.name, func(b *testing.B) {
			in := edit(b, dom, func(s *api.DomainSpec) { s.Devices.Controllers = append(s.Devices.Controllers, bc.cs...) })
			s := &Server{Config: Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID}}
			for b.Loop() {
				_, err := s.OnDefineDomain(context.Background(), &hooksv1alpha3.OnDefineDomainParams{DomainXML: in})
				if (err == nil) != bc.ok {
					b.Fatal(err)
				}
			}
		})
	}
}

// FuzzOnDefineDomain feeds OnDefineDomain's work (DefineDomain with an NCCL disk, no
// recovery in front of it: a panic fails the target) any domain, with a manifest that
// verifies: each call returns within answerBound, and a domain it hands back parses. The
// handler's file writes (fsynced) are left to the other tests. Run it with
// -fuzzminimizetime=0s: minimizing each new 10 KiB domain holds it to a few calls a
// minute.
func FuzzOnDefineDomain(f *testing.F) {
	m, path, keys := signed(f, nil)
	dom := kubevirtDomain(f, m, []string{"gpu0"}, false)
	f.Add(dom)
	f.Add(kubevirtDomain(f, m, []string{"gpu0", "gpu1"}, true))
	for _, g := range []string{"1unit.final.xml", "2units-2numa.final.xml"} {
		b, err := os.ReadFile(filepath.Join("testdata", g))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(edit(f, dom, func(s *api.DomainSpec) {
		s.Devices.Controllers = append(s.Devices.Controllers, api.Controller{Type: "pci", Index: "40", Model: "pcie-root-port",
			Address: &api.Address{Type: "pci", Bus: "0x28"}})
	}))
	f.Add(edit(f, dom, func(s *api.DomainSpec) { s.Devices.Controllers = append(s.Devices.Controllers, chain(20)...) }))
	f.Add(edit(f, dom, func(s *api.DomainSpec) {
		s.Devices.HostDevices = append(s.Devices.HostDevices, api.HostDevice{Type: "usb", Mode: "subsystem",
			Source: api.HostDeviceSource{Address: &api.Address{Bus: "1", Device: "2"}}})
	}))
	c := Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID, NCCLDisk: ncclDiskDir + "/tenant_vm.nccl-topo.img"}
	f.Fuzz(func(t *testing.T, in []byte) {
		// A call that never returns fails too: the panic ends the worker, and the fuzzer
		// keeps the input.
		hung := time.AfterFunc(answerBound, func() { panic(fmt.Sprintf("no answer after %v to %q", answerBound, in)) })
		start := time.Now()
		r, err := c.DefineDomain(in)
		hung.Stop()
		if took := time.Since(start); took > answerBound {
			t.Fatalf("answered in %v, over %v", took, answerBound)
		}
		if err != nil {
			return
		}
		if _, err := parseDomain(r.Domain); err != nil && !bytes.Equal(r.Domain, in) {
			t.Fatalf("handed back a domain that does not parse: %v", err)
		}
	})
}

// TestMemoryDeviceCounted: a virtio-mem device (KubeVirt's memory hotplug: MemoryDevice
// is the one device of its DomainSpec with a PCI address that the tree did not read) is
// a device on its bus like a disk: a root port holding it is not bare, and strip lets
// libvirt place it again when it sits below the hook's controllers, rather than hand it
// back on a bus the hook's next layout numbers otherwise.
func TestMemoryDeviceCounted(t *testing.T) {
	pciAddr := func(bus, slot uint) *libvirtxml.DomainAddress {
		return &libvirtxml.DomainAddress{PCI: &libvirtxml.DomainAddressPCI{Domain: ptr(uint(0)), Bus: &bus, Slot: &slot, Function: ptr(uint(0))}}
	}
	devs := &libvirtxml.DomainDeviceList{
		Controllers: []libvirtxml.DomainController{
			{Type: "pci", Index: ptr(uint(0)), Model: "pcie-root"},
			{Type: "pci", Index: ptr(uint(1)), Model: "pcie-expander-bus", Alias: &libvirtxml.DomainAlias{Name: topology.AliasPrefix + "pxb"}, Address: pciAddr(0, 2)},
			{Type: "pci", Index: ptr(uint(2)), Model: "pcie-root-port", Address: pciAddr(0, 3)},
		},
		Memorydevs: []libvirtxml.DomainMemorydev{{Model: "virtio-mem", Address: pciAddr(2, 0)}, {Model: "virtio-mem", Address: pciAddr(1, 5)}},
	}
	tr, err := newTree(devs)
	if err != nil {
		t.Fatal(err)
	}
	if k := tr.children(2); len(k) != 1 || k[0].addr == nil {
		t.Fatalf("root port 2 holds %+v, want the virtio-mem device", k)
	}
	if _, err := tr.strip(func(int) bool { return false }); err != nil {
		t.Fatal(err)
	}
	if a := devs.Memorydevs[1].Address; a != nil {
		t.Errorf("the virtio-mem device on the hook's expander bus kept its address %+v: libvirt must place it again", a.PCI)
	}
	if a := devs.Memorydevs[0].Address; a == nil {
		t.Error("the virtio-mem device on KubeVirt's root port lost its place")
	}
}
