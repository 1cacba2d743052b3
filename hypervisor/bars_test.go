package hypervisor

import (
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
