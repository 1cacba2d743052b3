package decision

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/pci"
)

func b300Decision(t testing.TB, live Live) *Decision {
	t.Helper()
	return b300DecisionAt(t, pcitest.New(t, pcitest.B300()).Root, live)
}

// b300DecisionAt decides on the B300 tree under root.
func b300DecisionAt(t testing.TB, root string, live Live) *Decision {
	t.Helper()
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	// Erase off: these tests are about the ACS and binding steps (erase_test.go has the
	// erase step, and TestErasePolicyDefault the profile's default).
	d, err := Decide(Input{Tree: tree, Profile: p, Live: live, Erase: erase.PolicyOff})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// report is an execution that did everything the decision asked, cleanly.
func cleanRun(d *Decision) (*apply.Report, *vfiobind.Report) {
	acs := &apply.Report{}
	for _, p := range d.ACS {
		acs.Changes = append(acs.Changes, apply.Change{Addr: p.Addr, Unit: p.Unit, Shared: p.Shared, Position: p.Position, Offset: p.CtlOffset(),
			Mask: p.Mask, Flags: p.Flags, Before: p.Current, Target: p.Target(), After: p.Target(), Result: apply.ResultApplied})
	}
	bind := &vfiobind.Report{}
	for _, u := range d.Bindable(acs, nil) {
		bind.Units = append(bind.Units, vfiobind.UnitReport{ID: u.ID})
	}
	return acs, bind
}

func statuses(vs []Verdict) map[int]topology.Status {
	m := map[int]topology.Status{}
	for _, v := range vs {
		m[int(v.Unit)] = v.Status
	}
	return m
}

// TestConcludeFailsClosed: a unit is ready after execution only when every step that
// covers it completed and reported it done.
// TestErasePolicyDefault: with no passage.erase= given, the decision takes the profile's
// default (b300: require), and a word given overrides it.
func TestErasePolicyDefault(t *testing.T) {
	tree, err := pci.Scan(pcitest.New(t, pcitest.B300()).Root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	for given, want := range map[erase.Policy]erase.Policy{"": erase.PolicyRequire, erase.PolicyOff: erase.PolicyOff, erase.PolicyAuto: erase.PolicyAuto} {
		d, err := Decide(Input{Tree: tree, Profile: p, Erase: given})
		if err != nil {
			t.Fatal(err)
		}
		if d.Erase != want {
			t.Errorf("given %q: policy %q, want %q", given, d.Erase, want)
		}
		s, err := d.Save()
		if err != nil {
			t.Fatal(err)
		}
		if s.Erase != want {
			t.Errorf("given %q: saved plan says %q", given, s.Erase)
		}
	}
	bad := *p
	bad.Erase = "sometimes"
	if _, err := Decide(Input{Tree: tree, Profile: &bad}); err == nil {
		t.Error("a profile erase word that is no policy was accepted")
	}
}

func TestConcludeFailsClosed(t *testing.T) {
	d := b300Decision(t, Live{})
	acs, bind := cleanRun(d)
	if got := statuses(d.Conclude(Execution{ACS: acs, Binding: true, Bind: bind})); len(got) != 8 {
		t.Fatalf("%d verdicts", len(got))
	} else {
		for id, s := range got {
			if s != topology.StatusReady {
				t.Errorf("clean run: unit %d %s", id, s)
			}
		}
	}

	stageErr := errors.New("stage vfio failed: panic: test")
	for _, c := range []struct {
		name string
		x    Execution
		// unit -> the status it must end with and a word its last reason holds
		want map[int]string
	}{
		{"acs did not complete", Execution{ACSErr: errors.New("deadline"), Binding: true, Bind: bind},
			map[int]string{0: "failed acs: did not complete: deadline", 7: "failed acs: did not complete"}},
		{"vfio did not complete", Execution{ACS: acs, Binding: true, BindErr: stageErr},
			map[int]string{3: "failed vfio: did not complete: stage vfio failed: panic"}},
		{"a unit missing from the bind report", Execution{ACS: acs, Binding: true, Bind: &vfiobind.Report{Units: bind.Units[1:]}},
			map[int]string{0: "failed vfio: not bound", 1: "ready"}},
		{"a unit whose binding failed", Execution{ACS: acs, Binding: true, Bind: &vfiobind.Report{Units: append([]vfiobind.UnitReport{{ID: 0, Error: "unit 0: EBUSY"}}, bind.Units[1:]...)}},
			map[int]string{0: "failed vfio: unit 0: EBUSY", 2: "ready"}},
		{"no binding asked (--no-bind)", Execution{ACS: acs}, map[int]string{0: "ready"}},
		{"dry run", Execution{DryRun: true}, map[int]string{0: "ready", 5: "ready"}},
	} {
		vs := d.Conclude(c.x)
		for id, w := range c.want {
			var v Verdict
			for _, x := range vs {
				if x.Unit == topology.UnitID(id) {
					v = x
				}
			}
			status, word, _ := strings.Cut(w, " ")
			last := ""
			if len(v.Reasons) > 0 {
				last = v.Reasons[len(v.Reasons)-1]
			}
			if string(v.Status) != status || !strings.Contains(last, word) {
				t.Errorf("%s: unit %d %s %q, want %s %q", c.name, id, v.Status, last, status, word)
			}
		}
	}

	// A port that failed or was refused at run time: the unit fails when the port no
	// longer isolates, is degraded with the advice when it does (DT only is lost), and is
	// not bound when it failed.
	fail := *acs
	fail.Changes = append([]apply.Change(nil), acs.Changes...)
	for i, c := range fail.Changes {
		switch {
		case c.Unit == 1 && c.Flags&pci.ACSDT != 0:
			fail.Changes[i].Result, fail.Changes[i].Error = apply.ResultMismatch, "wrote 0x005d, reads back 0x001d"
		case c.Unit == 2 && c.Flags&pci.ACSDT != 0:
			fail.Changes[i].Result, fail.Changes[i].After = apply.ResultLockedDown, c.Before
		}
	}
	got := statuses(d.Conclude(Execution{ACS: &fail, Binding: true, Bind: bind}))
	if got[1] != topology.StatusFailed || got[2] != topology.StatusDegraded || got[3] != topology.StatusReady {
		t.Errorf("run-time port outcomes: %v", got)
	}
	for _, u := range d.Bindable(&fail, nil) {
		if u.ID == 1 {
			t.Error("unit 1 bindable after its port failed")
		}
	}
}

// TestDecideLockdown: a locked-down kernel writes nothing, so a port that needs DT
// degrades its unit and a port that needs isolation fails it, before anything runs.
func TestDecideLockdown(t *testing.T) {
	for _, mode := range []string{"none [integrity] confidentiality", "none integrity [confidentiality]", "[none] integrity confidentiality", ""} {
		live := Live{Lockdown: ParseLockdown(mode), Release: "6.1.0-57-amd64"}
		d := b300Decision(t, live)
		for _, v := range d.Decided() {
			want := topology.StatusReady
			if live.LockedDown() {
				want = topology.StatusDegraded
			}
			if v.Status != want {
				t.Errorf("lockdown %q: unit %d %s %v", mode, v.Unit, v.Status, v.Reasons)
			}
			if live.LockedDown() && (len(v.Reasons) != 1 || !strings.Contains(v.Reasons[0], "pci=config_acs=1x111x1@")) {
				t.Errorf("lockdown %q: unit %d reasons %q", mode, v.Unit, v.Reasons)
			}
		}
	}
	if ParseLockdown("none [integrity] confidentiality") != "integrity" || ParseLockdown("none") != "none" {
		t.Error("ParseLockdown")
	}
}

// TestDecideWritesNothingOnConflict: rules that contradict each other fail every unit
// and leave every port unwritten.
func TestDecideWritesNothingOnConflict(t *testing.T) {
	tree, err := pci.Scan(pcitest.New(t, pcitest.B300()).Root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.ParseProfile("conflict", []byte(`name: conflict
rules:
  - {name: gpu, role: gpu, match: {vendor: 0x10de, class: 0x030200}}
  - {name: nvme-a, role: gpu-nvme, match: {class: 0x010802}}
  - {name: nvme-b, role: host-other, match: {class: 0x010802}}
  - {name: nic, role: gpu-nic, match: {vendor: 0x15b3, device: 0x1023}}
  - {name: bridge, role: switch-port, match: {class: 0x060400, class_mask: 0xffff00}}
`))
	if err != nil {
		t.Fatal(err)
	}
	d, err := Decide(Input{Tree: tree, Profile: p})
	if err != nil {
		t.Fatal(err)
	}
	if d.LabelErr == nil || d.KernelArg != "" || len(d.Units()) != 8 || len(d.ACS) == 0 {
		t.Fatalf("label error %v, kernel argument %q, %d units, %d ports", d.LabelErr, d.KernelArg, len(d.Units()), len(d.ACS))
	}
	for _, port := range d.ACS {
		if port.Skip == "" {
			t.Errorf("port %s to be written under a conflicting labelling", port.Addr)
		}
	}
	for _, v := range d.Decided() {
		if v.Status != topology.StatusFailed {
			t.Errorf("unit %d %s", v.Unit, v.Status)
		}
	}
}

// BenchmarkDecideB300 is the whole decision on the reference node, tree already scanned:
// labels, ATS, ACS targets, the audit and the guest plan.
func BenchmarkDecideB300(b *testing.B) {
	tree, err := pci.Scan(pcitest.New(b, pcitest.B300()).Root)
	if err != nil {
		b.Fatal(err)
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		d, err := Decide(Input{Tree: tree, Profile: p})
		if err != nil || len(d.Units()) != 8 {
			b.Fatal(err)
		}
	}
}

// TestDecideUnreadableFacts: a passthrough function with a fact that could not be read
// never leaves its unit ready. Unreadable VPD fails it under b300, whose rules tell the
// NVSwitch bridge's PFs by VPD; under a profile without vpd conditions it degrades it.
func TestDecideUnreadableFacts(t *testing.T) {
	for _, c := range []struct {
		fn, problem string
		want        topology.Status
		noVPDRules  bool
	}{
		{"0000:47:00.0", "config: input/output error", topology.StatusFailed, false},
		{"0000:44:00.1", "iommu_group: malformed link \"-7\"", topology.StatusFailed, false},
		{"0000:49:00.0", "numa_node: malformed \"-5\"", topology.StatusDegraded, false},
		{"0000:44:00.1", "vpd: input/output error", topology.StatusFailed, false},
		{"0000:44:00.1", "vpd: input/output error", topology.StatusDegraded, true},
	} {
		tree, err := pci.Scan(pcitest.New(t, pcitest.B300()).Root)
		if err != nil {
			t.Fatal(err)
		}
		a, _ := pci.ParseAddress(c.fn)
		d := tree.Lookup(a)
		if d == nil {
			t.Fatalf("no %s", c.fn)
		}
		d.Problems = append(d.Problems, c.problem)
		p, _ := topology.Builtin("b300")
		if c.noVPDRules {
			var rules []topology.Rule
			for _, r := range p.Rules {
				if r.Name == "cx8-pf-in-gpu-switch" {
					r.Match.Not, r.Match.NoSibling = nil, nil // its guards against the bridge's PFs
				}
				if r.Match.VPD == nil && r.Match.Sibling == nil {
					rules = append(rules, r)
				}
			}
			p.Rules = rules
		}
		if p.UsesVPD() == c.noVPDRules {
			t.Fatalf("profile uses VPD: %v", p.UsesVPD())
		}
		dec, err := Decide(Input{Tree: tree, Profile: p})
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range dec.Decided() {
			want := topology.StatusReady
			if v.Unit == 2 {
				want = c.want
			}
			if v.Status != want {
				t.Errorf("%s %q: %s %s %v, want %s", c.fn, c.problem, v.Unit, v.Status, v.Reasons, want)
			}
			if v.Unit == 2 && !strings.Contains(strings.Join(v.Reasons, "; "), c.problem) {
				t.Errorf("%s: reasons %q do not name %q", v.Unit, v.Reasons, c.problem)
			}
		}
	}
}

// TestReadLiveBeneathRoot: the kernel's state under a root is read beneath it, from
// regular files only, bounded: a link out of the tree, a FIFO or an endless file is an
// error, never a value from elsewhere, a hang or a flood.
func TestReadLiveBeneathRoot(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "lockdown")
	if err := os.WriteFile(outside, []byte("none [confidentiality]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		make func(path string) error
	}{
		{"link outside", func(p string) error { return os.Symlink(outside, p) }},
		{"fifo", func(p string) error { return syscall.Mkfifo(p, 0o644) }},
		{"endless", func(p string) error { return os.Symlink("/dev/zero", p) }},
		{"too large", func(p string) error { return os.WriteFile(p, bytes.Repeat([]byte("x"), maxLiveFile+1), 0o644) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			p := filepath.Join(root, "sys/kernel/security/lockdown")
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := c.make(p); err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			var l Live
			var err error
			go func() { l, err = ReadLive(root); close(done) }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				os.Remove(p) // unblock a reader stuck on the FIFO
				t.Fatal("ReadLive blocked")
			}
			if err == nil || l.Lockdown != "" {
				t.Errorf("lockdown %q, err %v; want an error and no value", l.Lockdown, err)
			}
		})
	}
}

// TestSharedPort: a port on two units' paths belongs to both. A failed unit does not
// take it out of the plan while the other still relies on it, and a write that fails on
// it fails both units.
func TestSharedPort(t *testing.T) {
	s := pcitest.B300()
	rp0, rp1 := s.Fn("rp0"), s.Fn("rp1")
	usp1 := rp1.Below[0]
	usp1.Dev = 1
	rp0.Below = append(rp0.Below, usp1)
	rp1.Below = nil
	s.Fn("nic0.0").ATS = nil // unit 0 fails under passage.ats=require
	n := pcitest.New(t, s)
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := topology.Builtin("b300")
	d, err := Decide(Input{Tree: tree, Profile: p, ATS: "require"})
	if err != nil {
		t.Fatal(err)
	}
	rp := n.Addr("rp0")
	var port *topology.ACSPort
	for i := range d.ACS {
		if d.ACS[i].Addr == rp {
			port = &d.ACS[i]
		}
	}
	if port == nil || len(port.Units()) != 2 {
		t.Fatalf("root port %s: %+v, want one port held by two units", rp, port)
	}
	status := statuses(d.Decided())
	failed, live := port.Units()[0], port.Units()[1]
	if status[int(failed)] != topology.StatusFailed || status[int(live)] != topology.StatusReady {
		t.Fatalf("units %v, want %s failed and %s ready", status, failed, live)
	}
	if port.Skip != "" || !strings.Contains(d.KernelArg, "@"+rp.String()) {
		t.Errorf("shared port skipped (%q) or out of the kernel argument %q while %s relies on it", port.Skip, d.KernelArg, live)
	}

	acs, bind := cleanRun(d)
	for i, c := range acs.Changes {
		if c.Addr == rp {
			acs.Changes[i].Result, acs.Changes[i].Error = apply.ResultFailed, "write ACSCtl: input/output error"
		}
	}
	if got := statuses(d.Conclude(Execution{ACS: acs, Binding: true, Bind: bind})); got[int(live)] != topology.StatusFailed {
		t.Errorf("%s %s after its shared root port failed", live, got[int(live)])
	}
	for _, u := range d.Bindable(acs, nil) {
		if u.ID == live {
			t.Errorf("%s bindable after its shared root port failed", live)
		}
	}
}
