package main

import (
	"context"
	"encoding/json"
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// TestUnitListValues: --unit takes units repeated, comma-separated or both, in the order
// given and each once; "all" only where the command has every unit as a choice, and
// never beside a named unit.
func TestUnitListValues(t *testing.T) {
	for _, tc := range []struct {
		allowAll bool
		args     []string
		want     string // the list, or the error's text
		all      bool
	}{
		{true, nil, "", true},
		{true, []string{"--unit", "gpu0,gpu1"}, "gpu0,gpu1", false},
		{true, []string{"--unit", "1", "--unit", "gpu0"}, "gpu1,gpu0", false},
		{true, []string{"--unit", "1,2", "--unit", "3"}, "gpu1,gpu2,gpu3", false},
		{true, []string{"--unit", "1", "--unit", "gpu1"}, "gpu1", false},
		{true, []string{"--unit", "all"}, "", true},
		{true, []string{"--unit", "all,gpu2"}, "all is every unit: not with gpu2", false},
		{true, []string{"--unit", "x"}, `unit "x": want all, or units like gpu0,gpu1`, false},
		{true, []string{"--unit", "0,,1"}, `unit "": want all`, false},
		{false, nil, "", false},
		{false, []string{"--unit", "3", "--unit", "4,5"}, "gpu3,gpu4,gpu5", false},
		{false, []string{"--unit", "all"}, `unit "all": want units like gpu0,gpu1`, false},
		{false, []string{"--unit", "-1"}, `unit "-1": want units like`, false},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		var u unitList
		u.register(fs, "units", tc.allowAll)
		err := fs.Parse(tc.args)
		switch {
		case err != nil:
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%v (all allowed %v): error %q, want %q", tc.args, tc.allowAll, err, tc.want)
			}
		case u.names() != tc.want || u.all != tc.all || (u.units() == nil) != (tc.all || tc.want == ""):
			t.Errorf("%v (all allowed %v): units %q all %v, want %q all %v", tc.args, tc.allowAll, u.names(), u.all, tc.want, tc.all)
		}
	}
}

// deprecation is the line an old spelling prints, once.
func deprecation(cmd, old, now string) string {
	return "passage " + cmd + ": " + old + " is deprecated, use " + now + "\n"
}

// TestPlanUnitFlag: plan's guest plan lays out the units --unit names, however they are
// spelled; the old --units does the same and says once that it goes.
func TestPlanUnitFlag(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	guest := func(args ...string) (string, string) {
		t.Helper()
		code, out, errs := runCmd(t, cmdPlan, append([]string{"--root", n.Root}, args...)...)
		if code != 0 {
			t.Fatalf("plan %v: exit %d: %s", args, code, errs)
		}
		i := strings.Index(out, "guest matrix (units ")
		if i < 0 {
			t.Fatalf("plan %v: no guest matrix in\n%s", args, out)
		}
		return out[i : i+strings.IndexByte(out[i:], '\n')], errs
	}
	all, _ := guest()
	if !strings.Contains(all, "gpu0,gpu1,gpu2,gpu3,gpu4,gpu5,gpu6,gpu7") {
		t.Errorf("plan without --unit: %q, want every unit", all)
	}
	one, errs := guest("--unit", "gpu5")
	if !strings.Contains(one, "(units gpu5") || strings.Contains(one, "gpu4") || errs != "" {
		t.Errorf("plan --unit gpu5: %q, stderr %q", one, errs)
	}
	comma, _ := guest("--unit", "2,3")
	if !strings.Contains(comma, "(units gpu2,gpu3") {
		t.Errorf("plan --unit 2,3: %q", comma)
	}
	for _, args := range [][]string{{"--unit", "2", "--unit", "gpu3"}, {"--unit", "gpu2,gpu3", "--unit", "3"}} {
		if rep, errs := guest(args...); rep != comma || errs != "" {
			t.Errorf("plan %v: %q, stderr %q; want %q as --unit 2,3", args, rep, errs, comma)
		}
	}
	if rep, _ := guest("--unit", "all"); rep != all {
		t.Errorf("plan --unit all: %q, want %q", rep, all)
	}
	old, errs := guest("--units", "2,3")
	if old != comma || errs != deprecation("plan", "--units", "--unit") {
		t.Errorf("plan --units 2,3: %q, stderr %q; want %q and one deprecation line", old, errs, comma)
	}
	code, _, errs := runCmd(t, cmdPlan, "--root", n.Root, "--unit", "gpu1,x")
	if code != 2 || !strings.Contains(errs, `unit "x"`) {
		t.Errorf("plan --unit gpu1,x: exit %d, stderr %q", code, errs)
	}
}

// TestRenderUnitFlag: render lays out the units --unit names, repeated or
// comma-separated, from a tree and from a manifest; --units still does, with its line.
func TestRenderUnitFlag(t *testing.T) {
	n := bootSigned(t, pcitest.B300())
	tree, err := pci.Scan(n.root)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := topology.LoadProfile("b300")
	labels, _ := topology.Label(tree, p)
	gpu := func(i int) string { return "vfio-pci,host=" + labels.Unit(topology.UnitID(i)).GPU.Addr.String() }
	for _, from := range [][]string{{"--root", n.root}, {n.envelope, "--pub", n.pub}} {
		render := func(args ...string) (string, string) {
			t.Helper()
			code, out, errs := runCmd(t, cmdRender, append(append([]string{}, from...), args...)...)
			if code != 0 {
				t.Fatalf("render %v %v: exit %d: %s", from, args, code, errs)
			}
			return out, errs
		}
		comma, _ := render("--unit", "1,6")
		if !strings.Contains(comma, gpu(1)) || !strings.Contains(comma, gpu(6)) || strings.Contains(comma, gpu(0)) {
			t.Errorf("render %v --unit 1,6 lays out other units:\n%s", from, comma)
		}
		if out, _ := render("--unit", "gpu1", "--unit", "6"); out != comma {
			t.Errorf("render %v --unit gpu1 --unit 6 differs from --unit 1,6", from)
		}
		out, errs := render("--units", "1,6")
		if out != comma || strings.Count(errs, deprecation("render", "--units", "--unit")) != 1 {
			t.Errorf("render %v --units 1,6: same output %v, stderr %q", from, out == comma, errs)
		}
	}
}

// TestVerifyByUnitFlag: verify --by-unit prints the manifest unit by unit; the old
// --units prints the same and says once that it goes.
func TestVerifyByUnitFlag(t *testing.T) {
	n := bootSigned(t, pcitest.B300())
	_, summary, _ := runCmd(t, cmdVerify, "--pub", n.pub, n.envelope)
	code, view, errs := runCmd(t, cmdVerify, "--pub", n.pub, "--by-unit", n.envelope)
	if code != 0 || view == summary || strings.Count(view, "gpu") < 8 || errs != "" {
		t.Fatalf("verify --by-unit: exit %d, stderr %q:\n%s", code, errs, view)
	}
	code, old, errs := runCmd(t, cmdVerify, "--pub", n.pub, "--units", n.envelope)
	if code != 0 || old != view || errs != deprecation("verify", "--units", "--by-unit") {
		t.Errorf("verify --units: exit %d, same as --by-unit %v, stderr %q", code, old == view, errs)
	}
	if code, _, errs := runCmd(t, cmdVerify, "--pub", n.pub, "--by-unit", n.envelope, n.envelope); code != 2 || !strings.Contains(errs, "--by-unit") {
		t.Errorf("verify --by-unit with two manifests: exit %d, stderr %q", code, errs)
	}
}

// TestUnbindUnitFlag: unbind returns every unit --unit names, repeated or
// comma-separated, and nothing else.
func TestUnbindUnitFlag(t *testing.T) {
	for _, args := range [][]string{{"--unit", "gpu2", "--unit", "3"}, {"--unit", "2,gpu3"}} {
		root := pcitest.New(t, pcitest.B300()).Root
		if err := os.MkdirAll(filepath.Join(root, "proc"), 0o755); err != nil {
			t.Fatal(err)
		}
		k := simulatedKernel(t, root)
		tree, err := pci.Scan(root)
		if err != nil {
			t.Fatal(err)
		}
		p, _ := topology.LoadProfile("b300")
		labels, _ := topology.Label(tree, p)
		units := []*topology.Unit{labels.Unit(1), labels.Unit(2), labels.Unit(3)}
		if _, err := vfiobind.Bind(context.Background(), k, tree, units, vfiobind.Options{Modules: k}); err != nil {
			t.Fatal(err)
		}
		var want []string
		for _, u := range units[1:] {
			for _, f := range u.Functions() {
				if f != nil {
					want = append(want, f.Addr.String())
				}
			}
		}
		code, out, errs := runCmd(t, func(a []string, o, e io.Writer) int {
			return runUnbind(a, o, e, unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }})
		}, append([]string{"--root", root, "--json", "--tpm", "off"}, args...)...)
		if code != 0 {
			t.Fatalf("unbind %v: exit %d: %s", args, code, errs)
		}
		var reps []struct {
			Addr string `json:"addr"`
		}
		if err := json.Unmarshal([]byte(out), &reps); err != nil {
			t.Fatalf("unbind %v: %v\n%s", args, err, out)
		}
		var got []string
		for _, r := range reps {
			got = append(got, r.Addr)
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("unbind %v released %v, want units 2 and 3's %v", args, got, want)
		}
	}
}

// TestRecycleUnitFlag: recycle's --unit, repeated or comma-separated, reaches the recycle
// whole: a unit the node lacks is refused by name wherever it stands in the list.
func TestRecycleUnitFlag(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	if err := os.MkdirAll(filepath.Join(root, "etc/passage"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, err := manifest.GenerateKey(filepath.Join(root, "etc/passage")); err != nil {
		t.Fatal(err)
	}
	base := []string{"--root", root, "--signing-key", "/etc/passage/" + manifest.PrivateKeyFile, "--tpm", "off",
		"--generation-file", filepath.Join(t.TempDir(), "gen")}
	for _, args := range [][]string{{"--unit", "9", "--unit", "0"}, {"--unit", "0", "--unit", "gpu9"}, {"--unit", "0,9"}} {
		code, _, errs := runCmd(t, run, append(append([]string{"recycle"}, base...), args...)...)
		if code != 1 || !strings.Contains(errs, "unit gpu9: no such unit") {
			t.Errorf("recycle %v: exit %d, stderr %q; want gpu9 refused", args, code, errs)
		}
	}
	if code, _, errs := runCmd(t, run, append(append([]string{"recycle"}, base...), "--unit", "all")...); code != 2 || !strings.Contains(errs, `unit "all"`) {
		t.Errorf("recycle --unit all: exit %d, stderr %q", code, errs)
	}
}
