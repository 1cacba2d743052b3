package topology

import (
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// TestModulesAndPartitionsRefused: a Module ID below 1 or given twice, a key that is no
// address or names one address twice, and a partition that is empty, names a module
// twice or beyond the declared ones, or repeats another, are errors naming the profile.
func TestModulesAndPartitionsRefused(t *testing.T) {
	const rules = "rules: [{name: a, role: gpu, match: {vendor: 0x10de}}]\n"
	for _, c := range []struct{ src, want string }{
		{`modules: {"00:01.0": 0}`, "modules: 00:01.0: Module ID 0: Module IDs start at 1"},
		{`modules: {"00:01.0": -2}`, "Module ID -2: Module IDs start at 1"},
		{`modules: {"00:01.0": 1, "00:02.0": 1}`, "modules: Module ID 1 given to both 00:01.0 and 00:02.0"},
		{`modules: {"zz": 1}`, "modules: pci address"},
		{`modules: {"0000:00:01.0": 1, "00:01.0": 2}`, "modules: 0000:00:01.0 and 00:01.0 are one address"},
		{`modules: {"00:01.0": one}`, "cannot unmarshal"},
		{`nvlink_partitions: [[1, 2], []]`, "nvlink_partitions[1]: empty"},
		{`nvlink_partitions: [[0]]`, "nvlink_partitions[0]: Module ID 0: Module IDs start at 1"},
		{`nvlink_partitions: [[1, 2, 1]]`, "nvlink_partitions[0]: Module ID 1 given twice"},
		{`nvlink_partitions: [[1, 2], [2, 1]]`, "nvlink_partitions[1]: the same set as nvlink_partitions[0]"},
		{"modules: {\"00:01.0\": 1, \"00:02.0\": 2}\nnvlink_partitions: [[1, 2], [3]]", "nvlink_partitions[1]: Module ID 3: modules declares none above 2"},
		{`nvlink_partitions: [1, 2]`, "cannot unmarshal"},
	} {
		_, err := ParseProfile("op.yaml", []byte("name: x\n"+c.src+"\n"+rules))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "profile op.yaml") {
			t.Errorf("%s: err = %v, want %q", c.src, err, c.want)
		}
	}
	// Partitions without modules are the layout alone (the built-in b200 and b300): any
	// Module ID from 1 will do.
	p, err := ParseProfile("op.yaml", []byte("name: x\nnvlink_partitions: [[1, 2, 3, 4, 5, 6, 7, 8], [8]]\n"+rules))
	if err != nil || len(p.NVLinkPartitions) != 2 {
		t.Errorf("%+v, %v", p, err)
	}
}

// TestBuiltinPartitions: b200 and b300 carry the HGX B200/B300 layout of NVIDIA's Fabric
// Manager User Guide (all eight, two halves, four pairs, eight singles) and no Module
// IDs (no public table maps their PCI addresses to modules); qemu carries its test
// wiring, out of PCI order.
func TestBuiltinPartitions(t *testing.T) {
	hgx := [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 2}, {3, 4}, {5, 6}, {7, 8},
		{1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}
	for _, name := range []string{"b200", "b300"} {
		p, err := Builtin(name)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(p.NVLinkPartitions, hgx) || len(p.Modules) != 0 {
			t.Errorf("%s: partitions %v, modules %v", name, p.NVLinkPartitions, p.Modules)
		}
	}
	q, err := Builtin("qemu")
	if err != nil {
		t.Fatal(err)
	}
	if q.Modules["0000:00:03.0"] != 2 || q.Modules["0000:00:04.0"] != 1 || len(q.NVLinkPartitions) == 0 {
		t.Errorf("qemu: modules %v, partitions %v", q.Modules, q.NVLinkPartitions)
	}
}

// TestModuleIDs: a unit takes the Module ID of the entry keyed by its GPU's address or
// by the nearest bridge above it, with that entry named as the source; a GPU no entry
// names keeps 0 (unknown) and no source; an entry above no GPU is reported.
func TestModuleIDs(t *testing.T) {
	n, tree := reference(t, "b300")
	p, err := Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	p.Name = "op"
	p.Modules = map[string]int{
		n.Addr("rp0").String():                        5, // root port
		n.Addr("rp1").String():                        6, // root port, overridden below by the GPU's own entry
		n.Addr("gpu1").String():                       3,
		n.Addr("bcm-usp2").String():                   1, // the Broadcom switch above gpu2
		n.Addr("gpu-dsp3").String():                   8,
		n.Addr("nvme4").String():                      4, // above no GPU
		n.Addr("holder5").String():                    2,
		pci.MustParseAddress("0000:fe:00.0").String(): 7,
	}
	if err := p.check(); err != nil {
		t.Fatal(err)
	}
	l, err := Label(tree, p)
	if err != nil {
		t.Fatal(err)
	}
	want := map[UnitID]struct {
		id  int
		key string
	}{0: {5, "rp0"}, 1: {3, "gpu1"}, 2: {1, "bcm-usp2"}, 3: {8, "gpu-dsp3"}}
	for _, u := range l.Units {
		w, ok := want[u.ID]
		src := ""
		if ok {
			src = "profile op: modules[" + n.Addr(w.key).String() + "]"
		}
		if u.ModuleID != w.id || u.ModuleSource != src {
			t.Errorf("unit %s: module %d from %q, want %d from %q", u.ID, u.ModuleID, u.ModuleSource, w.id, src)
		}
	}
	probs := strings.Join(l.Problems, "\n")
	for _, key := range []string{n.Addr("rp1").String(), n.Addr("nvme4").String(), n.Addr("holder5").String(), "0000:fe:00.0"} {
		if !strings.Contains(probs, key) {
			t.Errorf("problems do not name %s as holding no GPU:\n%s", key, probs)
		}
	}
	if !strings.Contains(probs, "profile op: modules ") || !strings.Contains(probs, "hold no GPU") {
		t.Errorf("problems:\n%s", probs)
	}
}

// TestModuleAboveTwoGPUs: an entry keyed by a bridge above two GPUs gives its Module ID
// to neither (two GPUs are never one module) and says so; the GPUs' own entries win.
func TestModuleAboveTwoGPUs(t *testing.T) {
	gpu := func(name string) pcitest.Fn {
		return pcitest.Fn{Name: name, Vendor: pcitest.VendorNVIDIA, Device: pcitest.DevB300, Class: pcitest.ClassGPU, Port: pci.PortEndpoint}
	}
	dsp := func(name string, dev uint8, below pcitest.Fn) pcitest.Fn {
		return pcitest.Fn{Name: name, Dev: dev, Vendor: pcitest.VendorBroadcom, Device: pcitest.DevPEX890xx, Class: pcitest.ClassBridge,
			Port: pci.PortDownstream, Below: []pcitest.Fn{below}}
	}
	spec := pcitest.Spec{Hosts: []pcitest.Host{{Bus: 0x10, Fns: []pcitest.Fn{{Name: "rp", Dev: 1, Vendor: pcitest.VendorIntel,
		Device: pcitest.DevRootPort, Class: pcitest.ClassBridge, Port: pci.PortRootPort, Below: []pcitest.Fn{{
			Name: "usp", Vendor: pcitest.VendorBroadcom, Device: pcitest.DevPEX890xx, Class: pcitest.ClassBridge, Port: pci.PortUpstream,
			Below: []pcitest.Fn{dsp("dsp0", 0, gpu("gpuA")), dsp("dsp1", 1, gpu("gpuB")), dsp("dsp2", 2, gpu("gpuC"))}}}}}}}}
	n, tree := scan(t, spec)
	p, err := ParseProfile("two.yaml", []byte(`name: two
modules: {"`+n.Addr("usp").String()+`": 1, "`+n.Addr("gpuC").String()+`": 2}
rules:
  - {name: gpu, role: gpu, match: {vendor: 0x10de, class: 0x030200}}
  - {name: bridge, role: switch-port, match: {bridge: true}}
`))
	if err != nil {
		t.Fatal(err)
	}
	l, err := Label(tree, p)
	if err != nil {
		t.Fatal(err)
	}
	got := map[pci.Address]int{}
	for _, u := range l.Units {
		got[u.GPU.Addr] = u.ModuleID
	}
	if got[n.Addr("gpuA")] != 0 || got[n.Addr("gpuB")] != 0 || got[n.Addr("gpuC")] != 2 {
		t.Errorf("module IDs %v: want gpuA and gpuB 0, gpuC 2", got)
	}
	probs := strings.Join(l.Problems, "\n")
	if !strings.Contains(probs, "modules "+n.Addr("usp").String()+" (Module ID 1) is above the GPUs of gpu0, gpu1: none of them is given it") {
		t.Errorf("problems:\n%s", probs)
	}
}

// TestModulesQEMU: the qemu profile's test wiring gives unit 0 Module ID 2 and unit 1
// Module ID 1, by their root ports, out of PCI order.
func TestModulesQEMU(t *testing.T) {
	_, tree := reference(t, "qemu")
	l := mustLabel(t, tree, "qemu")
	if len(l.Units) != 2 || l.Units[0].ModuleID != 2 || l.Units[1].ModuleID != 1 ||
		l.Units[0].ModuleSource != "profile qemu: modules[0000:00:03.0]" || l.Units[1].ModuleSource != "profile qemu: modules[0000:00:04.0]" {
		for _, u := range l.Units {
			t.Errorf("unit %s: module %d from %q", u.ID, u.ModuleID, u.ModuleSource)
		}
	}
	if len(l.Problems) != 0 {
		t.Errorf("problems %v", l.Problems)
	}
}
