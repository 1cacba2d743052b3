package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// unitFunctionAddrs returns the addresses of a unit's functions under the b300 profile.
func unitFunctionAddrs(t *testing.T, root string, id topology.UnitID) []pci.Address {
	t.Helper()
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.LoadProfile("b300")
	if err != nil {
		t.Fatal(err)
	}
	labels, err := topology.Label(tree, p)
	if labels == nil {
		t.Fatal(err)
	}
	var out []pci.Address
	for _, d := range labels.Unit(id).Functions() {
		if d != nil {
			out = append(out, d.Addr)
		}
	}
	return out
}

// A tree whose driver links do not move when unbind writes (what a kernel that hands
// the functions straight back to vfio-pci looks like): every store succeeds, and unbind
// used to print the functions and exit 0. Each function still on vfio-pci is a failure
// named on stderr, and the exit is 1.
func TestUnbindStillOnVFIOFails(t *testing.T) {
	for _, asJSON := range []bool{false, true} {
		n := unbindTree(t)
		args := []string{"--root", n.Root, "--unit", "gpu3"}
		if asJSON {
			args = append(args, "--json")
		}
		var out, errb bytes.Buffer
		rc := cmdUnbind(args, &out, &errb)
		if rc != 1 {
			t.Errorf("json=%v: rc %d, want 1; stderr %q", asJSON, rc, errb.String())
		}
		fns := []string{"gpu3", "nic3.0", "nic3.1", "nvme3"}
		for _, name := range fns {
			want := n.Addr(name).String() + ": still on vfio-pci after release"
			if !strings.Contains(errb.String(), want) {
				t.Errorf("json=%v: stderr %q does not say %q", asJSON, errb.String(), want)
			}
		}
		if !strings.Contains(errb.String(), "4 of 4 functions not released") {
			t.Errorf("json=%v: stderr %q has no count of the functions not released", asJSON, errb.String())
		}
		if !asJSON {
			if got := strings.Count(out.String(), "vfio-pci -> vfio-pci"); got != len(fns) {
				t.Errorf("%d lines show vfio-pci -> vfio-pci, want %d:\n%s", got, len(fns), out.String())
			}
			continue
		}
		var reps []vfiobind.FunctionReport
		if err := json.Unmarshal(out.Bytes(), &reps); err != nil {
			t.Fatalf("%v: %s", err, out.String())
		}
		for _, r := range reps {
			if r.DriverAfter != vfiobind.VFIODriver || !strings.Contains(r.Err, "still on vfio-pci") {
				t.Errorf("report %+v: want driver_after vfio-pci and an error", r)
			}
		}
	}
}

// The same unit released through a simulated kernel: the functions end on their host
// drivers, which unbind reports, and the exit is 0. (unbind_test.go's TestUnbindUnit runs
// on a tree whose links never move, which unbind now rightly refuses to call a release.)
func TestUnbindUnitSimulated(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	os.MkdirAll(filepath.Join(n.Root, "proc"), 0o755)
	k, err := vfiotest.New(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.LoadProfile("b300")
	if err != nil {
		t.Fatal(err)
	}
	labels, err := topology.Label(tree, p)
	if labels == nil {
		t.Fatal(err)
	}
	rep, err := vfiobind.Bind(context.Background(), k, tree, []*topology.Unit{labels.Unit(3)}, vfiobind.Options{Modules: k})
	if err != nil || !rep.Units[0].Bound() {
		t.Fatalf("bind unit 3: %v %+v", err, rep)
	}
	env := unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }}
	var out, errb bytes.Buffer
	if rc := runUnbind([]string{"--root", n.Root, "--unit", "gpu3", "--json"}, &out, &errb, env); rc != 0 {
		t.Fatalf("rc %d: %s", rc, errb.String())
	}
	var reps []vfiobind.FunctionReport
	if err := json.Unmarshal(out.Bytes(), &reps); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	want := map[pci.Address]string{n.Addr("gpu3"): "nvidia", n.Addr("nic3.0"): "mlx5_core", n.Addr("nic3.1"): "mlx5_core", n.Addr("nvme3"): "nvme"}
	if len(reps) != len(want) {
		t.Fatalf("%d reports, want %d", len(reps), len(want))
	}
	for _, r := range reps {
		if r.DriverBefore != vfiobind.VFIODriver || r.DriverAfter != want[r.Addr] || r.Err != "" {
			t.Errorf("report %+v, want vfio-pci -> %s", r, want[r.Addr])
		}
	}
	for _, a := range unitFunctionAddrs(t, n.Root, 3) {
		if drv, _ := k.ReadLink("sys/bus/pci/devices/" + a.String() + "/driver"); strings.HasSuffix(drv, "/"+vfiobind.VFIODriver) {
			t.Errorf("%s still on vfio-pci", a)
		}
	}
}
