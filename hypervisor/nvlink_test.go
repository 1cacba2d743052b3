package hypervisor

import (
	"bytes"
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/topology"
)

// hgxLayout is Fabric Manager's default partition table of HGX B200/B300 as module-ID
// sets (Fabric Manager User Guide, "DGX B200/B300 and NVIDIA HGX B200/B300"): IDs 1-15,
// the eight single-GPU partitions included.
var hgxLayout = [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 2}, {3, 4}, {5, 6}, {7, 8},
	{1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}

// nvlinkB300 is manifesttest's B300 with the layout and gpu<i> on module i+1.
func nvlinkB300() *manifest.Manifest {
	m := manifesttest.B300(3)
	m.NVLink = &manifest.NVLink{Partitions: hgxLayout, Source: "profile"}
	for i := range m.Units {
		m.Units[i].ModuleID, m.Units[i].ModuleSource = i+1, "nvml"
	}
	return m
}

func TestNVLinkPartitions(t *testing.T) {
	m := nvlinkB300()
	// Module 3's GPU read no module ID; module 8 is gpu7's in reverse order: the
	// partitions follow module IDs, not unit order.
	m.Units[2].ModuleID = 0
	m.Units[6].ModuleID, m.Units[7].ModuleID = 8, 7
	parts, err := NVLinkPartitions(m)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range parts {
		got = append(got, p.Name()+"="+strings.Join(p.Units, ","))
	}
	want := []string{"1.2=gpu0,gpu1", "3.4=,gpu3", "5.6=gpu4,gpu5", "7.8=gpu7,gpu6",
		"1.2.3.4=gpu0,gpu1,,gpu3", "5.6.7.8=gpu4,gpu5,gpu7,gpu6", "1.2.3.4.5.6.7.8=gpu0,gpu1,,gpu3,gpu4,gpu5,gpu7,gpu6"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("partitions\n%q\nwant\n%q", got, want)
	}
	if parts[1].Whole() || !parts[0].Whole() || parts[3].Index("gpu6") != 1 || parts[3].Index("gpu0") != -1 || parts[1].Index("") != -1 {
		t.Errorf("Whole/Index of %+v", parts[:4])
	}

	for _, c := range []struct {
		name string
		edit func(m *manifest.Manifest)
		want string
	}{
		{"module twice", func(m *manifest.Manifest) { m.Units[5].ModuleID = 5 }, "module 5 is both unit gpu4 and unit gpu5"},
		{"negative module", func(m *manifest.Manifest) { m.Units[1].ModuleID = -2 }, "unit gpu1: module ID -2"},
		{"overlapping pairs", func(m *manifest.Manifest) { m.NVLink.Partitions = append(m.NVLink.Partitions, []int{2, 3}) }, "partitions [1 2] and [2 3] share module 2"},
		{"pair twice", func(m *manifest.Manifest) { m.NVLink.Partitions = append(m.NVLink.Partitions, []int{4, 3}) }, "partition [4 3] listed twice"},
		{"module 0 in layout", func(m *manifest.Manifest) { m.NVLink.Partitions = [][]int{{0, 1}} }, "module ID 0"},
		{"module twice in a set", func(m *manifest.Manifest) { m.NVLink.Partitions = [][]int{{1, 1}} }, "module 1 twice"},
	} {
		m := nvlinkB300()
		c.edit(m)
		if _, err := NVLinkPartitions(m); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}

	// No layout: no partition, whatever the module IDs.
	m = nvlinkB300()
	m.NVLink = nil
	if parts, err := NVLinkPartitions(m); err != nil || parts != nil {
		t.Errorf("without a layout: %v %v", parts, err)
	}
}

// TestNVLinkGuest: only units that are exactly one whole partition are an NVLink guest.
func TestNVLinkGuest(t *testing.T) {
	m := nvlinkB300()
	m.Units[2].ModuleID = 0 // module 3 unknown: {3,4} and {1-4} are never whole
	for _, c := range []struct {
		units []string
		want  string
	}{
		{[]string{"gpu1", "gpu0"}, "1.2"},
		{[]string{"gpu4", "gpu5", "gpu6", "gpu7"}, "5.6.7.8"},
		{[]string{"gpu0"}, ""},                         // one GPU: no NVLink peer
		{[]string{"gpu0", "gpu2"}, ""},                 // no partition
		{[]string{"gpu2", "gpu3"}, ""},                 // gpu2's module unknown
		{[]string{"gpu0", "gpu1", "gpu2", "gpu3"}, ""}, // {1-4} not whole
		{[]string{"gpu0", "gpu1", "gpu4", "gpu5"}, ""}, // two pairs are not one partition
		{[]string{"gpu0", "gpu1", "gpu1"}, ""},
	} {
		p, ok, err := NVLinkGuest(m, c.units)
		if err != nil {
			t.Fatal(err)
		}
		if got := map[bool]string{true: p.Name()}[ok]; got != c.want {
			t.Errorf("units %v: partition %q, want %q", c.units, got, c.want)
		}
	}
}

// TestNVLinks: the NVLinks per GPU are what the boot wrote from its profile into the
// guest plan's host matrix; a manifest that does not record them gives 0.
func TestNVLinks(t *testing.T) {
	m := manifesttest.B300(1)
	if n := NVLinks(m); n != 18 {
		t.Fatalf("NVLinks %d, want the matrix's NV18", n)
	}
	m.GuestPlan.HostMatrix[0][1] = "SYS"
	if n := NVLinks(m); n != 0 {
		t.Errorf("a GPU pair over PCIe: NVLinks %d, want 0", n)
	}
	m.GuestPlan.HostMatrix[0][1] = "NV12"
	if n := NVLinks(m); n != 0 {
		t.Errorf("GPU pairs disagreeing: NVLinks %d, want 0", n)
	}
	m.GuestPlan = nil
	if n := NVLinks(m); n != 0 {
		t.Errorf("no guest plan: NVLinks %d, want 0", n)
	}
}

// TestRenderNCCLNVLinks: Input.NVLinks reaches the NCCL file, one <nvlink> per GPU, and
// only the NCCL file.
func TestRenderNCCLNVLinks(t *testing.T) {
	m := nvlinkB300()
	src, err := Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	in := Input{Sources: src, Units: []topology.UnitID{0, 1}, NVLinks: NVLinks(m)}
	r, err := Render(in, FormatNCCL, topology.DomainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	link := []byte(`<nvlink target="fffffff:ff:ff.0" count="18" tclass="0x068000"></nvlink>`)
	if n := bytes.Count(r.Out, link); n != 2 {
		t.Fatalf("%d NVLinks in the NCCL file of 2 units, want 2:\n%s", n, r.Out)
	}
	in.NVLinks = 0
	if r, err = Render(in, FormatNCCL, topology.DomainOptions{}); err != nil || bytes.Contains(r.Out, []byte("nvlink")) {
		t.Fatalf("without NVLinks: %v\n%s", err, r.Out)
	}
}
