package main

import (
	"context"

	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/passage-boot/passage/bench"
	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/erase"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/pciids"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// b300Fns is the reference node's function count; every row on it checks the count so a
// changed reference cannot silently change what is measured.
const b300Fns = 134

// proc is one run of a command with its output thrown away; a non-zero exit is an error
// (the side must have done the work, not failed fast).
func proc(name string, args ...string) func() error { return procCPU(nil, name, args...) }

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

func lspciArgs(root string, extra ...string) []string {
	return append([]string{"-A", "linux-sysfs", "-O", "sysfs.path=" + filepath.Join(root, "sys/bus/pci")}, extra...)
}

// b300 builds the reference tree once per run (the read-only rows share it).
func (e *env) b300() (*pcitest.Node, error) {
	dir := filepath.Join(e.scratch, "b300")
	if _, err := os.Stat(dir); err == nil {
		return &pcitest.Node{Root: dir}, nil
	}
	return bench.BuildTree(e.scratch, "b300", pcitest.B300())
}

func scanChecked(root string, want int) (*pci.Tree, error) {
	tree, err := pci.Scan(root)
	if err != nil {
		return nil, err
	}
	if len(tree.Devices) != want {
		return nil, fmt.Errorf("scan %s: %d functions, want %d", root, len(tree.Devices), want)
	}
	return tree, tree.Err()
}

var b300Profile = func() *topology.Profile {
	p, err := topology.Builtin("b300")
	if err != nil {
		panic(err) // the embedded profile is part of the binary
	}
	return p
}()

// planInProcess is what `passage plan` computes, without printing it.
func planInProcess(root string, want int) (*topology.Plan, error) {
	tree, err := scanChecked(root, want)
	if err != nil {
		return nil, err
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: b300Profile})
	if err != nil {
		return nil, err
	}
	// The scaled trees carry SR-IOV VFs on every PF, which the decision refuses (its
	// units fail, so there is no guest plan): the decision itself is what is timed.
	if d.LabelErr != nil {
		return nil, d.LabelErr
	}
	pl := d.Plan()
	if len(pl.Labels.Units) == 0 || len(pl.ACS) == 0 {
		return nil, fmt.Errorf("plan %s: %d units, %d ACS ports", root, len(pl.Labels.Units), len(pl.ACS))
	}
	return pl, nil
}

// lspciFunctions counts the functions in lspci's output, to check that it read the tree.
func lspciFunctions(root string) (int, error) {
	out, err := exec.Command("lspci", lspciArgs(root, "-D")...).Output()
	if err != nil {
		return 0, fmt.Errorf("lspci -D: %w", err)
	}
	return strings.Count(string(out), "\n"), nil
}

func rowScan(e *env, t *table, w io.Writer) error {
	n, err := e.b300()
	if err != nil {
		return err
	}
	if got, err := lspciFunctions(n.Root); err != nil || got != b300Fns {
		return fmt.Errorf("lspci sees %d functions (%v), want %d", got, err, b300Fns)
	}
	s, err := bench.Measure(e.rounds,
		bench.Side{Name: "passage inspect", Run: proc(e.passage, "inspect", "--root", n.Root)},
		bench.Side{Name: "pci.Scan", Run: func() error { _, err := scanChecked(n.Root, b300Fns); return err }},
		bench.Side{Name: "lspci -vvv", Run: proc("lspci", lspciArgs(n.Root, "-vvv")...)},
	)
	if err != nil {
		return err
	}
	in := fmt.Sprintf("B300 tree, %d fns", b300Fns)
	t.pair("1a", "scan+decode: `passage inspect --root` (process)", in, s[0].Median, s[2].Median, "lspci -vvv", "")
	t.pair("1b", "scan+decode: `pci.Scan` (in-process)", in, s[1].Median, s[2].Median, "lspci -vvv",
		fmt.Sprintf("%d allocs, %s", s[1].Allocs, kib(s[1].Bytes)))
	return nil
}

// rowOracle holds passage to lspci, the tool an operator would run instead, on the two
// costs a command-line user feels: `passage plan` with names against `lspci -vvv` naming
// from the same pci.ids, and a process's start (`passage help` against `lspci
// --version`), the four sides alternating in one measurement so that the machine's load
// falls on both comparisons alike. CPU time (user+sys of the child) decides: on shared
// cores wall time carries the other work's load.
func rowOracle(e *env, t *table, w io.Writer) error {
	n, err := e.b300()
	if err != nil {
		return err
	}
	ids := "/usr/share/misc/pci.ids"
	if _, err := os.Stat(ids); err != nil {
		return fmt.Errorf("oracle row: %w (make deps installs pciutils, which ships it)", err)
	}
	out, err := exec.Command(e.passage, "plan", "--root", n.Root, "--pci-ids", ids).Output()
	if err != nil {
		return fmt.Errorf("passage plan --pci-ids %s: %w", ids, err)
	}
	if !strings.Contains(string(out), "Mellanox Technologies") {
		return fmt.Errorf("passage plan --pci-ids %s names nothing: the row would time no lookup", ids)
	}
	if got, err := lspciFunctions(n.Root); err != nil || got != b300Fns {
		return fmt.Errorf("lspci sees %d functions (%v), want %d", got, err, b300Fns)
	}
	u := make([]usage, 6)
	sides := []bench.Side{
		{Name: "passage plan, names", Run: procUsage(&u[0], e.passage, "plan", "--root", n.Root, "--pci-ids", ids)},
		{Name: "lspci -vvv", Run: procUsage(&u[1], "lspci", lspciArgs(n.Root, "-vvv", "-i", ids)...)},
		{Name: "passage help", Run: procUsage(&u[2], e.passage, "help")},
		{Name: "lspci --version", Run: procUsage(&u[3], "lspci", "--version")},
	}
	if e.floor != nil {
		sides = append(sides,
			bench.Side{Name: "static Go, empty main", Run: procUsage(&u[4], e.floor[0])},
			bench.Side{Name: "static Go, passage's imports only", Run: procUsage(&u[5], e.floor[1])})
	}
	u = u[:len(sides)]
	s, err := bench.Measure(e.rounds, sides...)
	if err != nil {
		return err
	}
	c := make([]time.Duration, len(u))
	f := make([]int64, len(u))
	for i := range u {
		c[i], f[i] = u[i].medians()
	}
	planCPU := float64(c[1]) / float64(c[0])
	startCPU := float64(c[2]) / float64(c[3])
	startWall := float64(s[2].Median) / float64(s[3].Median)
	in := fmt.Sprintf("B300 tree, %d fns, %s", b300Fns, ids)
	t.add(row{id: "O1", what: "plan with names vs `lspci -vvv` (CPU)", input: in, passage: dur(c[0]),
		base: dur(c[1]) + " lspci -vvv", ratio: fmt.Sprintf("%.1fx", planCPU),
		note: fmt.Sprintf("wall %s vs %s; page faults %d vs %d", dur(s[0].Median), dur(s[1].Median), f[0], f[1])})
	t.add(row{id: "O2", what: "process start: `passage help` vs `lspci --version` (CPU)", input: "no tree", passage: dur(c[2]),
		base: dur(c[3]) + " lspci --version", ratio: fmt.Sprintf("%.1fx", 1/startCPU),
		note: fmt.Sprintf("passage/lspci: CPU %.2fx, wall %.2fx (%s vs %s); page faults %d vs %d", startCPU, startWall, dur(s[2].Median), dur(s[3].Median), f[2], f[3])})
	if e.floor != nil {
		// What start-up cannot go below while passage links what it links: a process
		// that runs no code of its own, only the runtime's and its imports' set-up.
		t.add(row{id: "O3", what: "start-up floor: static Go linking passage's imports, running nothing (CPU)", input: "no tree",
			passage: dur(c[5]), base: dur(c[3]) + " lspci --version", ratio: fmt.Sprintf("%.1fx", float64(c[3])/float64(c[5])),
			note: fmt.Sprintf("/lspci %.2fx, %d page faults; an empty static Go program %s (%.2fx), %d page faults; passage help %.2fx of this floor",
				float64(c[5])/float64(c[3]), f[5], dur(c[4]), float64(c[4])/float64(c[3]), f[4], float64(c[2])/float64(c[5]))})
	}
	// What the faults above cost here: on a virtual machine a first touch of a page can
	// cost tens of times what bare metal pays, and start-up is mostly first touches.
	const pages = 4096
	per, counted, err := faultCost(pages, 5)
	if err != nil {
		return fmt.Errorf("fault cost: %w", err)
	}
	t.add(row{id: "O4", what: "a page fault on this machine: first write to a fresh anonymous page", input: fmt.Sprintf("%d pages, best of 5", pages),
		passage: dur(per), base: "-", ratio: "-",
		note: fmt.Sprintf("%d faults counted; at this cost passage help's %d faults are %s, lspci --version's %d %s",
			counted, f[2], dur(per*time.Duration(f[2])), f[3], dur(per*time.Duration(f[3])))})
	t.target(planCPU >= 3, "plan with names >= 3x faster than lspci -vvv in CPU: %.1fx (%s vs %s)", planCPU, dur(c[0]), dur(c[1]))
	t.target(startCPU <= 1.5, "passage help <= 1.5x lspci --version: CPU %.2fx (%s vs %s), wall %.2fx", startCPU, dur(c[2]), dur(c[3]), startWall)
	fmt.Fprintf(w, "## passage against lspci (rows O1-O4)\n\nOne measurement, %d alternating runs of four sides (six with the start-up floors), medians: "+
		"`passage plan --root ROOT --pci-ids %s` against `lspci -vvv -A linux-sysfs -O sysfs.path=ROOT/sys/bus/pci -i %s`, "+
		"and `passage help` against `lspci --version`. CPU is the child's user+sys time, page faults its minor faults (ru_minflt); "+
		"row O4 is what one costs on this machine.\n\n"+
		"| side | wall | CPU (user+sys) | page faults |\n|---|---|---|---|\n", e.rounds, ids, ids)
	for i := range s {
		fmt.Fprintf(w, "| %s | %s | %s | %d |\n", s[i].Name, dur(s[i].Median), dur(c[i]), f[i])
	}
	fmt.Fprintln(w)
	return nil
}

func kib(b uint64) string { return fmt.Sprintf("%.0f KiB", float64(b)/1024) }

func rowPlan(e *env, t *table, w io.Writer) error {
	n, err := e.b300()
	if err != nil {
		return err
	}
	// The baseline must find the same ports and values, or the ratio compares unequal
	// work (bench's go test holds this too).
	pl, err := planInProcess(n.Root, b300Fns)
	if err != nil {
		return err
	}
	out, err := bench.RunScript(e.script, n.Root, false)
	if err != nil {
		return err
	}
	ports, err := bench.ParseScript(out)
	if err != nil {
		return err
	}
	if len(ports) != len(pl.ACS) {
		return fmt.Errorf("acs-plan.sh planned %d ports, passage %d", len(ports), len(pl.ACS))
	}
	s, err := bench.Measure(e.rounds,
		bench.Side{Name: "passage plan", Run: proc(e.passage, "plan", "--root", n.Root)},
		bench.Side{Name: "plan in-process", Run: func() error { _, err := planInProcess(n.Root, b300Fns); return err }},
		bench.Side{Name: "acs-plan.sh", Run: proc("bash", e.script, n.Root)},
		bench.Side{Name: "lspci -vvv", Run: proc("lspci", lspciArgs(n.Root, "-vvv")...)},
	)
	if err != nil {
		return err
	}
	in := fmt.Sprintf("B300 tree, %d fns, %d ports", b300Fns, len(pl.ACS))
	rs := t.pair("2a", "scan+plan: `passage plan --root` (process)", in, s[0].Median, s[2].Median, "acs-plan.sh", "the decision (roles, units, ATS, audit, ACS targets, verdicts), host+guest matrices, text output")
	ri := t.pair("2b", "scan+plan: `decision.Decide` (in-process)", in, s[1].Median, s[2].Median, "acs-plan.sh",
		fmt.Sprintf("%d allocs, %s", s[1].Allocs, kib(s[1].Bytes)))
	rl := t.pair("2c", "scan+plan (process) vs lspci alone", in, s[0].Median, s[3].Median, "lspci -vvv", "lspci only decodes; it plans nothing")
	rli := t.pair("2d", "scan+plan (in-process) vs lspci alone", in, s[1].Median, s[3].Median, "lspci -vvv", "")
	t.target(rs >= 10, "scan+plan >= 10x faster than the lspci/setpci script: process %.1fx, in-process %.1fx", rs, ri)
	t.target(rl >= 2, "scan+plan >= 2x faster than lspci -vvv alone: process %.1fx, in-process %.1fx", rl, rli)
	return nil
}

// applyInProcess is `passage apply`'s path: scan, label, ATS check, ACS plan and write with
// read-back; with k it then binds every unit against the simulated kernel.
func applyInProcess(root string, k *vfiotest.Kernel) error {
	tree, err := scanChecked(root, b300Fns)
	if err != nil {
		return err
	}
	// As `passage apply --erase off` decides: apply erases nothing, so under the
	// profile's erase policy (require) it would fail every unit and write nothing.
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: b300Profile, Erase: erase.PolicyOff, For: decision.CommandApply})
	if err != nil {
		return err
	}
	cfg := pci.SysfsConfig{Root: root}
	rep, err := d.ExecuteACS(context.Background(), cfg, false)
	if err != nil {
		return err
	}
	if rep.Failed() || rep.Writes() != 8 {
		return fmt.Errorf("apply %s: %d ports written, failed %v (want 8 written)", root, rep.Writes(), rep.Failed())
	}
	if k == nil {
		return nil
	}
	br, err := d.ExecuteBind(context.Background(), k, &rep, nil, vfiobind.Options{Modules: k})
	if err != nil {
		return err
	}
	for _, v := range d.Conclude(decision.Execution{ACS: &rep, Binding: true, Bind: br}) {
		if v.Status != topology.StatusReady {
			return fmt.Errorf("bind %s: unit %d %s %v", root, v.Unit, v.Status, v.Reasons)
		}
	}
	return nil
}

func rowApply(e *env, t *table, w io.Writer) error {
	// Every run writes, so every run gets a tree of its own, built outside the timer.
	seq := 0
	var cur string
	var kernel *vfiotest.Kernel
	fresh := func(withKernel bool) func() error {
		return func() error {
			if cur != "" {
				os.RemoveAll(cur)
			}
			seq++
			n, err := bench.BuildTree(e.scratch, fmt.Sprintf("apply-%d", seq), pcitest.B300())
			if err != nil {
				return err
			}
			cur, kernel = n.Root, nil
			if withKernel {
				kernel, err = vfiotest.New(n.Root)
			}
			return err
		}
	}
	defer func() {
		if cur != "" {
			os.RemoveAll(cur)
		}
	}()
	s, err := bench.Measure(e.rounds,
		bench.Side{Name: "passage apply --no-bind", Prepare: fresh(false), Run: func() error {
			return proc(e.passage, "apply", "--root", cur, "--no-bind", "--erase", "off")()
		}},
		bench.Side{Name: "ACS in-process", Prepare: fresh(false), Run: func() error { return applyInProcess(cur, nil) }},
		bench.Side{Name: "ACS+bind in-process", Prepare: fresh(true), Run: func() error { return applyInProcess(cur, kernel) }},
		bench.Side{Name: "acs-plan.sh --apply", Prepare: fresh(false), Run: func() error {
			return proc("bash", e.script, cur, "--apply")()
		}},
	)
	if err != nil {
		return err
	}
	in := "fresh B300 tree per run, 8 of 32 ports written"
	t.pair("3a", "apply: `passage apply --root --no-bind --erase off` (process)", in, s[0].Median, s[3].Median, "acs-plan.sh --apply",
		"ACS only: binding needs a kernel that answers drivers_probe; the script's 32x3 bind echoes are bash builtins")
	t.pair("3b", "apply: scan+plan+`apply.ACS` (in-process)", in, s[1].Median, s[3].Median, "acs-plan.sh --apply", "ACS write + read-back")
	t.pair("3c", "apply: ACS + `vfiobind.Bind` (in-process)", in, s[2].Median, s[3].Median, "acs-plan.sh --apply",
		"32 functions bound against vfiotest's simulated kernel (no real driver probe)")
	return nil
}

// rowScaling is scan+plan on one core at growing function counts: the B300 reference cut
// or extended with SR-IOV VFs on the ConnectX-8 PFs.
func rowScaling(e *env, t *table, w io.Writer) error {
	prev := runtime.GOMAXPROCS(1)
	defer runtime.GOMAXPROCS(prev)
	sizes := []struct {
		label        string
		units, perPF int
		rounds       int
	}{
		{"100", 2, 14, e.rounds},
		{"1 000", 8, 54, e.rounds},
		{"10 000", 8, 617, max(3, e.rounds/2)},
	}
	fmt.Fprintf(w, "## Scaling (row 4)\n\nOne core (GOMAXPROCS=1), in-process scan+plan, medians of alternating runs; "+
		"the B300 reference cut to its first GPU complexes or extended with SR-IOV VFs on the 16 ConnectX-8 PFs. "+
		"lspci -vvv on the same tree for scale. \"syscalls alone\" is bench.SyscallFloor: the system calls a file-by-file "+
		"scan cannot do without (per function: its link, then config, numa_node, driver_override opened, read and "+
		"closed, driver and iommu_group links read, relative to the parent directory), with no parsing and no model: "+
		"the floor under any such scanner on this machine.\n\n")
	fmt.Fprintf(w, "| functions | shape | scan+plan | µs/fn | allocs/fn | bytes/fn | scan alone µs/fn | syscalls alone | syscalls µs/fn | lspci -vvv | lspci µs/fn |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
	var perFn []float64
	var at10k, floor10k time.Duration
	for _, sz := range sizes {
		name := "scale-" + strings.ReplaceAll(sz.label, " ", "")
		n, err := bench.BuildTree(e.scratch, name, bench.B300Scaled(sz.units, sz.perPF))
		if err != nil {
			return err
		}
		tree, err := pci.Scan(n.Root)
		if err != nil {
			return err
		}
		fns := len(tree.Devices)
		s, err := bench.Measure(sz.rounds,
			bench.Side{Name: "scan+plan", Run: func() error { _, err := planInProcess(n.Root, fns); return err }},
			bench.Side{Name: "scan", Run: func() error { _, err := scanChecked(n.Root, fns); return err }},
			bench.Side{Name: "lspci -vvv", Run: proc("lspci", lspciArgs(n.Root, "-vvv")...)},
			bench.Side{Name: "syscall floor", Run: func() error { _, err := bench.SyscallFloor(n.Root); return err }},
		)
		os.RemoveAll(n.Root)
		if err != nil {
			return err
		}
		us := float64(s[0].Median) / 1e3 / float64(fns)
		perFn = append(perFn, us)
		shape := fmt.Sprintf("%d GPU units, %d VFs per CX-8 PF", sz.units, sz.perPF)
		fmt.Fprintf(w, "| %d | %s | %s | %.1f | %.1f | %.0f | %.1f | %s | %.1f | %s | %.1f |\n", fns, shape, dur(s[0].Median), us,
			float64(s[0].Allocs)/float64(fns), float64(s[0].Bytes)/float64(fns), float64(s[1].Median)/1e3/float64(fns),
			dur(s[3].Median), float64(s[3].Median)/1e3/float64(fns),
			dur(s[2].Median), float64(s[2].Median)/1e3/float64(fns))
		t.pair("4", fmt.Sprintf("scaling: scan+plan, 1 core, %s fns", sz.label), fmt.Sprintf("%d fns (%s)", fns, shape),
			s[0].Median, s[2].Median, "lspci -vvv",
			fmt.Sprintf("%.1f µs/fn, %.0f allocs/fn", us, float64(s[0].Allocs)/float64(fns)))
		if sz.perPF == 617 {
			at10k, floor10k = s[0].Median, s[3].Median
		}
	}
	growth := perFn[2] / perFn[1]
	fmt.Fprintf(w, "\nPer-function time from 1 000 to 10 000 functions changes by %.2fx (1.00 = perfectly linear); from 100 to 1 000 by %.2fx.\n\n",
		growth, perFn[1]/perFn[0])
	t.target(growth <= 1.5, "growth linear: µs/fn at 10 000 is %.2fx that at 1 000 (<= 1.5x counts as linear)", growth)
	t.target(at10k < 100*time.Millisecond, "10 000 functions scan+plan < 100 ms on one core: %s; the system calls alone "+
		"(bench.SyscallFloor: the same files, no model) take %s on this machine", dur(at10k), dur(floor10k))
	return nil
}

// procCPU is proc that also records the child's CPU time (user + system) in cpu when it
// is not nil: on two shared cores a wall-clock figure carries the other engineers' load,
// CPU time much less.
func procCPU(cpu *[]time.Duration, name string, args ...string) func() error {
	var u usage
	run := procUsage(&u, name, args...)
	return func() error {
		if err := run(); err != nil {
			return err
		}
		if cpu != nil {
			*cpu = append(*cpu, u.cpu[len(u.cpu)-1])
		}
		return nil
	}
}

// rowNames is what names cost: `passage plan` on the B300 tree with the system's full
// pci.ids (Debian's, as an operator's host has it) against the same plan with a database
// that names nothing, and against lspci -vvv, which names from the same file.
func rowNames(e *env, t *table, w io.Writer) error {
	n, err := e.b300()
	if err != nil {
		return err
	}
	full := "/usr/share/misc/pci.ids"
	fi, err := os.Stat(full)
	if err != nil {
		return fmt.Errorf("names row: %w (make deps installs pciutils, which ships it)", err)
	}
	none := filepath.Join(e.scratch, "pci.ids.none")
	if err := os.WriteFile(none, []byte("# names nothing\n"), 0o644); err != nil {
		return err
	}
	// The named side must name (the row would time nothing otherwise), the other not:
	// it reads no hwdb either, where udev's would name what the empty pci.ids does not.
	named := []string{"plan", "--root", n.Root, "--pci-ids", full}
	unnamed := []string{"plan", "--root", n.Root, "--pci-ids", none, "--hwdb", pciids.NoHwdb}
	for _, c := range []struct {
		args  []string
		named bool
	}{{named, true}, {unnamed, false}} {
		out, err := exec.Command(e.passage, c.args...).Output()
		if err != nil {
			return fmt.Errorf("passage %s: %w", strings.Join(c.args, " "), err)
		}
		if strings.Contains(string(out), "Mellanox Technologies") != c.named {
			return fmt.Errorf("passage %s: names shown %v, want %v", strings.Join(c.args, " "), !c.named, c.named)
		}
	}
	cpu := make([][]time.Duration, 3)
	s, err := bench.Measure(e.rounds,
		bench.Side{Name: "plan, names", Run: procCPU(&cpu[0], e.passage, named...)},
		bench.Side{Name: "plan, no names", Run: procCPU(&cpu[1], e.passage, unnamed...)},
		bench.Side{Name: "lspci -vvv", Run: procCPU(&cpu[2], "lspci", lspciArgs(n.Root, "-vvv", "-i", full)...)},
	)
	if err != nil {
		return err
	}
	c := make([]time.Duration, 3)
	for i := range cpu {
		// The warm-up run is the first, and Measure does not count it.
		c[i] = bench.Median(cpu[i][1:])
	}
	in := fmt.Sprintf("B300 tree, %d fns, %s (%d KiB)", b300Fns, full, fi.Size()>>10)
	cost := t.pair("2e", "plan with names vs plan without (wall)", in, s[0].Median, s[1].Median, "plan without names",
		fmt.Sprintf("CPU: %s with names, %s without", dur(c[0]), dur(c[1])))
	vsLspci := t.pair("2f", "plan with names vs lspci -vvv (wall)", in, s[0].Median, s[2].Median, "lspci -vvv",
		fmt.Sprintf("CPU: %s passage, %s lspci; both name from %s", dur(c[0]), dur(c[2]), full))
	over := float64(c[0])/float64(c[1]) - 1
	t.target(over <= 0.20, "names cost <= 20%% over plan without names: CPU +%.0f%% (%s vs %s), wall +%.0f%%",
		100*over, dur(c[0]), dur(c[1]), 100*(1/cost-1))
	t.target(c[0] < c[2] && vsLspci > 1, "plan with names faster than lspci -vvv: CPU %s vs %s, wall %.1fx", dur(c[0]), dur(c[2]), vsLspci)
	fmt.Fprintf(w, "## Names (rows 2e, 2f)\n\n`passage plan --root` on the B300 tree with `--pci-ids %s` against the same plan "+
		"with a database that names nothing, and against `lspci -vvv -i %s`; medians of %d alternating runs. "+
		"The lookup reads the names of the tree's functions only (`pciids.OpenFor`).\n\n"+
		"| side | wall | CPU (user+sys) |\n|---|---|---|\n", full, full, e.rounds)
	for i := range s {
		fmt.Fprintf(w, "| %s | %s | %s |\n", s[i].Name, dur(s[i].Median), dur(c[i]))
	}
	fmt.Fprintln(w)
	return nil
}
