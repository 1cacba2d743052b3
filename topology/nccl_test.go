package topology

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// nvlinkPaths reads an NCCL topology file as elements: for each <nvlink>, the path of
// element names down to it (system/cpu/pci/pci/gpu/nvlink) and its attributes, keyed by
// the bus ID of the <pci> above it.
func nvlinkPaths(t *testing.T, b []byte) map[string][]string {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(b))
	var path []string
	busid := ""
	out := map[string][]string{}
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		switch e := tok.(type) {
		case xml.StartElement:
			path = append(path, e.Name.Local)
			attrs := map[string]string{}
			for _, a := range e.Attr {
				attrs[a.Name.Local] = a.Value
			}
			if e.Name.Local == "pci" {
				busid = attrs["busid"]
			}
			if e.Name.Local == "nvlink" {
				out[busid] = append(out[busid], strings.Join(path, "/")+" target="+attrs["target"]+" count="+attrs["count"]+" tclass="+attrs["tclass"])
			}
		case xml.EndElement:
			path = path[:len(path)-1]
		}
	}
}

// TestNCCLTopologyNVLink: the GPUs of a guest that is one NVLink partition carry their
// NVLinks as NCCL writes them in a real Blackwell guest (testdata/realworld/
// guest-b200x8-nccl-topo.xml, NCCL_TOPO_DUMP_FILE of an 8x B200 VM): under the GPU's
// <pci>, a <gpu> holding one <nvlink> to the NVSwitch the guest cannot see, target
// fffffff:ff:ff.0, tclass 0x068000, count the profile's NVLinks; one level of switch
// above each GPU, as in the dump. No other function carries one, and without NVLinks the
// file is NCCLTopology's, with no <gpu> node (NCCL then asks NVML itself).
func TestNCCLTopologyNVLink(t *testing.T) {
	dump, err := os.ReadFile(filepath.Join("..", "testdata", "realworld", "guest-b200x8-nccl-topo.xml"))
	if err != nil {
		t.Fatal(err)
	}
	real := nvlinkPaths(t, dump)
	if len(real) != 8 {
		t.Fatalf("the real dump has NVLinks on %d GPUs, want 8", len(real))
	}
	var want []string
	for bus, links := range real {
		if want == nil {
			want = links
		}
		if !reflect.DeepEqual(links, want) {
			t.Fatalf("the real dump's GPU %s has NVLinks %q, GPUs before it %q", bus, links, want)
		}
	}
	if len(want) != 1 || want[0] != "system/cpu/pci/pci/gpu/nvlink target=fffffff:ff:ff.0 count=18 tclass=0x068000" {
		t.Fatalf("the real dump's NVLinks: %q", want)
	}

	_, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	for _, numa := range []bool{false, true} {
		g, err := GuestPlan(l.Units, GuestOptions{NUMA: numa})
		if err != nil {
			t.Fatal(err)
		}
		b, err := g.NCCLTopologyWith(NCCLOptions{NVLinks: 18})
		if err != nil {
			t.Fatal(err)
		}
		got := nvlinkPaths(t, b)
		if len(got) != len(g.Units) {
			t.Fatalf("numa=%v: NVLinks on %d functions, want the %d GPUs:\n%s", numa, len(got), len(g.Units), b)
		}
		for _, u := range g.Units {
			gpu := u.Functions[0]
			if gpu.Role != RoleGPU {
				t.Fatalf("unit %s: function 0 is %s", u.Unit, gpu.Role)
			}
			if links := got[gpu.Addr.String()]; !reflect.DeepEqual(links, want) {
				t.Errorf("numa=%v: unit %s GPU %s: NVLinks %q, want the real dump's %q", numa, u.Unit, gpu.Addr, links, want)
			}
		}
		// The file still decodes into the plan's shape, and NCCL's own reader of the
		// dump reads ours: the same struct takes both.
		var sys, realSys ncclSystem
		if err := xml.Unmarshal(b, &sys); err != nil {
			t.Fatal(err)
		}
		if err := xml.Unmarshal(dump, &realSys); err != nil {
			t.Fatal(err)
		}
		rg := realSys.CPUs[0].PCIs[0].PCIs[0]
		if rg.GPU == nil || !reflect.DeepEqual(rg.GPU.NVLinks, []ncclNVLink{{Target: ncclNVSwitchTarget, Count: 18, TClass: ncclNVSwitchClass}}) {
			t.Fatalf("the real dump's first GPU: %+v", rg.GPU)
		}
		if gg := sys.CPUs[0].PCIs[0].PCIs[0]; gg.Class != "0x030200" || !reflect.DeepEqual(gg.GPU, rg.GPU) {
			t.Errorf("numa=%v: first GPU %+v, want its <gpu> as the dump's %+v", numa, gg, rg.GPU)
		}

		plain, err := g.NCCLTopology()
		if err != nil {
			t.Fatal(err)
		}
		none, err := g.NCCLTopologyWith(NCCLOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(plain, none) || bytes.Contains(plain, []byte("<gpu")) || bytes.Contains(plain, []byte("nvlink")) {
			t.Errorf("numa=%v: without NVLinks the file has a <gpu> or differs from NCCLTopology's:\n%s", numa, plain)
		}
	}
}
