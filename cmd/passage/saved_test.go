package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind"
)

// TestPlanOutApplyPlan: apply --plan executes a saved plan while the node matches it, and
// refuses, naming the difference and writing nothing, when it does not.
func TestPlanOutApplyPlan(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	saved := filepath.Join(t.TempDir(), "node.plan.json")
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", root, "-o", saved, "--erase", "off"}, &out, &errb); code != 0 {
		t.Fatalf("plan --out: exit %d: %s", code, errb.String())
	}
	k := simulatedKernel(t, root)
	env := applyEnv{sysfs: func(string) vfiobind.Sysfs { return k }, modules: func(string, string) vfiobind.ModuleLoader { return k }}
	applyPlan := func(root string) (int, string, string) {
		var out, errb bytes.Buffer
		code := runApply([]string{"--root", root, "--plan", saved}, &out, &errb, env)
		return code, out.String(), errb.String()
	}

	// A node that changed since the plan: refused, nothing written.
	for _, c := range []struct {
		name  string
		build func() string
		want  []string
	}{
		{"port lost its ACS", func() string {
			return pcitest.New(t, b300With(func(s *pcitest.Spec) { s.Fn("gpu-dsp1").ACS = nil })()).Root
		}, []string{"gpu1: planned", `"failed"`, "acs 0000:31:00.0"}},
		{"locked down", func() string {
			r := pcitest.New(t, pcitest.B300()).Root
			p := filepath.Join(r, "sys/kernel/security/lockdown")
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte("none [integrity] confidentiality\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			return r
		}, []string{`lockdown: planned "", now "integrity"`}},
	} {
		r := c.build()
		before := allConfigs(t, r)
		code, stdout, stderr := applyPlan(r)
		if code != 1 || stdout != "" {
			t.Errorf("%s: exit %d, stdout %q; want 1 and nothing", c.name, code, stdout)
		}
		for _, w := range append(c.want, "no longer matches the plan", "nothing written") {
			if !strings.Contains(stderr, w) {
				t.Errorf("%s: refusal lacks %q:\n%s", c.name, w, stderr)
			}
		}
		if fmt.Sprint(allConfigs(t, r)) != fmt.Sprint(before) {
			t.Errorf("%s: config space written", c.name)
		}
	}
	if len(k.Writes()) != 0 {
		t.Errorf("bound after a refusal: %v", k.Writes())
	}

	// The node the plan was made on: executed.
	code, stdout, stderr := applyPlan(root)
	if code != 0 || !strings.Contains(stdout, "acs:  48 ports, 8 written") || !strings.Contains(stdout, "8 of 8 units bound") {
		t.Fatalf("apply --plan: exit %d\n%s\n%s", code, stdout, stderr)
	}
	// Executed, the node no longer matches: the same plan now refuses, naming the ports.
	code, _, stderr = applyPlan(root)
	if code != 1 || !strings.Contains(stderr, "acs 0000:19:00.0: planned") {
		t.Errorf("second apply --plan: exit %d\n%s", code, stderr)
	}

	// --plan takes profile and policy from the plan.
	if code := runApply([]string{"--root", root, "--plan", saved, "--ats", "require"}, &out, &errb, env); code != 2 {
		t.Errorf("--plan with --ats: exit %d, want 2", code)
	}
}
