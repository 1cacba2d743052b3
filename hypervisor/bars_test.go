package hypervisor

import (
	"fmt"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/topology"
)

// TestSourcesBARs: a schema 4 manifest's BARs reach the guest's sizing; a function of a
// schema 4 payload without bars has none (sized as such), one of a schema 3 payload is
// unknown (the width a lower bound, named); a BAR that no register can hold is refused,
// naming the unit and function.
func TestSourcesBARs(t *testing.T) {
	m := manifesttest.B300(1)
	src, err := Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	if b := src[0].Functions[0].BARs; len(b) != 3 || b[1].Size != 512<<30 || !b[1].Is64 || !b[1].Prefetch {
		t.Fatalf("gpu0's BARs %+v", b)
	}
	r, err := Render(Input{Sources: src, Units: []topology.UnitID{0}}, FormatQEMU, topology.DomainOptions{})
	if err != nil || r.MMIO.Prefetchable64 != 528<<30 || r.PhysBits != 43 || len(r.MMIO.Unknown) != 0 {
		t.Fatalf("1 unit: %+v, %v", r, err)
	}

	old := manifesttest.B300(1)
	old.SchemaVersion = 3
	for i := range old.Units {
		for k := range old.Units[i].Functions {
			old.Units[i].Functions[k].BARs = nil
		}
	}
	src, err = Sources(old)
	if err != nil {
		t.Fatal(err)
	}
	r, err = Render(Input{Sources: src, Units: []topology.UnitID{0}}, FormatQEMU, topology.DomainOptions{})
	if err != nil || len(r.MMIO.Unknown) != 4 || r.PhysBits != 40 {
		t.Fatalf("schema 3: %+v, %v", r.MMIO, err)
	}

	none := manifesttest.B300(1)
	none.Units[0].Functions[3].BARs = nil // schema 4: a function without BARs
	if src, err = Sources(none); err != nil || src[0].Functions[3].BARs == nil {
		t.Fatalf("schema 4 function without bars: %+v, %v", src[0].Functions[3].BARs, err)
	}

	for _, bad := range []manifest.BAR{{Index: 6, Size: 4096}, {Index: 0, Size: 3 << 20}, {Index: -1, Size: 4096}} {
		m := manifesttest.B300(1)
		m.Units[2].Functions[1].BARs = []manifest.BAR{bad}
		_, err := Sources(m)
		if err == nil || !strings.Contains(err.Error(), "unit gpu2: function "+m.Units[2].Functions[1].BDF+": bar ") {
			t.Errorf("BAR %+v: %v", bad, err)
		}
	}
}

// TestRenderWidths: render sets the width B300 units' BARs demand, 43 bits for 1 unit to
// 46 for 8, as the first line of its QEMU rendering, and refuses each at one bit less,
// naming both widths, before any guest exists. qemu-tests' TestLargeBARGuests boots the
// 1- and 8-unit guests at those widths under OVMF.
func TestRenderWidths(t *testing.T) {
	src, err := Sources(manifesttest.B300(1))
	if err != nil {
		t.Fatal(err)
	}
	for n, want := range map[int]int{1: 43, 2: 44, 4: 45, 8: 46} {
		var ids []topology.UnitID
		for i := range n {
			ids = append(ids, topology.UnitID(i))
		}
		in := Input{Sources: src, Units: ids}
		r, err := Render(in, FormatQEMU, topology.DomainOptions{})
		if err != nil {
			t.Fatalf("%d units: %v", n, err)
		}
		if first := strings.SplitN(string(r.Out), "\n", 2)[0]; r.PhysBits != want || first != fmt.Sprintf("-cpu host,phys-bits=%d \\", want) {
			t.Fatalf("%d units: width %d, first line %q; want %d", n, r.PhysBits, first, want)
		}
		in.PhysBits = want - 1
		if _, err := Render(in, FormatQEMU, topology.DomainOptions{}); err == nil ||
			!strings.Contains(err.Error(), fmt.Sprintf("a %d-bit physical address width; the width given is %d bits", want, want-1)) {
			t.Fatalf("%d units at %d bits: %v", n, want-1, err)
		}
	}
}
