package recycle_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/record"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
)

// modulesProfile writes an operator's profile file: the built-in b300's YAML, renamed,
// with modules keyed on the synthetic B300's GPU addresses (gpu<i> is module 8-i, out of
// PCI order so that an ID taken from the unit's place would not pass).
func modulesProfile(t *testing.T, n *node) string {
	t.Helper()
	b, err := os.ReadFile("../topology/profiles/b300.yaml")
	if err != nil {
		t.Fatal(err)
	}
	src := strings.Replace(string(b), "\nname: b300\n", "\nname: b300-modules\n", 1)
	if src == string(b) {
		t.Fatal("b300.yaml: no name: b300 line")
	}
	var mods strings.Builder
	mods.WriteString("modules:\n")
	for i := range 8 {
		fmt.Fprintf(&mods, "  %q: %d\n", n.pn.Addr(fmt.Sprintf("gpu%d", i)).String(), 8-i)
	}
	p := filepath.Join(t.TempDir(), "b300-modules.yaml")
	if err := os.WriteFile(p, []byte(src+"\n"+mods.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestRecycleKeepsModules: on a B300 whose profile file gives every GPU its Module ID,
// a generation that carries them (as the boot signs it) is recycled for unit 3. In the
// generation the recycle signs, every unit keeps its module_id and module_source (the
// recycled one from the profile's decision, the others carried), and the manifest its
// NVLink layout. Without a verified earlier manifest the units the recycle does not
// vouch for are failed, and still carry their Module IDs.
func TestRecycleKeepsModules(t *testing.T) {
	for _, carried := range []bool{true, false} {
		t.Run(fmt.Sprintf("carried=%v", carried), func(t *testing.T) {
			n := newNode(t)
			file := modulesProfile(t, n)
			prof, err := topology.LoadProfile(file)
			if err != nil {
				t.Fatal(err)
			}
			lab, err := topology.Label(n.tree, prof)
			if err != nil {
				t.Fatal(err)
			}
			want := map[string][2]string{}
			for _, u := range lab.Units {
				if u.ModuleID == 0 || !strings.Contains(u.ModuleSource, "profile b300-modules: modules[") {
					t.Fatalf("unit %s: module %d from %q: the profile gave it none", u.ID, u.ModuleID, u.ModuleSource)
				}
				want[u.ID.String()] = [2]string{fmt.Sprint(u.ModuleID), u.ModuleSource}
			}
			if len(want) != 8 {
				t.Fatalf("%d units", len(want))
			}
			// The boot's generation with the profile's Module IDs and layout.
			boot := n.latest(t)
			for i := range boot.Units {
				u := lab.Unit(topology.UnitID(i))
				boot.Units[i].ModuleID, boot.Units[i].ModuleSource = u.ModuleID, u.ModuleSource
			}
			boot.NVLink = record.NVLink(prof)
			boot.Generation, boot.GenerationSource, err = manifest.NextGeneration(manifest.FileCounter{Path: n.gen})
			if err != nil {
				t.Fatal(err)
			}
			boot.Time = time.Now().UTC()
			if _, err := manifest.WriteSigned(context.Background(), boot, n.dir, recycle.EnvelopeName, nil, n.signer); err != nil {
				t.Fatal(err)
			}

			o := n.opts(3)
			o.Profile = file
			if !carried {
				o.Verifier = nil // no earlier manifest to carry units from
			}
			res, err := recycle.Run(context.Background(), o)
			if err != nil || !res.Completed {
				t.Fatalf("recycle: %v", err)
			}
			m := n.latest(t)
			if m.Generation <= boot.Generation {
				t.Fatalf("generation %d after %d", m.Generation, boot.Generation)
			}
			if len(m.Units) != 8 {
				t.Fatalf("%d units in generation %d", len(m.Units), m.Generation)
			}
			for _, u := range m.Units {
				if got := [2]string{fmt.Sprint(u.ModuleID), u.ModuleSource}; got != want[u.ID] {
					t.Errorf("unit %s (%s) in generation %d: module %s from %q, want %s from %q", u.ID, u.Status, m.Generation, got[0], got[1], want[u.ID][0], want[u.ID][1])
				}
			}
			if s := unitOf(m, "gpu3").Status; s != manifest.StatusReady {
				t.Errorf("gpu3 %s after its recycle", s)
			}
			if !carried && unitOf(m, "gpu0").Status != manifest.StatusFailed {
				t.Errorf("gpu0 %s with no earlier manifest to carry it from", unitOf(m, "gpu0").Status)
			}
			if m.NVLink == nil || !reflect.DeepEqual(m.NVLink.Partitions, boot.NVLink.Partitions) {
				t.Errorf("generation %d's NVLink layout %+v, the boot's %+v", m.Generation, m.NVLink, boot.NVLink)
			}
		})
	}
}
