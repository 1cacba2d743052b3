package topology

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// refNearestGPU is nearestGPU as it was, every GPU's path against d's: the reference
// the index must agree with.
func refNearestGPU(d *pci.Device, gpus []*pci.Device) *pci.Device {
	depth := map[*pci.Device]int{}
	anc := d.Ancestors()
	for i, a := range anc {
		depth[a] = len(anc) - i
	}
	best, bestDepth, tie := (*pci.Device)(nil), 0, false
	for _, g := range gpus {
		dd := 0
		for _, a := range g.Ancestors() {
			if v, ok := depth[a]; ok {
				dd = v
				break
			}
		}
		switch {
		case dd == 0:
		case dd > bestDepth:
			best, bestDepth, tie = g, dd, false
		case dd == bestDepth:
			tie = true
		}
	}
	if tie {
		return nil
	}
	return best
}

// refDistance is distance as it was, every pair of switches compared.
func refDistance(a, b place) string {
	if a.host != b.host {
		if a.numa == b.numa || a.numa < 0 || b.numa < 0 {
			return NODE
		}
		return SYS
	}
	best := -1
	for i, s := range a.switches {
		for j, o := range b.switches {
			if s == o && (best < 0 || i+j < best) {
				best = i + j
			}
		}
	}
	switch {
	case best < 0:
		return PHB
	case best == 0:
		return PIX
	}
	return PXB
}

// randomTree is n functions linked by Parent at random: each a bridge (a root, upstream
// or downstream port, or a conventional bridge) or an endpoint, below a random earlier
// bridge or on a root bus; about one endpoint in gpuOdds is a GPU.
func randomTree(rng *rand.Rand, n, gpuOdds int) (all, gpus, endpoints []*pci.Device) {
	var bridges []*pci.Device
	types := []pci.PortType{pci.PortRootPort, pci.PortUpstream, pci.PortDownstream}
	for i := range n {
		d := &pci.Device{Addr: pci.Address{Domain: uint16(i >> 8), Bus: uint8(i), Device: uint8(i % 32)}, NUMANode: rng.IntN(3) - 1}
		if len(bridges) > 0 && rng.IntN(8) != 0 {
			d.Parent = bridges[rng.IntN(len(bridges))]
		}
		if i < 4 || rng.IntN(3) == 0 {
			d.HeaderType = pci.HeaderTypeBridge
			if k := rng.IntN(4); k < 3 {
				d.Express = &pci.Express{Type: types[k]}
			}
			bridges = append(bridges, d)
		} else {
			d.Express = &pci.Express{Type: pci.PortEndpoint}
			if rng.IntN(gpuOdds) == 0 {
				gpus = append(gpus, d)
			} else {
				endpoints = append(endpoints, d)
			}
		}
		all = append(all, d)
	}
	return all, gpus, endpoints
}

func TestNearestGPUMatchesReference(t *testing.T) {
	found, none := 0, 0
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 1))
		all, gpus, endpoints := randomTree(rng, 20+rng.IntN(200), 1+rng.IntN(6))
		// Bridges too: the index must not care what asks.
		queries := append(append([]*pci.Device{}, endpoints...), all...)
		rng.Shuffle(len(queries), func(i, j int) { queries[i], queries[j] = queries[j], queries[i] })
		x := indexGPUs(gpus)
		for _, d := range queries {
			got, want := x.nearestGPU(d), refNearestGPU(d, gpus)
			if got != want {
				t.Fatalf("seed %d: nearestGPU(%s) = %v, reference %v", seed, d.Addr, got, want)
			}
			if got == nil {
				none++
			} else {
				found++
			}
		}
	}
	if found < 1000 || none < 1000 {
		t.Errorf("the trees are too tame: %d functions with a nearest GPU, %d without", found, none)
	}
}

func TestDistanceMatchesReference(t *testing.T) {
	seen := map[string]int{}
	for seed := range uint64(100) {
		rng := rand.New(rand.NewPCG(seed, 2))
		_, gpus, endpoints := randomTree(rng, 20+rng.IntN(150), 3)
		var places []place
		for _, d := range append(gpus, endpoints...) {
			places = append(places, hostPlace(d))
		}
		for _, a := range places {
			for _, b := range places {
				got, want := distance(a, b), refDistance(a, b)
				if got != want {
					t.Fatalf("seed %d: distance(%+v, %+v) = %s, reference %s", seed, a, b, got, want)
				}
				seen[got]++
			}
		}
	}
	for _, k := range []string{PIX, PXB, PHB, NODE, SYS} {
		if seen[k] < 100 {
			t.Errorf("the trees are too tame: %v", seen)
		}
	}
}

// unitsOf are n units of one GPU and nics NICs each, below one switch per unit.
func unitsOf(n, nics int) []*Unit {
	var out []*Unit
	for i := range n {
		a := pci.Address{Domain: uint16(i >> 4), Bus: uint8(i<<4) | 1}
		rp := &pci.Device{Addr: a, HeaderType: pci.HeaderTypeBridge, Express: &pci.Express{Type: pci.PortRootPort}, NUMANode: i % 2}
		a.Bus++
		usp := &pci.Device{Addr: a, Parent: rp, HeaderType: pci.HeaderTypeBridge, Express: &pci.Express{Type: pci.PortUpstream}}
		u := &Unit{ID: UnitID(i), NUMANode: i % 2, Status: StatusReady}
		for k := range 1 + nics {
			a.Device = uint8(k)
			ep := &pci.Device{Addr: a, Parent: usp, Express: &pci.Express{Type: pci.PortEndpoint}, NUMANode: i % 2}
			if k == 0 {
				u.GPU = ep
			} else {
				u.NICs = append(u.NICs, ep)
			}
		}
		out = append(out, u)
	}
	return out
}

// TestMatrixBounded: up to MaxMatrixEntries GPUs and NICs the host and guest matrices are
// whole; past it they are omitted, with the reason, in the text and the JSON.
func TestMatrixBounded(t *testing.T) {
	full := HostMatrix(unitsOf(MaxMatrixEntries/4, 3), 18)
	if full.Omitted != "" || len(full.Cells) != MaxMatrixEntries || len(full.Cells[0]) != MaxMatrixEntries || len(full.Names) != MaxMatrixEntries {
		t.Fatalf("%d entries: omitted %q, %d rows", MaxMatrixEntries, full.Omitted, len(full.Cells))
	}
	us := unitsOf(MaxMatrixEntries/4, 3)
	if got := full.At(us[0].GPU.Addr, us[0].NICs[0].Addr); got != PIX {
		t.Errorf("GPU and NIC below one switch: %q, want PIX", got)
	}
	if got := full.At(us[0].GPU.Addr, us[1].GPU.Addr); got != "NV18" {
		t.Errorf("two GPUs: %q, want NV18", got)
	}

	over := HostMatrix(unitsOf(MaxMatrixEntries/4+1, 3), 18)
	n := MaxMatrixEntries + 4
	if over.Cells != nil || over.Names != nil || !strings.Contains(over.Omitted, fmt.Sprintf("%d GPUs and NICs", n)) {
		t.Fatalf("%d entries: %d rows, omitted %q", n, len(over.Cells), over.Omitted)
	}
	if got := over.At(us[0].GPU.Addr, us[0].NICs[0].Addr); got != "" {
		t.Errorf("At on an omitted matrix: %q", got)
	}
	if txt := over.Text(); !strings.Contains(txt, over.Omitted) {
		t.Errorf("text %q does not say why the matrix is omitted", txt)
	}
	b, err := json.Marshal(over)
	if err != nil || !strings.Contains(string(b), `"omitted":`) {
		t.Errorf("json %s, %v", b, err)
	}
	if b, _ := json.Marshal(full); strings.Contains(string(b), `"omitted"`) {
		t.Errorf("a whole matrix says omitted")
	}

	// The guest matrix is bounded the same way (a guest plan cannot reach it: every guest
	// function takes a bus number, and there are 256).
	g := &Guest{}
	for i := range MaxMatrixEntries + 1 {
		g.Units = append(g.Units, GuestUnit{Unit: UnitID(i), Upstream: GuestPort{ID: fmt.Sprintf("u%dus", i)},
			Functions: []GuestFunction{{Role: RoleGPU, Addr: pci.Address{Bus: uint8(i)}}}})
	}
	if m := g.Matrix(18); m.Omitted == "" || m.Cells != nil {
		t.Errorf("guest matrix over %d GPUs: omitted %q, %d rows", MaxMatrixEntries+1, m.Omitted, len(m.Cells))
	}
	g.Units = g.Units[:8]
	if m := g.Matrix(18); m.Omitted != "" || len(m.Cells) != 8 || m.Cells[0][1] != "NV18" {
		t.Errorf("guest matrix over 8 GPUs: omitted %q, %d rows", m.Omitted, len(m.Cells))
	}
}

// TestMatrixReferenceWhole: the reference nodes' matrices are far below the bound.
func TestMatrixReferenceWhole(t *testing.T) {
	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	if m := HostMatrix(l.Units, l.Profile.NVLinks); m.Omitted != "" || len(m.Cells) != 24 {
		t.Errorf("b300: omitted %q, %d rows", m.Omitted, len(m.Cells))
	}
}

// crowdedTree is a hostile dump of domains PCI domains, each a root port and a ConnectX-8
// switch (15b3:197c) holding 31 downstream ports: on even ports a GPU and two CX-8 PFs,
// on odd ports two GPUs and a PF (no single nearest GPU), and one PF beside the
// downstream ports, below every GPU of the domain.
func crowdedTree(domains int) *pci.Tree {
	bridge := func(a pci.Address, vendor, device uint16, t pci.PortType, sec uint8) *pci.Device {
		d := &pci.Device{Addr: a, VendorID: vendor, DeviceID: device, Class: pcitest.ClassBridge, HeaderType: pci.HeaderTypeBridge,
			SecondaryBus: sec, SubordinateBus: 0xff, Express: &pci.Express{Type: t}, NUMANode: 0, IOMMUGroup: -1}
		if t != pci.PortUpstream {
			d.ACS = &pci.ACS{Offset: 0x100, Cap: pci.ACSIsolation | pci.ACSDT, Ctl: pci.ACSIsolation}
		}
		return d
	}
	fn := func(a pci.Address, vendor, device uint16, class uint32) *pci.Device {
		return &pci.Device{Addr: a, VendorID: vendor, DeviceID: device, Class: class, Express: &pci.Express{Type: pci.PortEndpoint},
			ATS: &pci.ATS{Offset: 0x200}, IOMMUGroup: -1}
	}
	gpu := func(a pci.Address) *pci.Device { return fn(a, pcitest.VendorNVIDIA, pcitest.DevB300, pcitest.ClassGPU) }
	nic := func(a pci.Address) *pci.Device {
		return fn(a, pcitest.VendorMellanox, pcitest.DevCX8, pcitest.ClassEthernet)
	}
	var devs []*pci.Device
	for k := range domains {
		dom := uint16(k)
		devs = append(devs,
			bridge(pci.Address{Domain: dom, Bus: 0, Device: 1}, pcitest.VendorIntel, pcitest.DevRootPort, pci.PortRootPort, 1),
			bridge(pci.Address{Domain: dom, Bus: 1}, pcitest.VendorMellanox, pcitest.DevCX8Bridge, pci.PortUpstream, 2),
			nic(pci.Address{Domain: dom, Bus: 2, Device: 31}))
		for p := range 31 {
			sec := uint8(3 + p)
			devs = append(devs, bridge(pci.Address{Domain: dom, Bus: 2, Device: uint8(p)}, pcitest.VendorMellanox, pcitest.DevCX8Bridge, pci.PortDownstream, sec),
				gpu(pci.Address{Domain: dom, Bus: sec, Function: 0}), nic(pci.Address{Domain: dom, Bus: sec, Function: 1}))
			if p%2 == 0 {
				devs = append(devs, nic(pci.Address{Domain: dom, Bus: sec, Function: 2}))
			} else {
				devs = append(devs, gpu(pci.Address{Domain: dom, Bus: sec, Function: 2}))
			}
		}
	}
	return pci.NewTree(devs)
}

// planAllocs is what labelling, the ACS plan, the host matrix and a guest plan naming
// every unit allocate on a crowded tree of the given size: mallocs and bytes.
func planAllocs(t *testing.T, domains int) (units int, mallocs, bytes uint64) {
	t.Helper()
	tree := crowdedTree(domains)
	p, err := Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	l, err := Label(tree, p)
	if err != nil {
		t.Fatal(err)
	}
	ports := ACSPlan(l.Units)
	host := HostMatrix(l.Units, p.NVLinks)
	ids := make([]UnitID, 0, len(l.Units))
	for _, u := range l.Units {
		ids = append(ids, u.ID)
	}
	_, gerr := GuestPlan(l.Units, GuestOptions{Units: ids})
	runtime.ReadMemStats(&after)

	if len(l.Units) != 46*domains || len(ports) != 32*domains {
		t.Fatalf("%d domains: %d units, %d ports", domains, len(l.Units), len(ports))
	}
	ties := 0
	for _, pr := range l.Problems {
		if strings.Contains(pr, "no single nearest GPU") {
			ties++
		}
	}
	if ties != 16*domains {
		t.Errorf("%d domains: %d functions without a single nearest GPU, want %d", domains, ties, 16*domains)
	}
	for _, u := range l.Units[:46] {
		odd := u.GPU.Addr.Bus%2 == 0 // bus 3+p: odd ports sit on even buses
		if want := map[bool]int{false: 2, true: 0}[odd]; len(u.NICs) != want {
			t.Errorf("unit %s (GPU %s): %d NICs, want %d", u.ID, u.GPU.Addr, len(u.NICs), want)
		}
	}
	if host.Omitted == "" || gerr == nil {
		t.Errorf("%d units: host matrix omitted %q, guest plan error %v", len(l.Units), host.Omitted, gerr)
	}
	return len(l.Units), after.Mallocs - before.Mallocs, after.TotalAlloc - before.TotalAlloc
}

// TestPlanNearLinear holds topology's part of a plan to what its output explains: ten
// times the units may cost at most fifteen times the allocations and bytes. A term in
// units squared (a matrix, a scan of every GPU per function) makes the ratio near 100.
// It counts allocations, not time, so load on the machine cannot fail it.
func TestPlanNearLinear(t *testing.T) {
	u1, m1, b1 := planAllocs(t, 20)
	u10, m10, b10 := planAllocs(t, 200)
	t.Logf("%d units: %d allocs, %d bytes; %d units: %d allocs, %d bytes (x%.1f, x%.1f)",
		u1, m1, b1, u10, m10, b10, float64(m10)/float64(m1), float64(b10)/float64(b1))
	if r := float64(m10) / float64(m1); r > 15 {
		t.Errorf("allocations grow x%.1f for x10 units", r)
	}
	if r := float64(b10) / float64(b1); r > 15 {
		t.Errorf("bytes grow x%.1f for x10 units", r)
	}
}
