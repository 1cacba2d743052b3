package decision

import (
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// TestDecideNoUnits: a profile that finds none of its units says so, and the decision
// as a whole fails (Err); one that finds them does not.
func TestDecideNoUnits(t *testing.T) {
	prof, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	empty := pcitest.B300()
	empty.Hosts = empty.Hosts[:1]
	for _, c := range []struct {
		name string
		spec pcitest.Spec
		want bool
	}{{"host without GPUs", empty, true}, {"reference", pcitest.B300(), false}} {
		tree, err := pci.Scan(pcitest.New(t, c.spec).Root)
		if err != nil {
			t.Fatal(err)
		}
		d, err := Decide(Input{Tree: tree, Profile: prof})
		if err != nil {
			t.Fatal(err)
		}
		if got := d.NoUnits != "" && d.Err() != nil; got != c.want || (c.want && !strings.Contains(d.NoUnits, "profile b300")) {
			t.Errorf("%s: no units %q, err %v; want the profile's complaint: %v", c.name, d.NoUnits, d.Err(), c.want)
		}
	}
}
