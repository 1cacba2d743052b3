package bench

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// scriptPosition is how the script names a topology position: it tells only the port
// that gets DT apart from the rest.
func scriptPosition(pos string) string {
	if pos == topology.PosNICPort {
		return "nic-port"
	}
	return "other"
}

// passagePlan is topology's ACS plan for the tree in the script's terms, in address order.
func passagePlan(t *testing.T, root, profile string) []ScriptPort {
	t.Helper()
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	prof, err := topology.Builtin(profile)
	if err != nil {
		t.Fatal(err)
	}
	labels, err := topology.Label(tree, prof)
	if err != nil {
		t.Fatal(err)
	}
	var want []ScriptPort
	for _, p := range topology.ACSPlan(labels.Units) {
		want = append(want, ScriptPort{Addr: p.Addr, Position: scriptPosition(p.Position), Current: p.Current, Target: p.Target()})
	}
	slices.SortFunc(want, func(a, b ScriptPort) int {
		if a.Addr == b.Addr {
			return 0
		}
		if a.Addr.Less(b.Addr) {
			return -1
		}
		return 1
	})
	return want
}

func needPciutils(t *testing.T) {
	t.Helper()
	for _, c := range []string{"lspci", "setpci", "bash"} {
		if _, err := exec.LookPath(c); err != nil {
			t.Fatalf("%s not installed (make deps installs pciutils): %v", c, err)
		}
	}
}

// The baseline must plan what passage plans, or the benchmark compares unequal work.
func TestScriptPlanEqualsACSPlan(t *testing.T) {
	needPciutils(t)
	for _, tc := range []struct {
		name, profile string
		spec          pcitest.Spec
	}{
		{"B300", "b300", pcitest.B300()},
		{"B200", "b200", pcitest.B200()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, tc.spec)
			want := passagePlan(t, n.Root, tc.profile)
			if len(want) == 0 {
				t.Fatal("topology planned no ports")
			}
			out, err := RunScript(ScriptPath(), n.Root, false)
			if err != nil {
				t.Fatal(err)
			}
			got, err := ParseScript(out)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want) {
				t.Errorf("acs-plan.sh differs from topology.ACSPlan\n got: %v\nwant: %v", got, want)
			}
			changed := 0
			for _, p := range want {
				if p.Current != p.Target {
					changed++
				}
			}
			if changed == 0 {
				t.Error("the reference tree needs no ACS change: the comparison proves nothing")
			}
		})
	}
}

// With --apply the script leaves every planned port at its target and every passthrough
// function's driver_override on vfio-pci, and a second run finds nothing to change.
func TestScriptApply(t *testing.T) {
	needPciutils(t)
	n := pcitest.New(t, pcitest.B300())
	want := passagePlan(t, n.Root, "b300")
	if _, err := RunScript(ScriptPath(), n.Root, true); err != nil {
		t.Fatal(err)
	}
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range want {
		d := tree.Lookup(p.Addr)
		if d == nil || d.ACS == nil {
			t.Fatalf("%s: no ACS after apply", p.Addr)
		}
		if d.ACS.Ctl != p.Target {
			t.Errorf("%s: ACSCtl %#04x after apply, want %#04x", p.Addr, uint16(d.ACS.Ctl), uint16(p.Target))
		}
	}
	overrides := 0
	for _, d := range tree.Devices {
		passthrough := d.IDs() == "10de:3182" || d.IDs() == "15b3:1023" || d.IDs() == "144d:a80a"
		if got := d.DriverOverride == "vfio-pci"; got != passthrough {
			t.Errorf("%s (%s): driver_override %q", d.Addr, d.IDs(), d.DriverOverride)
		}
		if passthrough {
			overrides++
		}
	}
	if overrides != 32 {
		t.Errorf("%d passthrough functions, want 32 (8 GPUs, 16 CX-8 PFs, 8 NVMe)", overrides)
	}
	probe, err := os.ReadFile(filepath.Join(n.Root, "sys/bus/pci/drivers_probe"))
	if err != nil || strings.TrimSpace(string(probe)) == "" {
		t.Errorf("drivers_probe not written: %q, %v", probe, err)
	}
	out, err := RunScript(ScriptPath(), n.Root, false)
	if err != nil {
		t.Fatal(err)
	}
	again, err := ParseScript(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range again {
		if p.Current != p.Target {
			t.Errorf("%s: still %#04x, want %#04x after apply", p.Addr, uint16(p.Current), uint16(p.Target))
		}
	}
}

func TestParseScriptRejects(t *testing.T) {
	for _, in := range []string{
		"0000:ec:00.0 nic-port 0x001d\n",
		"zz:00.0 other 0x001d 0x001d\n",
		"0000:ec:00.0 other 0x1d 0xfffff\n",
	} {
		if _, err := ParseScript([]byte(in)); err == nil {
			t.Errorf("%q: no error", in)
		}
	}
}
