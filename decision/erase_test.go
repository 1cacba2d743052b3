package decision

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// eraseNode is a B300 tree with a simulated kernel and one simulated controller per
// NVMe, each holding a tenant's marker in both its namespaces.
type eraseNode struct {
	root  string
	tree  *pci.Tree
	k     *vfiotest.Kernel
	ctrls map[pci.Address]*erasetest.Controller
}

var tenantMarker = bytes.Repeat([]byte("TENANT-A-SECRET!"), 32)

func newEraseNode(t *testing.T) *eraseNode {
	t.Helper()
	root := pcitest.New(t, pcitest.B300()).Root
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	n := &eraseNode{root: root, tree: tree, k: k, ctrls: map[pci.Address]*erasetest.Controller{}}
	for _, d := range tree.Devices {
		dir := filepath.Join(root, pci.DevicesDir, d.Addr.String())
		if err := os.WriteFile(filepath.Join(dir, "reset_method"), []byte("flr bus\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "reset"), nil, 0o200); err != nil {
			t.Fatal(err)
		}
		if d.Class == pcitest.ClassNVMe {
			c := erasetest.New("S"+d.Addr.String(), erase.SANICAPCES|erase.SANICAPBES, erase.FNACrypto, true,
				erasetest.Namespace{NSID: 1, Blocks: 1 << 24}, erasetest.Namespace{NSID: 2, Blocks: 1 << 16})
			for _, ns := range c.Namespaces {
				for _, lba := range []uint64{0, ns.Blocks / 3, ns.Blocks - 1} {
					c.Write(ns.NSID, lba, tenantMarker)
				}
			}
			n.ctrls[d.Addr] = c
		}
	}
	if err := k.Load(vfiobind.Modules...); err != nil {
		t.Fatal(err)
	}
	return n
}

func (n *eraseNode) open(_ context.Context, a pci.Address) (erase.Controller, string, error) {
	c := n.ctrls[a]
	if c == nil {
		return nil, "", fmt.Errorf("%s: %w", a, erase.ErrNoController)
	}
	return c, "nvme-" + a.String(), nil
}

func (n *eraseNode) decide(t *testing.T, p erase.Policy) *Decision {
	t.Helper()
	prof, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	d, err := Decide(Input{Tree: n.tree, Profile: prof, Erase: p})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

var eraseOpts = erase.RunOptions{Erase: erase.Options{SanitizeTimeout: 200 * time.Millisecond, PollInterval: 5 * time.Millisecond, Samples: 16}}

// execute runs the erase step and the binding step as the boot does and concludes.
func (n *eraseNode) execute(t *testing.T, d *Decision) ([]Verdict, *erase.Report) {
	t.Helper()
	acs, _ := cleanRun(d)
	ctx := context.Background()
	er := erase.Run(ctx, n.k, d.Labels, d.ErasePlan(acs), n.open, eraseOpts)
	bind, err := d.ExecuteBind(ctx, n.k, acs, er, vfiobind.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return d.Conclude(Execution{ACS: acs, Binding: true, Bind: bind, Erase: er}), er
}

func verdictOf(vs []Verdict, id int) Verdict {
	for _, v := range vs {
		if int(v.Unit) == id {
			return v
		}
	}
	return Verdict{}
}

// TestEraseFaultsFailUnderRequire: each fault at the ioctl or sysfs boundary, on unit
// 2, leaves unit 2 failed under require with the reason, none of its functions on
// vfio-pci, its NVMe off nvme; every other unit erased, reset, bound and ready. A
// sanitize the controller refuses falls back and the unit is ready.
func TestEraseFaultsFailUnderRequire(t *testing.T) {
	for _, tc := range []struct {
		name   string
		inject func(n *eraseNode, nvme pci.Address)
		reason string // "" : unit 2 ends ready
	}{
		{"sanitize unsupported: falls back", func(n *eraseNode, a pci.Address) {
			n.ctrls[a].Faults.Refuse = map[uint8]bool{erase.OpSanitize: true}
		}, ""},
		{"command error", func(n *eraseNode, a pci.Address) {
			n.ctrls[a].Faults.ErrorStatus = map[uint8]erase.Status{erase.OpSanitize: 0x4006}
		}, "internal error"},
		{"sanitize never completes", func(n *eraseNode, a pci.Address) {
			n.ctrls[a].Faults.SanitizeStuck = true
		}, "sanitize still in progress"},
		{"verification finds data", func(n *eraseNode, a pci.Address) {
			n.ctrls[a].Faults.KeepData = true
		}, "data remains"},
		{"device vanishes mid-erase", func(n *eraseNode, a pci.Address) {
			n.ctrls[a].Faults.VanishAfter = 5
		}, "no such device"},
		{"no controller under the nvme driver", func(n *eraseNode, a pci.Address) {
			delete(n.ctrls, a)
		}, "no nvme controller"},
		{"nvme driver does not take it", func(n *eraseNode, a pci.Address) {
			n.k.Faults.WriteErr = map[string]error{pci.DevicesDir + "/" + a.String() + "/driver_override": syscall.EPERM}
		}, "write driver_override"},
		{"reset refused", func(n *eraseNode, a pci.Address) {
			n.k.Faults.WriteErr = map[string]error{pci.DevicesDir + "/" + a.String() + "/reset": syscall.ENOTTY}
		}, "reset " + "0000:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newEraseNode(t)
			d := n.decide(t, erase.PolicyRequire)
			u2 := d.Labels.Unit(2)
			victim := u2.NVMe[0].Addr
			tc.inject(n, victim)
			vs, er := n.execute(t, d)
			after, err := pci.Scan(n.root)
			if err != nil {
				t.Fatal(err)
			}
			for _, u := range d.Units() {
				v := verdictOf(vs, int(u.ID))
				ready := u.ID != 2 || tc.reason == ""
				if ready {
					if v.Status != topology.StatusReady {
						t.Errorf("unit %d: %s %v, want ready", u.ID, v.Status, v.Reasons)
					}
					ur := er.Unit(u.ID)
					if ur == nil || len(ur.Resets) != len(u.Functions()) || !ur.NVMe[0].Erased() {
						t.Errorf("unit %d: erase report %+v", u.ID, ur)
					}
					if c := n.ctrls[u.NVMe[0].Addr]; c != nil && (c.Dirty(1) > 0 || c.Dirty(2) > 0) {
						t.Errorf("unit %d: the tenant's blocks remain", u.ID)
					}
				} else {
					if v.Status != topology.StatusFailed || !strings.Contains(strings.Join(v.Reasons, "; "), tc.reason) {
						t.Errorf("unit 2: %s %q, want failed with %q", v.Status, v.Reasons, tc.reason)
					}
				}
				for _, f := range u.Functions() {
					drv := after.Lookup(f.Addr).Driver
					if ready && drv != vfiobind.VFIODriver {
						t.Errorf("unit %d %s: driver %q, want vfio-pci", u.ID, f.Addr, drv)
					}
					if !ready && drv == vfiobind.VFIODriver {
						t.Errorf("unit 2 %s: bound to vfio-pci with its erase failed", f.Addr)
					}
					if !ready && f.Addr == victim && drv == erase.NVMeDriver {
						t.Errorf("unit 2 %s: left on nvme", f.Addr)
					}
				}
			}
			if tc.reason == "" {
				if m := er.Unit(2).NVMe[0].Method; m != erase.FormatCrypto {
					t.Errorf("unit 2: method %q after sanitize was refused, want %q", m, erase.FormatCrypto)
				}
			}
		})
	}
}

// TestEraseAutoDegrades: under auto a unit whose erase failed is degraded and still
// bound; under off nothing is erased or reset.
func TestEraseAutoDegrades(t *testing.T) {
	n := newEraseNode(t)
	d := n.decide(t, erase.PolicyAuto)
	n.ctrls[d.Labels.Unit(2).NVMe[0].Addr].Faults.KeepData = true
	vs, _ := n.execute(t, d)
	if v := verdictOf(vs, 2); v.Status != topology.StatusDegraded || !strings.Contains(strings.Join(v.Reasons, ";"), "data remains") {
		t.Errorf("auto: unit 2 %s %v, want degraded with data remains", v.Status, v.Reasons)
	}
	if v := verdictOf(vs, 1); v.Status != topology.StatusReady {
		t.Errorf("auto: unit 1 %s %v", v.Status, v.Reasons)
	}

	n = newEraseNode(t)
	d = n.decide(t, erase.PolicyOff)
	vs, er := n.execute(t, d)
	if len(er.Units) != 0 || decidedFailed(vs) {
		t.Errorf("off: erase report %+v, verdicts %+v", er, vs)
	}
	for _, c := range n.ctrls {
		if len(c.Commands()) != 0 {
			t.Errorf("off: a controller got commands")
		}
	}
}

func decidedFailed(vs []Verdict) bool { return Failed(vs) }

// TestEraseReportMissing: under require, no erase report (the step errored, panicked,
// timed out) fails every unit, and Bindable binds nothing.
func TestEraseReportMissing(t *testing.T) {
	n := newEraseNode(t)
	d := n.decide(t, erase.PolicyRequire)
	acs, bind := cleanRun(d)
	if b := d.Bindable(acs, nil); len(b) != 0 {
		t.Errorf("Bindable under require without an erase report: %d units", len(b))
	}
	vs := d.Conclude(Execution{ACS: acs, Binding: true, Bind: bind, EraseErr: fmt.Errorf("stage erase failed: deadline")})
	for _, v := range vs {
		if v.Status != topology.StatusFailed || !strings.Contains(strings.Join(v.Reasons, ";"), "erase: did not complete: stage erase failed") {
			t.Errorf("unit %d: %s %v", v.Unit, v.Status, v.Reasons)
		}
	}
}

// TestDecideForACommandThatDoesNotErase: under an active erase policy a decision for
// apply (which erases nothing) settles every unit before any write: failed under
// require, with every port left alone, nothing bound and nothing to erase; degraded under
// auto, its ports written as for the boot. The conclusion adds nothing and repeats no
// reason. For the boot and recycle, which erase, the same node is ready.
func TestDecideForACommandThatDoesNotErase(t *testing.T) {
	tree, err := pci.Scan(pcitest.New(t, pcitest.B300()).Root)
	if err != nil {
		t.Fatal(err)
	}
	prof, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		policy erase.Policy
		cmd    Command
		want   topology.Status
	}{
		{erase.PolicyRequire, CommandApply, topology.StatusFailed},
		{erase.PolicyAuto, CommandApply, topology.StatusDegraded},
		{erase.PolicyOff, CommandApply, topology.StatusReady},
		{erase.PolicyRequire, CommandBoot, topology.StatusReady},
		{erase.PolicyRequire, CommandRecycle, topology.StatusReady},
		{erase.PolicyRequire, "", topology.StatusReady},
	} {
		name := fmt.Sprintf("%s for %q", c.policy, c.cmd)
		d, err := Decide(Input{Tree: tree, Profile: prof, Erase: c.policy, For: c.cmd})
		if err != nil {
			t.Fatal(err)
		}
		decided := d.Decided()
		for _, v := range decided {
			if v.Status != c.want {
				t.Errorf("%s: %s %s %v, want %s", name, v.Unit, v.Status, v.Reasons, c.want)
			}
			if c.want != topology.StatusReady && (len(v.Reasons) != 1 || !strings.Contains(v.Reasons[0], "apply does not erase")) {
				t.Errorf("%s: %s reasons %q", name, v.Unit, v.Reasons)
			}
		}
		skipped := 0
		for _, p := range d.ACS {
			if p.Skip != "" {
				skipped++
			}
		}
		if wantSkip := c.want == topology.StatusFailed; (skipped == len(d.ACS)) != wantSkip || (skipped > 0) != wantSkip {
			t.Errorf("%s: %d of %d ports skipped", name, skipped, len(d.ACS))
		}
		if (d.KernelArg == "") != (c.want == topology.StatusFailed) {
			t.Errorf("%s: kernel argument %q", name, d.KernelArg)
		}
		acs, bind := cleanRun(d)
		if len(bind.Units) != 0 && c.want == topology.StatusFailed {
			t.Errorf("%s: %d units to bind", name, len(bind.Units))
		}
		if n := len(d.ErasePlan(acs)); (n != 0) != (c.policy.Active() && c.cmd != CommandApply) {
			t.Errorf("%s: %d units to erase", name, n)
		}
		if c.cmd == CommandApply {
			got := d.Conclude(Execution{ACS: acs, Binding: true, Bind: bind})
			if fmt.Sprint(got) != fmt.Sprint(decided) {
				t.Errorf("%s: concluded %v, decided %v", name, got, decided)
			}
		}
	}
}
