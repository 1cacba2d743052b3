package kubevirthook

import (
	"bytes"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/topology"
)

// TestDefineDomainNVLink: the NCCL file of a domain whose units are one NVLink partition
// of the manifest's layout gives each GPU its NVLinks to the NVSwitch, as NCCL writes
// them in a real B200 guest (topology's TestNCCLTopologyNVLink); a domain of units that
// are not one partition (two units of two pairs, half a quad, a unit of unknown module
// ID, one unit) gets none, and a manifest without a layout none.
func TestDefineDomainNVLink(t *testing.T) {
	layout := func(m *manifest.Manifest) {
		m.NVLink = &manifest.NVLink{Source: "profile", Partitions: [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8},
			{1, 2}, {3, 4}, {5, 6}, {7, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}}
		for i := range m.Units {
			m.Units[i].ModuleID, m.Units[i].ModuleSource = i+1, "test wiring"
		}
		m.Units[6].ModuleID, m.Units[6].ModuleSource = 0, "" // module 7 unknown: {7,8} and {5-8} are no VM's
	}
	link := []byte(`<nvlink target="fffffff:ff:ff.0" count="18" tclass="0x068000"></nvlink>`)
	for _, tc := range []struct {
		units  []string
		layout bool
		want   int // GPUs with an NVLink
	}{
		{[]string{"gpu0", "gpu1"}, true, 2},
		{[]string{"gpu0", "gpu1", "gpu2", "gpu3"}, true, 4},
		{[]string{"gpu0", "gpu2"}, true, 0},
		{[]string{"gpu0", "gpu1", "gpu2"}, true, 0},
		{[]string{"gpu6", "gpu7"}, true, 0},
		{[]string{"gpu4", "gpu5", "gpu6", "gpu7"}, true, 0},
		{[]string{"gpu0"}, true, 0},
		{[]string{"gpu0", "gpu1"}, false, 0},
	} {
		edit := layout
		if !tc.layout {
			edit = nil
		}
		m, path, keys := signed(t, edit)
		c := Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID}
		dom := kubevirtDomain(t, m, tc.units, false)
		r, err := c.DefineDomain(dom)
		if err != nil {
			t.Fatalf("units %v: %v", tc.units, err)
		}
		if n := bytes.Count(r.NCCL, link); n != tc.want {
			t.Errorf("units %v, layout %v: %d GPUs with NVLinks, want %d\n%s", tc.units, tc.layout, n, tc.want, r.NCCL)
		}
		// The file's bus IDs are still the domain's.
		checkNCCL(t, m, r.Domain, r.NCCL)
		o := topology.NCCLOptions{}
		if tc.want > 0 {
			o.NVLinks = 18
		}
		again, err := NCCL(r.Guest, r.Domain, o)
		if err != nil || !bytes.Equal(again, r.NCCL) {
			t.Errorf("units %v: NCCL of the returned domain differs: %v", tc.units, err)
		}
	}
}
