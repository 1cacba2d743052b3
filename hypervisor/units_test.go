package hypervisor

import (
	"encoding/json"
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
