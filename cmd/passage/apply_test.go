package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind"
)

// applyCmd runs apply with the erase policy off: these tests are about ACS and binding
// (TestApplyEraseRequired has apply under the b300 profile's default, require).
func applyCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := cmdApply(append(args, "--erase", "off"), &out, &errb)
	return code, out.String(), errb.String()
}

// dtPorts scans the tree and returns the functions whose ACSCtl has DT set.
func dtPorts(t *testing.T, root string) map[string]bool {
	t.Helper()
	tr, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, d := range tr.Devices {
		if d.ACS != nil && d.ACS.Ctl&pci.ACSDT != 0 {
			out[d.Addr.String()] = true
		}
	}
	return out
}

func allConfigs(t *testing.T, root string) map[string]string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(root, pci.DevicesDir, "*", "config"))
	if err != nil || len(m) == 0 {
		t.Fatalf("no configs under %s: %v", root, err)
	}
	out := map[string]string{}
	for _, p := range m {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		out[filepath.Base(filepath.Dir(p))] = string(b)
	}
	return out
}

// The whole pipeline with the real labeller and planner on the reference tree: ACS only
// (the synthetic tree has no kernel to bind drivers), then a second run that changes
// nothing, then a run whose command line already carries the plan.
func TestApplyCLI(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	before := allConfigs(t, n.Root)

	code, out, errs := applyCmd(t, "--root", n.Root, "--dry-run")
	if code != 0 || errs != "" {
		t.Fatalf("dry run: exit %d\n%s\n%s", code, out, errs)
	}
	if got := strings.Count(out, ": would apply"); got != 8 {
		t.Errorf("dry run: %d would-writes, want 8\n%s", got, out)
	}
	if !strings.Contains(out, "dry run: audited only") {
		t.Errorf("dry run output lacks the vfio audit line:\n%s", out)
	}
	if got := allConfigs(t, n.Root); fmt.Sprint(got) != fmt.Sprint(before) {
		t.Errorf("dry run changed config space")
	}

	code, out, errs = applyCmd(t, "--root", n.Root, "--no-bind")
	if code != 0 || errs != "" {
		t.Fatalf("apply: exit %d\n%s\n%s", code, out, errs)
	}
	want := map[string]bool{}
	for i := 0; i < 8; i++ {
		want[n.Addr(fmt.Sprintf("cx-dsp-nic%d", i)).String()] = true
	}
	if got := dtPorts(t, n.Root); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("DT set on %v, want the NIC-side ports %v", got, want)
	}
	for _, l := range []string{"acs:  ", " 8 written", "vfio: skipped (--no-bind)", "kernel argument for this plan: pci=config_acs=", "1x111x1@" + n.Addr("cx-dsp-nic0").String() + ";"} {
		if !strings.Contains(out, l) {
			t.Errorf("output lacks %q:\n%s", l, out)
		}
	}
	if strings.Count(out, ": ready") != 8 {
		t.Errorf("want 8 ready units:\n%s", out)
	}
	after := allConfigs(t, n.Root)

	code, out, _ = applyCmd(t, "--root", n.Root, "--no-bind", "--json")
	if code != 0 {
		t.Fatalf("second run: exit %d\n%s", code, out)
	}
	var rep struct {
		ACS struct {
			Changes []struct {
				Result string `json:"result"`
			} `json:"changes"`
			ConfigACS string `json:"config_acs"`
		} `json:"acs"`
		Units []struct {
			Status string `json:"status"`
		} `json:"units"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("json: %v\n%s", err, out)
	}
	if len(rep.ACS.Changes) < 8*4 || len(rep.Units) != 8 {
		t.Fatalf("second run: %d ports, %d units", len(rep.ACS.Changes), len(rep.Units))
	}
	for _, c := range rep.ACS.Changes {
		if c.Result != "unchanged" {
			t.Errorf("second run: %s", c.Result)
		}
	}
	if got := allConfigs(t, n.Root); fmt.Sprint(got) != fmt.Sprint(after) {
		t.Errorf("second run changed config space")
	}

	// The kernel was given the plan on its command line (and, here, applied it).
	cmdline := "ro " + rep.ACS.ConfigACS + " passage.ats=require"
	if err := os.MkdirAll(filepath.Join(n.Root, "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(n.Root, "proc", "cmdline"), []byte(cmdline+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, _ = applyCmd(t, "--root", n.Root, "--no-bind")
	if code != 0 || strings.Count(out, ": verified") < 8*4 || !strings.Contains(out, "policy require") {
		t.Errorf("verify-only run: exit %d\n%s", code, out)
	}
}

// A NIC without ATS under passage.ats=require: that unit fails and keeps DT off; the
// others are applied; exit 1.
func TestApplyCLIMissingATS(t *testing.T) {
	s := pcitest.B300()
	var strip func(fns []pcitest.Fn)
	strip = func(fns []pcitest.Fn) {
		for i := range fns {
			if fns[i].Name == "nic2.0" {
				fns[i].ATS = nil
			}
			strip(fns[i].Below)
		}
	}
	for i := range s.Hosts {
		strip(s.Hosts[i].Fns)
	}
	n := pcitest.New(t, s)
	code, out, _ := applyCmd(t, "--root", n.Root, "--no-bind", "--ats", "require")
	if code != 1 {
		t.Errorf("exit %d, want 1\n%s", code, out)
	}
	if !strings.Contains(out, "gpu2 "+n.Addr("gpu2").String()+": failed") || !strings.Contains(out, n.Addr("nic2.0").String()+" (15b3:1023): no ATS capability") {
		t.Errorf("output does not fail unit 2 for nic2.0:\n%s", out)
	}
	dt := dtPorts(t, n.Root)
	if len(dt) != 7 || dt[n.Addr("cx-dsp-nic2").String()] {
		t.Errorf("DT on %v: want 7 ports, not unit 2's", dt)
	}
}

func TestApplyCLIUsage(t *testing.T) {
	n := pcitest.New(t, pcitest.Spec{Hosts: []pcitest.Host{{Fns: []pcitest.Fn{pcitest.MgmtNIC("mgmt0", 1, pcitest.VendorBCMNet, pcitest.DevBCM57414)}}}})
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--root", n.Root, "--ats", "always"}, `ats policy "always"`},
		{[]string{"--root", n.Root, "extra"}, `unexpected argument "extra"`},
		{[]string{"--root", filepath.Join(n.Root, "missing")}, "pci scan"},
		{[]string{"--root", n.Root, "--profile", "nosuch"}, "nosuch"},
		{[]string{"--bogus"}, "bogus"},
	} {
		code, _, errs := applyCmd(t, tc.args...)
		if code != 2 || !strings.Contains(errs, tc.want) {
			t.Errorf("%v: exit %d, stderr %q, want 2 and %q", tc.args, code, errs, tc.want)
		}
	}
}

// Binding on a tree whose kernel has no vfio-pci: ACS is still applied, every unit fails
// binding and says why, exit 1.
func TestApplyCLIBindWithoutVFIO(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	code, out, _ := applyCmd(t, "--root", n.Root)
	if code != 1 {
		t.Errorf("exit %d, want 1\n%s", code, out)
	}
	if !strings.Contains(out, "vfio: 0 of 8 units bound") || strings.Count(out, "vfio-pci not registered") != 8 {
		t.Errorf("output:\n%s", out)
	}
	if got := len(dtPorts(t, n.Root)); got != 8 {
		t.Errorf("DT on %d ports, want 8", got)
	}
}

// TestApplyEraseRequired: under the b300 profile's default erase policy (require) apply,
// which erases nothing, fails every unit it would pass through, with the reason, before
// any write: no port is written, none bound. apply --dry-run and plan --for apply say so
// beforehand, with the same verdicts; plan for the boot (which erases) passes them. An
// explicit passage.erase=off on the node's command line binds them.
func TestApplyEraseRequired(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", n.Root}, &out, &errb); code != 0 || !strings.Contains(out.String(), "erase (policy require)") ||
		!strings.Contains(out.String(), "the verdicts predict passage boot") {
		t.Errorf("plan: exit %d, no erase policy or command in:\n%s%s", code, out.String(), errb.String())
	}
	out.Reset()
	if code := cmdPlan([]string{"--root", n.Root, "--for", "apply"}, &out, &errb); code != 1 ||
		!strings.Contains(out.String(), "the verdicts predict passage apply") || !strings.Contains(out.String(), "every unit ends failed") {
		t.Errorf("plan --for apply: exit %d, want 1 saying every unit ends failed:\n%s%s", code, out.String(), errb.String())
	}
	out.Reset()
	if code := cmdApply([]string{"--root", n.Root, "--dry-run", "--json"}, &out, &errb); code != 1 {
		t.Errorf("dry run: exit %d, want 1 %s", code, errb.String())
	}
	dry, _ := unitVerdicts(t, "apply --dry-run", out.String())
	before := allConfigs(t, n.Root)
	k := simulatedKernel(t, n.Root)
	env := applyEnv{sysfs: func(string) vfiobind.Sysfs { return k }, modules: func(string, string) vfiobind.ModuleLoader { return k }}
	out.Reset()
	code := runApply([]string{"--root", n.Root, "--json"}, &out, &errb, env)
	if code != 1 {
		t.Errorf("apply under require: exit %d, want 1", code)
	}
	vs, _ := unitVerdicts(t, "apply", out.String())
	if len(vs) != 8 {
		t.Fatalf("%d units", len(vs))
	}
	for id, v := range vs {
		if !strings.HasPrefix(v, "failed: ") || !strings.Contains(v, "apply does not erase") {
			t.Errorf("%s: %s", id, v)
		}
	}
	if !reflect.DeepEqual(vs, dry) {
		t.Errorf("apply ends with %v; apply --dry-run said %v", vs, dry)
	}
	for _, w := range k.Writes() {
		if strings.Contains(w.Path, "vfio-pci") || strings.HasSuffix(w.Path, "driver_override") {
			t.Errorf("apply under require wrote %s", w.Path)
		}
	}
	if fmt.Sprint(allConfigs(t, n.Root)) != fmt.Sprint(before) {
		t.Errorf("apply under require wrote config space of units it fails")
	}

	n2 := pcitest.New(t, pcitest.B300())
	if err := os.MkdirAll(filepath.Join(n2.Root, "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(n2.Root, "proc/cmdline"), []byte("passage.erase=off\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	k2 := simulatedKernel(t, n2.Root)
	env2 := applyEnv{sysfs: func(string) vfiobind.Sysfs { return k2 }, modules: func(string, string) vfiobind.ModuleLoader { return k2 }}
	out.Reset()
	if code := runApply([]string{"--root", n2.Root, "--json"}, &out, &errb, env2); code != 0 {
		t.Errorf("apply with passage.erase=off: exit %d\n%s", code, out.String())
	}
}
