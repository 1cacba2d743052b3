package hypervisor

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/topology"
)

// The units view places a unit in the guest only while it may be passed through: a
// guest plan that lists a failed unit (a plan signed before a later stage failed it, or
// a hostile one) gives it no placement.
func TestUnitsNoPlacementForFailedUnit(t *testing.T) {
	m := manifesttest.B300(1)
	src, err := Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	g, err := topology.PlanGuest(src, topology.GuestOptions{Units: []topology.UnitID{0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	if m.GuestPlan.Plan, err = json.Marshal(g); err != nil {
		t.Fatal(err)
	}
	m.Units[0].Status = manifest.StatusFailed
	doc, err := Units(&manifest.Verified{Manifest: m})
	if err != nil {
		t.Fatal(err)
	}
	if u := doc.Units[0]; u.ID != "gpu0" || u.Guest != nil {
		t.Errorf("failed unit %s has a guest placement %+v", u.ID, u.Guest)
	}
	if u := doc.Units[1]; u.ID != "gpu1" || u.Guest == nil || len(u.Guest.Functions) != 4 {
		t.Errorf("ready unit %s placement %+v, want its 4 functions", u.ID, u.Guest)
	}
}

// A unit on a host NUMA node the platform does not name (numa_node -1) gets a guest cell
// but no memory binding: libvirt's schema has no node -1, and virt-xml-validate judges.
func TestDomainUnknownHostNode(t *testing.T) {
	if _, err := exec.LookPath("virt-xml-validate"); err != nil {
		t.Fatalf("virt-xml-validate is needed for this test (apt-get install libvirt-clients libxml2-utils): %v", err)
	}
	m := manifesttest.B300(1)
	m.Units[0].NUMANode = -1
	src, err := Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, units := range [][]topology.UnitID{{0, 4}, {0}} {
		g, err := topology.PlanGuest(src, topology.GuestOptions{Units: units, NUMA: true})
		if err != nil {
			t.Fatal(err)
		}
		x, err := g.Domain(topology.DomainOptions{Type: "qemu", Name: "passage-numa", VCPUs: 4, MemoryMiB: 2048, HostCPUs: map[int]string{1: "64-127"}})
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(x), `"-1"`) {
			t.Errorf("units %v: a nodeset of -1:\n%s", units, x)
		}
		if len(units) == 2 && (!strings.Contains(string(x), `<memnode cellid="1" mode="strict" nodeset="1">`) || strings.Contains(string(x), `cellid="0"`)) {
			t.Errorf("units %v: want node 1's cell bound, the unknown node's not:\n%s", units, x)
		}
		f := filepath.Join(t.TempDir(), "d.xml")
		os.WriteFile(f, x, 0o644)
		if out, err := exec.Command("virt-xml-validate", f, "domain").CombinedOutput(); err != nil || !strings.Contains(string(out), "validates") {
			t.Errorf("units %v: virt-xml-validate: %v %s\n%s", units, err, out, x)
		}
	}
}
