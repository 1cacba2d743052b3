package bench

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// The decision's cost against the number of GPU units, on in-memory trees: what
// `passage plan` computes for a dump (pci.ReadDump links its functions with pci.NewTree,
// as these trees are linked). Building a 20 000-GPU sysfs tree on disk would take minutes
// and measure the file system; the point here is the plan's complexity.
//
//	go test ./bench/ -run '^$' -bench 'DecideGPUs' -benchtime 1x -benchmem
//
// TestDecideNearLinear holds the growth to what the output's own growth explains.

// b300Template is the reference B300 node, a ConnectX-8 data-direct function beside each
// unit's PFs, scanned once from a pcitest tree: 8 GPU units, the management NICs and the
// NVSwitch complex. Its functions are copied, never changed.
var b300Template = sync.OnceValues(func() ([]*pci.Device, error) {
	spec := pcitest.B300()
	for i := range pcitest.B300GPUBuses {
		dsp := spec.Fn(fmt.Sprintf("cx-dsp-nic%d", i))
		if dsp == nil {
			return nil, fmt.Errorf("pcitest.B300 has no cx-dsp-nic%d", i)
		}
		dsp.Below = append(dsp.Below, pcitest.Fn{Name: fmt.Sprintf("dd%d", i), Func: 2, Vendor: pcitest.VendorMellanox,
			Device: pcitest.DevCX8DD, SubVendor: pcitest.VendorMellanox, Class: pcitest.ClassEthernet, Port: pci.PortEndpoint,
			Link: pcitest.Link{Speed: pcitest.Gen6, Width: 16}, ATS: &pcitest.ATS{},
			VPD: &pci.VPD{Name: "NVIDIA ConnectX-8 data direct", Keywords: map[string]string{"V3": fmt.Sprintf("c8a1b2c3d4e5f6%02d", i)}}})
	}
	dir, err := ScratchDir("bench-plan-scale-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	n, err := pcitest.Build(dir, spec)
	if err != nil {
		return nil, err
	}
	tree, err := pci.Scan(n.Root)
	if err != nil {
		return nil, err
	}
	if err := tree.Err(); err != nil {
		return nil, err
	}
	return tree.Devices, nil
})

// scaledB300 is a tree of gpus GPU units (a multiple of 8): the template node copied into
// gpus/8 PCI domains, each copy with IOMMU groups and ConnectX VPD serials of its own, as
// one dump holding many B300 nodes would read.
func scaledB300(tb testing.TB, gpus int) *pci.Tree {
	tb.Helper()
	tmpl, err := b300Template()
	if err != nil {
		tb.Fatal(err)
	}
	if gpus%8 != 0 || gpus/8 > 0x10000 {
		tb.Fatalf("scaledB300(%d): want a multiple of 8 up to %d", gpus, 8*0x10000)
	}
	groups := 0
	for _, d := range tmpl {
		groups = max(groups, d.IOMMUGroup+1)
	}
	nodes := gpus / 8
	devs := make([]*pci.Device, 0, nodes*len(tmpl))
	copies := make([]pci.Device, nodes*len(tmpl))
	for k := range nodes {
		for i, t := range tmpl {
			c := &copies[k*len(tmpl)+i]
			*c = *t
			c.Addr.Domain = uint16(k)
			c.SysPath, c.Parent, c.Children, c.Problems = "", nil, nil, nil
			if c.IOMMUGroup >= 0 {
				c.IOMMUGroup += k * groups
			}
			if t.ACS != nil {
				acs := *t.ACS
				c.ACS = &acs
			}
			if t.VPD != nil {
				v := *t.VPD
				v.Keywords = map[string]string{}
				for key, val := range t.VPD.Keywords {
					v.Keywords[key] = val
				}
				if v3 := v.Keywords["V3"]; v3 != "" {
					v.Keywords["V3"] = fmt.Sprintf("%s-%04x", v3, k)
				}
				c.VPD = &v
			}
			devs = append(devs, c)
		}
	}
	return pci.NewTree(devs)
}

var b300Profile = sync.OnceValues(func() (*topology.Profile, error) { return topology.Builtin("b300") })

// decideScaled decides on tree and checks the decision is the one the node calls for:
// every unit labelled and complete, ready, with its ACS ports.
func decideScaled(tb testing.TB, tree *pci.Tree, gpus int) *decision.Decision {
	tb.Helper()
	prof, err := b300Profile()
	if err != nil {
		tb.Fatal(err)
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: prof})
	if err != nil {
		tb.Fatal(err)
	}
	if d.LabelErr != nil {
		tb.Fatal(d.LabelErr)
	}
	if len(d.Units()) != gpus || len(d.ACS) != 6*gpus {
		tb.Fatalf("%d GPUs: %d units, %d ACS ports", gpus, len(d.Units()), len(d.ACS))
	}
	for _, u := range d.Units() {
		if u.Status != topology.StatusReady || len(u.NICs) != 2 || len(u.DataDirect) != 1 || len(u.NVMe) != 1 {
			tb.Fatalf("unit %s: %s %v, %d NICs, %d data-direct, %d NVMe", u.ID, u.Status, u.Reasons, len(u.NICs), len(u.DataDirect), len(u.NVMe))
		}
	}
	return d
}

func benchDecideGPUs(b *testing.B, gpus int) {
	tree := scaledB300(b, gpus)
	runtime.GC()
	b.ReportAllocs()
	for b.Loop() {
		decideScaled(b, tree, gpus)
	}
	b.ReportMetric(float64(len(tree.Devices)), "fns")
}

func BenchmarkDecideGPUs1k(b *testing.B)  { benchDecideGPUs(b, 1000) }
func BenchmarkDecideGPUs10k(b *testing.B) { benchDecideGPUs(b, 10000) }
func BenchmarkDecideGPUs20k(b *testing.B) { benchDecideGPUs(b, 20000) }

// decideAllocs is what one decision on a tree of gpus GPU units allocates: mallocs and
// bytes. The tree is built first and not counted.
func decideAllocs(t *testing.T, gpus int) (mallocs, bytes uint64) {
	t.Helper()
	tree := scaledB300(t, gpus)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	d := decideScaled(t, tree, gpus)
	runtime.ReadMemStats(&after)
	// Past topology.MaxMatrixEntries the host matrix says it is omitted rather than
	// holding (3*gpus)^2 cells, and a guest of every unit does not fit one pcie.0.
	if d.Host == nil || d.Host.Omitted == "" || d.Host.Cells != nil || d.GuestErr == nil {
		t.Fatalf("%d GPUs: host matrix omitted %q with %d rows, guest error %v", gpus, d.Host.Omitted, len(d.Host.Cells), d.GuestErr)
	}
	return after.Mallocs - before.Mallocs, after.TotalAlloc - before.TotalAlloc
}

// TestDecideNearLinear: ten times the GPU units (ten times the functions, units, ACS
// ports and findings) may cost at most fifteen times the allocations and bytes; a term
// in units squared (a matrix, a scan of every GPU per function) makes it near 100. It
// counts allocations, never time, so load on the machine cannot fail it.
func TestDecideNearLinear(t *testing.T) {
	m1, b1 := decideAllocs(t, 1000)
	m10, b10 := decideAllocs(t, 10000)
	t.Logf("1k GPUs: %d allocs, %d bytes; 10k GPUs: %d allocs, %d bytes (x%.1f, x%.1f)",
		m1, b1, m10, b10, float64(m10)/float64(m1), float64(b10)/float64(b1))
	if r := float64(m10) / float64(m1); r > 15 {
		t.Errorf("allocations grow x%.1f for x10 GPU units", r)
	}
	if r := float64(b10) / float64(b1); r > 15 {
		t.Errorf("bytes grow x%.1f for x10 GPU units", r)
	}
}

// TestDecideTemplateWhole: at the size of a real node the decision keeps its matrices.
func TestDecideTemplateWhole(t *testing.T) {
	d := decideScaled(t, scaledB300(t, 8), 8)
	if d.Host.Omitted != "" || len(d.Host.Cells) != 8+16 || d.GuestErr != nil || d.GuestMatrix == nil || len(d.GuestMatrix.Cells) != 8+16 {
		t.Fatalf("8 GPUs: host matrix omitted %q with %d rows, guest error %v", d.Host.Omitted, len(d.Host.Cells), d.GuestErr)
	}
}
