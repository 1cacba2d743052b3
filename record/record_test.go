package record

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// TestModuleRecords: each unit's record carries the Module ID the profile gives its GPU
// and the entry it came from, 0 and "" where the profile gives none; the layout is the
// profile's partitions, named; and the records sign and decode as schema 5 has them.
func TestModuleRecords(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	p.Name = "b300-r07"
	p.Modules = map[string]int{n.Addr("rp0").String(): 3, n.Addr("rp5").String(): 8}
	// Check through the JSON a profile file would be, as LoadProfile does.
	p, err = topology.ParseProfile("b300-r07.json", mustJSON(t, p))
	if err != nil {
		t.Fatal(err)
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: p})
	if err != nil {
		t.Fatal(err)
	}
	units := Units(d, d.Decided(), Execution{}, nil)
	if len(units) != 8 {
		t.Fatalf("%d units", len(units))
	}
	for _, u := range units {
		want, src := 0, ""
		switch u.ID {
		case "gpu0":
			want, src = 3, "profile b300-r07: modules["+n.Addr("rp0").String()+"]"
		case "gpu5":
			want, src = 8, "profile b300-r07: modules["+n.Addr("rp5").String()+"]"
		}
		if u.ModuleID != want || u.ModuleSource != src {
			t.Errorf("%s: module %d from %q, want %d from %q", u.ID, u.ModuleID, u.ModuleSource, want, src)
		}
	}
	nv := NVLink(p)
	if nv == nil || !reflect.DeepEqual(nv.Partitions, p.NVLinkPartitions) || nv.Source != "profile b300-r07: nvlink_partitions" {
		t.Fatalf("nvlink %+v", nv)
	}
	nv.Partitions[0][0] = 99
	if p.NVLinkPartitions[0][0] != 1 {
		t.Error("the record shares the profile's partitions")
	}
	if NVLink(&topology.Profile{Name: "bare"}) != nil {
		t.Error("a profile without partitions gives a layout")
	}

	m := &manifest.Manifest{SchemaVersion: manifest.SchemaVersion, Build: manifest.ThisBuild(), Units: units, NVLink: NVLink(p)}
	b, err := manifest.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	back, err := manifest.Unmarshal(b)
	if err != nil {
		t.Fatalf("%v\n%s", err, b)
	}
	if back.Units[0].ModuleID != 3 || back.Units[1].ModuleID != 0 || back.Units[1].ModuleSource != "" || len(back.NVLink.Partitions) != 15 {
		t.Errorf("decoded %+v, nvlink %+v", back.Units[:2], back.NVLink)
	}
}

func mustJSON(t *testing.T, p *topology.Profile) []byte {
	t.Helper()
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
