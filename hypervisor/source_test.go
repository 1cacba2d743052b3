package hypervisor

import (
	"errors"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/topology"
)

// unit is a well-formed manifest unit: a GPU, two NICs and an NVMe.
func unit(id, status string) manifest.Unit {
	fn := func(bdf, vendor, class, role string) manifest.Function {
		return manifest.Function{BDF: bdf, Vendor: vendor, Device: "0x1023", SubsystemVendor: vendor, SubsystemDevice: "0x0071",
			Class: class, Role: role, Link: manifest.Link{Speed: "64GT/s", Width: 16, MaxSpeed: "64GT/s", MaxWidth: 16}}
	}
	return manifest.Unit{ID: id, Status: status, NUMANode: 0, UpLink: manifest.Link{Speed: "32GT/s", Width: 16},
		Functions: []manifest.Function{
			fn("0000:1f:00.0", "0x10de", "0x030200", "gpu"),
			fn("0000:1c:00.0", "0x15b3", "0x020700", "gpu-nic"),
			fn("0000:1c:00.1", "0x15b3", "0x020700", "gpu-nic"),
			fn("0000:21:00.0", "0x144d", "0x010802", "gpu-nvme"),
		}}
}

func TestSources(t *testing.T) {
	m := &manifest.Manifest{Units: []manifest.Unit{unit("gpu0", "ready")}}
	src, err := Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	s := src[0]
	if s.ID != 0 || s.Status != topology.StatusReady || s.UpLink.GTs != 32 || s.UpLink.Width != 16 || len(s.Functions) != 4 {
		t.Fatalf("source %+v", s)
	}
	if f := s.Functions[1]; f.Vendor != 0x15b3 || f.Device != 0x1023 || f.Class != 0x020700 || f.Role != topology.RoleGPUNIC || f.Link.GTs != 64 || f.Addr.String() != "0000:1c:00.0" {
		t.Errorf("function %+v", f)
	}
}

// TestSourcesRefuseMalformed: a signed payload is still outside input; each value the
// renderers read and cannot use is an error naming the unit and the function.
func TestSourcesRefuseMalformed(t *testing.T) {
	for name, c := range map[string]struct {
		edit func(u *manifest.Unit)
		want string
	}{
		"unit name":       {func(u *manifest.Unit) { u.ID = "gpu-1" }, `unit "gpu-1"`},
		"status":          {func(u *manifest.Unit) { u.Status = "fine" }, `status "fine"`},
		"bdf":             {func(u *manifest.Unit) { u.Functions[1].BDF = "1c:00.0;" }, "function 1c:00.0;"},
		"vendor":          {func(u *manifest.Unit) { u.Functions[1].Vendor = "15b3" }, "vendor"},
		"upper-case hex":  {func(u *manifest.Unit) { u.Functions[1].Device = "0x1A23" }, "device"},
		"class too wide":  {func(u *manifest.Unit) { u.Functions[1].Class = "0x1020700" }, "class"},
		"role":            {func(u *manifest.Unit) { u.Functions[1].Role = "mgmt-nic" }, "not a passthrough role"},
		"link speed":      {func(u *manifest.Unit) { u.Functions[1].Link.Speed = "128GT/s" }, "link speed"},
		"uplink":          {func(u *manifest.Unit) { u.UpLink.Speed = "fast" }, "uplink"},
		"no gpu first":    {func(u *manifest.Unit) { u.Functions[0], u.Functions[1] = u.Functions[1], u.Functions[0] }, "GPU first"},
		"two gpus":        {func(u *manifest.Unit) { u.Functions[3].Role = "gpu" }, "2 GPUs"},
		"width":           {func(u *manifest.Unit) { u.Functions[1].Link.Width = 64 }, "width"},
		"subsystem wider": {func(u *manifest.Unit) { u.Functions[1].SubsystemDevice = "0x10000" }, "subsystem_device"},
	} {
		u := unit("gpu0", "ready")
		c.edit(&u)
		_, err := Sources(&manifest.Manifest{Units: []manifest.Unit{u}})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error naming %q", name, err, c.want)
		}
	}
	if _, err := Sources(&manifest.Manifest{Units: []manifest.Unit{unit("gpu0", "ready"), unit("gpu0", "ready")}}); err == nil {
		t.Error("a unit listed twice was accepted")
	}
	if _, err := HostCPUs(&manifest.Manifest{NUMACPUs: []manifest.NUMACPUs{{Node: 0, CPUs: "0-3'/>"}}}); err == nil {
		t.Error("a cpulist that is not one was accepted")
	}
}

// TestPlanAdmits: the verdicts the sources carry decide nothing here; Plan reads them.
func TestPlanAdmits(t *testing.T) {
	m := &manifest.Manifest{Units: []manifest.Unit{unit("gpu0", "ready"), unit("gpu1", "degraded"), unit("gpu2", "failed")}}
	m.Units[1].Reasons = []string{"no ATS"}
	m.Units[1].Functions[0].BDF, m.Units[2].Functions[0].BDF = "0000:3f:00.0", "0000:5f:00.0"
	src, err := Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		units []topology.UnitID
		allow bool
		want  string // "" admitted; else the refusal
		n     int
	}{
		{nil, false, "", 1},
		{nil, true, "", 2},
		{[]topology.UnitID{0}, false, "", 1},
		{[]topology.UnitID{1}, false, "gpu1 is degraded (no ATS): only with --allow-degraded", 0},
		{[]topology.UnitID{0, 1}, true, "", 2},
		{[]topology.UnitID{2}, true, "gpu2 is failed", 0},
		{[]topology.UnitID{7}, false, "no unit gpu7", 0},
	} {
		g, deg, err := Plan(Input{Sources: src, Units: c.units, AllowDegraded: c.allow})
		var refused *Refused
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%v allow %v: %v", c.units, c.allow, err)
		case c.want != "" && (!errors.As(err, &refused) || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%v allow %v: %v, want refused: %s", c.units, c.allow, err, c.want)
		case c.want == "" && len(g.Units) != c.n:
			t.Errorf("%v allow %v: %d units, want %d", c.units, c.allow, len(g.Units), c.n)
		case c.want == "" && c.allow && c.n == 2 && (len(deg) != 1 || deg[0].ID != 1):
			t.Errorf("%v: degraded %v, want gpu1", c.units, deg)
		}
	}
}

// TestFixtureIsAManifest: the B300 manifest other packages' tests (metrics, fleet verify)
// build on is one the hypervisor accepts, so what they test is what a node writes.
func TestFixtureIsAManifest(t *testing.T) {
	srcs, err := Sources(manifesttest.B300(1))
	if err != nil {
		t.Fatal(err)
	}
	if len(srcs) != 8 {
		t.Errorf("%d units", len(srcs))
	}
}
