package apply

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

const (
	iso    = pci.ACSIsolation
	isoDT  = pci.ACSIsolation | pci.ACSDT
	kernel = "6.1.0-57-amd64"
)

func run(t *testing.T, io pci.ConfigIO, ports []topology.ACSPort, opt Options) Report {
	t.Helper()
	return runCtx(t, context.Background(), io, ports, opt)
}

func runCtx(t *testing.T, ctx context.Context, io pci.ConfigIO, ports []topology.ACSPort, opt Options) Report {
	t.Helper()
	opt.IO = io
	if opt.Sleep == nil {
		s := &sleeps{}
		opt.Sleep = s.sleep
	}
	rep, err := ACS(ctx, ports, opt)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Changes) != len(ports) {
		t.Fatalf("%d changes for %d ports", len(rep.Changes), len(ports))
	}
	for i, c := range rep.Changes {
		if c.Addr != ports[i].Addr || c.Unit != ports[i].Unit {
			t.Fatalf("change %d is %s, not port %s of unit %d: the report is not in plan order", i, c, ports[i].Addr, ports[i].Unit)
		}
	}
	return rep
}

// failedOnly checks that exactly the given ports failed (Change.Failed), none other.
func failedOnly(t *testing.T, rep Report, addrs ...pci.Address) {
	t.Helper()
	want := map[pci.Address]bool{}
	for _, a := range addrs {
		want[a] = true
	}
	for _, c := range rep.Changes {
		if c.Failed() != want[c.Addr] {
			t.Errorf("failed=%v, want %v: %s", c.Failed(), want[c.Addr], c)
		}
	}
	if rep.Failed() != (len(addrs) > 0) {
		t.Errorf("report failed=%v with %d failed ports", rep.Failed(), len(addrs))
	}
}

func nicPorts(t *testing.T, b *b300) map[pci.Address]int {
	out := map[pci.Address]int{}
	for i := 0; i < 8; i++ {
		out[b.node.Addr(fmt.Sprintf("cx-dsp-nic%d", i))] = i
	}
	return out
}

func TestApplyB300(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	io := newFaultIO(b.node.Root)
	before := configs(t, b.node.Root)
	rep := run(t, io, plan, Options{})
	nics := nicPorts(t, b)
	for _, c := range rep.Changes {
		if c.Error != "" || c.Note != "" || c.Failed() {
			t.Errorf("port %s", c)
		}
		if _, nic := nics[c.Addr]; nic {
			if c.Result != ResultApplied || c.Before != iso || c.Target != isoDT || c.After != isoDT || c.Attempts != 1 {
				t.Errorf("nic port %s", c)
			}
			continue
		}
		if c.Result != ResultUnchanged || c.Before != iso || c.After != iso || c.Attempts != 0 {
			t.Errorf("other port %s", c)
		}
	}
	if got := io.landed(); got != 8 || rep.Writes() != 8 {
		t.Errorf("%d writes landed, report says %d, want 8", got, rep.Writes())
	}
	for _, w := range io.writes {
		if _, nic := nics[w.addr]; !nic || w.n != 2 {
			t.Errorf("write %+v outside the plan's NIC ports or not 16 bits", w)
		}
	}
	if rep.Failed() || len(rep.Advice) != 0 {
		t.Errorf("failed=%v advice=%v", rep.Failed(), rep.Advice)
	}
	if rep.ConfigACS != topology.KernelArg(plan) {
		t.Errorf("config_acs %q, want the whole plan %q", rep.ConfigACS, topology.KernelArg(plan))
	}

	// Nothing else in config space changed: every byte of every function is compared.
	after := configs(t, b.node.Root)
	if len(after) != len(before) || len(before) < 100 {
		t.Fatalf("%d functions before, %d after", len(before), len(after))
	}
	allowed := map[string]bool{}
	for a := range nics {
		d := b.tree.Lookup(a)
		allowed[fmt.Sprintf("%s+0x%03x", a, d.ACS.CtlOffset())] = true // DT is bit 6: low byte only
	}
	diff := diffConfigs(before, after)
	for k := range diff {
		if !allowed[k] {
			t.Errorf("config byte changed outside the plan: %s", k)
		}
	}
	if len(diff) != 8 {
		t.Errorf("%d bytes changed, want 8 (one per NIC port): %v", len(diff), diff)
	}

	// A second run is a no-op.
	io2 := newFaultIO(b.node.Root)
	rep2 := run(t, io2, plan, Options{})
	for _, c := range rep2.Changes {
		if c.Result != ResultUnchanged || c.Before != c.Target || c.After != c.Target {
			t.Errorf("second run: %s", c)
		}
	}
	if io2.landed() != 0 || len(io2.writes) != 0 {
		t.Errorf("second run wrote %v", io2.writes)
	}
	if d := diffConfigs(after, configs(t, b.node.Root)); len(d) != 0 {
		t.Errorf("second run changed %v", d)
	}
}

func TestApplyDryRun(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	before := configs(t, b.node.Root)
	rep := run(t, io, b.plan(t), Options{DryRun: true})
	nics := nicPorts(t, b)
	n := 0
	for _, c := range rep.Changes {
		if _, nic := nics[c.Addr]; nic != (c.Result == ResultWouldApply) {
			t.Errorf("dry run %s", c)
		}
		if c.Result == ResultWouldApply {
			n++
			if c.Target != isoDT || c.After != iso || c.Attempts != 0 || c.Failed() {
				t.Errorf("dry run %s", c)
			}
		}
	}
	if rep.Failed() || rep.Writes() != 0 {
		t.Errorf("dry run: failed=%v writes=%d", rep.Failed(), rep.Writes())
	}
	if n != 8 || len(io.writes) != 0 {
		t.Errorf("%d would-writes, %d writes", n, len(io.writes))
	}
	if d := diffConfigs(before, configs(t, b.node.Root)); len(d) != 0 {
		t.Errorf("dry run changed %v", d)
	}
}

func TestApplyLockdown(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	io := newFaultIO(b.node.Root)
	nics := nicPorts(t, b)
	for a := range nics {
		io.faults[a] = &fault{writeErr: syscall.EPERM, writeErrN: -1}
	}
	before := configs(t, b.node.Root)
	rep := run(t, io, plan, Options{KernelRelease: kernel})
	var entries []string
	for i := 0; i < 8; i++ {
		entries = append(entries, "1x111x1@"+b.node.Addr(fmt.Sprintf("cx-dsp-nic%d", i)).String())
	}
	wantArg := "pci=config_acs=" + strings.Join(entries, ";")
	if len(rep.Advice) != 1 {
		t.Fatalf("advice %v", rep.Advice)
	}
	for _, want := range []string{"config writes are locked down; boot with: " + wantArg + " ", "Linux 6.11 or newer", kernel} {
		if !strings.Contains(rep.Advice[0], want) {
			t.Errorf("advice %q lacks %q", rep.Advice[0], want)
		}
	}
	for _, c := range rep.Changes {
		if _, nic := nics[c.Addr]; nic {
			// Refused, but the port still isolates: the refusal costs DT only, which is
			// what lets the decision degrade the unit rather than fail it.
			if c.Result != ResultLockedDown || c.After != iso || c.Attempts != 1 || !strings.Contains(c.Error, "operation not permitted") || !c.Isolated() {
				t.Errorf("nic port %s", c)
			}
		} else if c.Result != ResultUnchanged {
			t.Errorf("other port %s", c)
		}
	}
	var locked []pci.Address
	for a := range nics {
		locked = append(locked, a)
	}
	failedOnly(t, rep, locked...)
	if d := diffConfigs(before, configs(t, b.node.Root)); len(d) != 0 {
		t.Errorf("locked-down run changed %v", d)
	}
}

// A locked-down port that does not isolate yet cannot be fixed from user space: its
// change says it is not isolated (the decision fails the unit for it), and the unit's
// later ports are left alone. Lockdown is found either by a refused write (EPERM) or
// beforehand (Options.LockedDown, without any write).
func TestApplyLockdownWithoutIsolation(t *testing.T) {
	for _, tc := range []struct {
		name     string
		eperm    bool
		opt      Options
		attempts int
	}{
		{name: "eperm", eperm: true, attempts: 1},
		{name: "option", opt: Options{LockedDown: true}},
		{name: "option-dry-run", opt: Options{LockedDown: true, DryRun: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newB300(t, func(s *pcitest.Spec) {
				setACSCtl(s, "gpu-dsp2", 0)
			})
			io := newFaultIO(b.node.Root)
			if tc.eperm {
				for _, d := range b.tree.Devices {
					io.faults[d.Addr] = &fault{writeErr: syscall.EPERM, writeErrN: -1}
				}
			}
			before := configs(t, b.node.Root)
			rep := run(t, io, b.plan(t), tc.opt)
			bad := b.node.Addr("gpu-dsp2")
			nics := nicPorts(t, b)
			var failed []pci.Address
			for _, c := range rep.Changes {
				_, nic := nics[c.Addr]
				switch {
				case c.Addr == bad:
					if c.Result != ResultLockedDown || c.Isolated() || c.Before != 0 || c.After != 0 || c.Attempts != tc.attempts {
						t.Errorf("non-isolating port %s", c)
					}
					failed = append(failed, c.Addr)
				case c.Unit == 2 && c.Position != posRoot:
					// After gpu-dsp2 in plan order: cx-dsp-gpu2 and the DT port.
					if c.Result != ResultSkipped || !strings.Contains(c.Note, bad.String()) || c.Attempts != 0 {
						t.Errorf("unit 2 port after the refused one: %s", c)
					}
				case nic:
					if c.Result != ResultLockedDown || !c.Isolated() || c.Attempts != tc.attempts {
						t.Errorf("nic port %s", c)
					}
					failed = append(failed, c.Addr)
				default:
					if c.Result != ResultUnchanged {
						t.Errorf("other port %s", c)
					}
				}
			}
			failedOnly(t, rep, failed...)
			if len(rep.Advice) != 1 {
				t.Fatalf("advice %v", rep.Advice)
			}
			adv := rep.Advice[0]
			if !strings.Contains(adv, "xx111x1@"+bad.String()) || strings.Contains(adv, b.node.Addr("cx-dsp-nic2").String()) ||
				!strings.Contains(adv, "1x111x1@"+b.node.Addr("cx-dsp-nic3").String()) || strings.Contains(adv, "running") {
				t.Errorf("advice %q", adv)
			}
			if !tc.eperm && len(io.writes) != 0 {
				t.Errorf("locked down beforehand, yet %d writes tried: %v", len(io.writes), io.writes)
			}
			if d := diffConfigs(before, configs(t, b.node.Root)); len(d) != 0 {
				t.Errorf("locked-down run changed %v", d)
			}
		})
	}
}

// Options.LockedDown: every port that needs a write is reported locked down and none is
// tried; the ports already at their target are unchanged.
func TestApplyLockedDownOption(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	io := newFaultIO(b.node.Root)
	before := configs(t, b.node.Root)
	rep := run(t, io, plan, Options{LockedDown: true, KernelRelease: "6.12.9"})
	nics := nicPorts(t, b)
	var locked []pci.Address
	for _, c := range rep.Changes {
		if _, nic := nics[c.Addr]; nic {
			if c.Result != ResultLockedDown || c.Attempts != 0 || c.Before != iso || c.After != iso || c.Target != isoDT ||
				!strings.Contains(c.Error, "locked down") || !c.Isolated() {
				t.Errorf("nic port %s", c)
			}
			locked = append(locked, c.Addr)
		} else if c.Result != ResultUnchanged {
			t.Errorf("other port %s", c)
		}
	}
	failedOnly(t, rep, locked...)
	if len(io.writes) != 0 || rep.Writes() != 0 {
		t.Errorf("locked down, yet writes tried: %v (report: %d)", io.writes, rep.Writes())
	}
	if d := diffConfigs(before, configs(t, b.node.Root)); len(d) != 0 {
		t.Errorf("locked-down run changed %v", d)
	}
	if len(rep.Advice) != 1 || !strings.Contains(rep.Advice[0], "1x111x1@"+b.node.Addr("cx-dsp-nic7").String()) ||
		!strings.Contains(rep.Advice[0], "running 6.12.9, which has it") {
		t.Errorf("advice %v", rep.Advice)
	}
}

func setACSCtl(s *pcitest.Spec, name string, ctl pci.ACSBits) {
	var walk func(fns []pcitest.Fn) bool
	walk = func(fns []pcitest.Fn) bool {
		for i := range fns {
			if fns[i].Name == name {
				a := *fns[i].ACS
				a.Ctl = ctl
				fns[i].ACS = &a
				return true
			}
			if walk(fns[i].Below) {
				return true
			}
		}
		return false
	}
	for i := range s.Hosts {
		if walk(s.Hosts[i].Fns) {
			return
		}
	}
	panic("no " + name)
}

func TestApplyTransient(t *testing.T) {
	for _, errno := range []syscall.Errno{syscall.EIO, syscall.EBUSY} {
		t.Run(errno.Error(), func(t *testing.T) {
			// Two failures then success: written, after three attempts and two waits.
			b := newB300(t, nil)
			io := newFaultIO(b.node.Root)
			a := b.node.Addr("cx-dsp-nic2")
			io.faults[a] = &fault{writeErr: errno, writeErrN: 2}
			s := &sleeps{}
			rep := run(t, io, b.plan(t), Options{Sleep: s.sleep, Backoff: time.Millisecond})
			c := byAddr(rep)[a]
			if c.Result != ResultApplied || c.Attempts != 3 || c.After != isoDT || c.Error != "" {
				t.Errorf("%s", c)
			}
			if fmt.Sprint(s.d) != "[1ms 2ms]" {
				t.Errorf("waits %v, want [1ms 2ms]", s.d)
			}
			failedOnly(t, rep)
			if rep.Writes() != 8 {
				t.Errorf("%d writes, want 8", rep.Writes())
			}
		})
		t.Run(errno.Error()+"/persistent", func(t *testing.T) {
			b := newB300(t, nil)
			io := newFaultIO(b.node.Root)
			a := b.node.Addr("cx-dsp-nic2")
			io.faults[a] = &fault{writeErr: errno, writeErrN: -1}
			s := &sleeps{}
			before := configs(t, b.node.Root)
			rep := run(t, io, b.plan(t), Options{Sleep: s.sleep, Retries: 3})
			c := byAddr(rep)[a]
			if c.Result != ResultFailed || c.Attempts != 4 || !strings.Contains(c.Error, "after 4 attempts") || !strings.Contains(c.Error, errno.Error()) || c.After != iso {
				t.Errorf("%s", c)
			}
			if len(s.d) != 3 || s.d[0] != DefaultBackoff || s.d[2] != 4*DefaultBackoff {
				t.Errorf("waits %v", s.d)
			}
			// Only that port failed: the other units are untouched by it.
			failedOnly(t, rep, a)
			if rep.Writes() != 7 {
				t.Errorf("%d writes, want the 7 other NIC ports", rep.Writes())
			}
			diff := diffConfigs(before, configs(t, b.node.Root))
			for k := range diff {
				if strings.HasPrefix(k, a.String()) {
					t.Errorf("failed port changed: %s", k)
				}
			}
		})
	}
}

func TestApplyTransientRead(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic6")
	io.faults[a] = &fault{readErr: syscall.EBUSY, readErrN: -1}
	rep := run(t, io, b.plan(t), Options{Retries: 2})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || !strings.Contains(c.Error, "read ACSCtl") || !strings.Contains(c.Error, "after 3 attempts") {
		t.Errorf("%s", c)
	}
	failedOnly(t, rep, a)
	for _, w := range io.writes {
		if w.addr == a {
			t.Errorf("unreadable port written: %+v", w)
		}
	}
	if rep.Writes() != 7 {
		t.Errorf("%d writes, want the 7 other NIC ports", rep.Writes())
	}
}

// A register that does not take a bit: the write reads back otherwise and the port is
// reported mismatched, with what it holds now.
func TestApplyReadOnlyBits(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic5")
	io.faults[a] = &fault{readOnly: uint16(pci.ACSDT)}
	rep := run(t, io, b.plan(t), Options{})
	c := byAddr(rep)[a]
	if c.Result != ResultMismatch || c.After != iso || c.Attempts != 1 || !strings.Contains(c.Error, "wrote 0x005d, reads back 0x001d") || !c.Isolated() {
		t.Errorf("%s", c)
	}
	failedOnly(t, rep, a)
	if c := byAddr(rep)[b.node.Addr("cx-dsp-nic4")]; c.Result != ResultApplied {
		t.Errorf("unit 4: %s", c)
	}
}

// A write that takes effect in part and then fails (here: it lands as 0x0040, dropping
// SV RR CR UF, then EIO every time) must not leave the port open: the executor puts the
// isolation bits back.
func TestApplyPartialWriteRestores(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic1")
	io.faults[a] = &fault{writeErr: syscall.EIO, writeErrN: 3, clobber: []byte{0x40, 0x00}}
	rep := run(t, io, b.plan(t), Options{Retries: 2})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || c.After&iso != iso || !c.Isolated() || !strings.Contains(c.Note, "restored isolation bits") {
		t.Errorf("%s", c)
	}
	v, err := pci.ReadRegister(pci.SysfsConfig{Root: b.node.Root}, a, c.Offset, 2)
	if err != nil || pci.ACSBits(v)&iso != iso {
		t.Errorf("port reads %#x, %v: isolation lost", v, err)
	}
	// Without the restore it would read 0x0040: check the fault did clobber.
	if io.landed() < 8 {
		t.Errorf("restore write did not happen: %d writes", io.landed())
	}
}

// A partial write on a port that stays locked: the note says isolation is lost, and the
// change says the port does not isolate (the decision fails its unit for that).
func TestApplyPartialWriteUnrecoverable(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic1")
	io.faults[a] = &fault{writeErr: syscall.EIO, writeErrN: -1, clobber: []byte{0x40, 0x00}}
	rep := run(t, io, b.plan(t), Options{Retries: -1})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || c.Attempts != 1 || !strings.Contains(c.Note, "isolation bits SV RR CR UF clear") || c.After != pci.ACSDT || c.Isolated() {
		t.Errorf("%s", c)
	}
	failedOnly(t, rep, a)
}

func TestApplyVanished(t *testing.T) {
	t.Run("removed", func(t *testing.T) {
		b := newB300(t, func(*pcitest.Spec) {}) // a tree of its own: this test deletes part of it
		a := b.node.Addr("cx-dsp-nic4")
		// Hot-unplug between scan and write: the kernel removes the whole subtree.
		d := b.tree.Lookup(a)
		if err := os.RemoveAll(filepath.Join(b.node.Root, d.SysPath)); err != nil {
			t.Fatal(err)
		}
		io := newFaultIO(b.node.Root)
		rep := run(t, io, b.plan(t), Options{})
		c := byAddr(rep)[a]
		if c.Result != ResultFailed || !strings.Contains(c.Error, "device vanished") || c.Note != "" {
			t.Errorf("%s", c)
		}
		failedOnly(t, rep, a)
		if c3 := byAddr(rep)[b.node.Addr("cx-dsp-nic3")]; c3.Result != ResultApplied || rep.Writes() != 7 {
			t.Errorf("unit 3: %s; %d writes", c3, rep.Writes())
		}
	})
	t.Run("all-ones", func(t *testing.T) {
		b := newB300(t, nil)
		a := b.node.Addr("cx-dsp-nic4")
		io := newFaultIO(b.node.Root)
		io.faults[a] = &fault{allOnesNow: true}
		rep := run(t, io, b.plan(t), Options{})
		c := byAddr(rep)[a]
		if c.Result != ResultFailed || !strings.Contains(c.Error, "device vanished") || !strings.Contains(c.Error, "all ones") {
			t.Errorf("%s", c)
		}
		failedOnly(t, rep, a)
		if len(io.writes) != 7 {
			t.Errorf("%d writes, want 7", len(io.writes))
		}
	})
	t.Run("between-read-and-write", func(t *testing.T) {
		b := newB300(t, nil)
		a := b.node.Addr("cx-dsp-nic4")
		io := newFaultIO(b.node.Root)
		io.faults[a] = &fault{writeErr: syscall.ENODEV, writeErrN: -1}
		rep := run(t, io, b.plan(t), Options{})
		c := byAddr(rep)[a]
		if c.Result != ResultFailed || !strings.Contains(c.Error, "device vanished") || c.Attempts != 1 {
			t.Errorf("%s", c)
		}
		failedOnly(t, rep, a)
	})
}

func TestApplyCmdline(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	arg := topology.KernelArg(plan)
	cmdline := "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro " + arg + " intel_iommu=on"

	// The kernel did not apply it (this tree still has DT off): written, with a note.
	rep := run(t, newFaultIO(b.node.Root), plan, Options{Cmdline: cmdline})
	nics := nicPorts(t, b)
	for _, c := range rep.Changes {
		if _, nic := nics[c.Addr]; nic && (c.Result != ResultApplied || !strings.Contains(c.Note, "kernel did not apply pci=config_acs=1x111x1@")) {
			t.Errorf("%s", c)
		}
	}
	if rep.Writes() != 8 {
		t.Errorf("%d writes, want 8", rep.Writes())
	}
	// The kernel applied it: verified, nothing written.
	io := newFaultIO(b.node.Root)
	rep = run(t, io, plan, Options{Cmdline: cmdline})
	for _, c := range rep.Changes {
		if c.Result != ResultVerified {
			t.Errorf("%s", c)
		}
	}
	if len(io.writes) != 0 {
		t.Errorf("verify-only run wrote %v", io.writes)
	}
	// A different setting for the port is not the same argument: the plan is checked as
	// usual ("unchanged"), not claimed as the kernel's.
	nic0 := b.planPort(t, plan, "cx-dsp-nic0")
	rep = run(t, newFaultIO(b.node.Root), []topology.ACSPort{nic0}, Options{Cmdline: "pci=noaer,config_acs=0x111x1@" + nic0.Addr.String()})
	if rep.Changes[0].Result != ResultUnchanged {
		t.Errorf("%s", rep.Changes[0])
	}
}

func TestApplyBadInput(t *testing.T) {
	b := newB300(t, nil)
	if _, err := ACS(context.Background(), nil, Options{}); err == nil {
		t.Error("no IO accepted")
	}
	p := b.port(t, "cx-dsp-nic0", 0, posNIC, isoDT)
	bad := p
	bad.Offset = 0xffe
	none := p
	none.Offset = 0
	none.Reason = "no ACS capability here"
	ghost := p
	ghost.Addr = pci.MustParseAddress("0000:ff:1f.7")
	ghost.Unit = 99
	io := newFaultIO(b.node.Root)
	rep := run(t, io, []topology.ACSPort{bad, none, ghost, p}, Options{})
	if c := rep.Changes[0]; c.Result != ResultFailed || !strings.Contains(c.Error, "outside extended config space") {
		t.Errorf("%s", c)
	}
	if c := rep.Changes[1]; c.Result != ResultNoACS || c.Note != none.Reason || c.Failed() {
		t.Errorf("%s", c)
	}
	if c := rep.Changes[2]; c.Result != ResultFailed || !strings.Contains(c.Error, "vanished") {
		t.Errorf("%s", c)
	}
	// The unit's port after its failed one is not written.
	if c := rep.Changes[3]; c.Result != ResultSkipped || !strings.Contains(c.Note, "failed first") {
		t.Errorf("%s", c)
	}
	if len(io.writes) != 0 {
		t.Errorf("writes %v", io.writes)
	}
}

// After a port of a unit fails, the unit's later ports are skipped: here the root port
// cannot be read, so the DT port below it is never written, while the other units go on.
func TestApplyStopsUnitAfterFailure(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	io := newFaultIO(b.node.Root)
	rp := b.node.Addr("rp3")
	nic := b.node.Addr("cx-dsp-nic3")
	io.faults[rp] = &fault{readErr: syscall.EIO, readErrN: -1}
	before := configs(t, b.node.Root)
	rep := run(t, io, plan, Options{Retries: -1})
	skipped := 0
	for _, c := range rep.Changes {
		switch {
		case c.Addr == rp:
			if c.Result != ResultFailed || !strings.Contains(c.Error, "read ACSCtl") || !strings.Contains(c.Error, "input/output error") {
				t.Errorf("root port %s", c)
			}
		case c.Unit == 3:
			if c.Result != ResultSkipped || c.Note != fmt.Sprintf("port %s of the unit failed first", rp) || c.Attempts != 0 || c.Failed() {
				t.Errorf("unit 3 port after the failure: %s", c)
			}
			skipped++
		case c.Position == posNIC:
			if c.Result != ResultApplied {
				t.Errorf("other unit's nic port %s", c)
			}
		default:
			if c.Result != ResultUnchanged {
				t.Errorf("other port %s", c)
			}
		}
	}
	if skipped != 3 {
		t.Errorf("%d unit 3 ports skipped, want 3 (both GPU ports and the DT port)", skipped)
	}
	failedOnly(t, rep, rp)
	for _, w := range io.writes {
		if w.addr == nic || w.addr == rp {
			t.Errorf("unit 3 written after its root port failed: %+v", w)
		}
	}
	if rep.Writes() != 7 || io.landed() != 7 {
		t.Errorf("%d writes reported, %d landed, want the 7 other units' DT ports", rep.Writes(), io.landed())
	}
	for k := range diffConfigs(before, configs(t, b.node.Root)) {
		if strings.HasPrefix(k, nic.String()) {
			t.Errorf("DT port of the failed unit changed: %s", k)
		}
	}
	v, err := pci.ReadRegister(pci.SysfsConfig{Root: b.node.Root}, nic, b.planPort(t, plan, "cx-dsp-nic3").CtlOffset(), 2)
	if err != nil || pci.ACSBits(v) != iso {
		t.Errorf("cx-dsp-nic3 reads %#x, %v, want 0x%04x (no DT)", v, err, uint16(iso))
	}
}

// A port whose Skip is set (the decision's: its unit will not be passed through) is
// reported skipped with that note and neither read nor written; it fails nothing and is
// left out of the kernel argument.
func TestApplySkipPorts(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	const why = "unit failed: not passed through, its ports are left as they are"
	skip := map[pci.Address]bool{}
	io := newFaultIO(b.node.Root)
	for i := range plan {
		if plan[i].Unit == 7 {
			plan[i].Skip = why
			skip[plan[i].Addr] = true
			// Any access would show: reads and writes of these ports fail.
			io.faults[plan[i].Addr] = &fault{readErr: syscall.ENXIO, readErrN: -1, writeErr: syscall.ENXIO, writeErrN: -1}
		}
	}
	if len(skip) != 4 {
		t.Fatalf("%d unit 7 ports", len(skip))
	}
	before := configs(t, b.node.Root)
	rep := run(t, io, plan, Options{})
	for _, c := range rep.Changes {
		if skip[c.Addr] != (c.Result == ResultSkipped) {
			t.Errorf("%s", c)
		}
		if skip[c.Addr] && (c.Note != why || c.Error != "" || c.Attempts != 0 || c.Before != 0 || c.After != 0) {
			t.Errorf("skipped port %s", c)
		}
	}
	failedOnly(t, rep)
	if rep.Writes() != 7 {
		t.Errorf("%d writes, want the 7 other units' DT ports", rep.Writes())
	}
	for _, w := range io.writes {
		if skip[w.addr] {
			t.Errorf("skipped port written: %+v", w)
		}
	}
	for k := range diffConfigs(before, configs(t, b.node.Root)) {
		for a := range skip {
			if strings.HasPrefix(k, a.String()) {
				t.Errorf("skipped port changed: %s", k)
			}
		}
	}
	nic7, nic6 := b.node.Addr("cx-dsp-nic7").String(), b.node.Addr("cx-dsp-nic6").String()
	if strings.Contains(rep.ConfigACS, nic7) || !strings.Contains(rep.ConfigACS, "1x111x1@"+nic6) {
		t.Errorf("config_acs %q: want unit 6's ports and none of unit 7's", rep.ConfigACS)
	}
}

// cancelIO cancels the run's context once a write has landed.
type cancelIO struct {
	*faultIO
	cancel context.CancelFunc
}

func (c cancelIO) WriteConfig(a pci.Address, off int64, p []byte) error {
	err := c.faultIO.WriteConfig(a, off, p)
	c.cancel()
	return err
}

// Once the context is done nothing more is written: the ports that still need a write
// fail without one, and the reads that show which do go on.
func TestApplyNoWriteAfterCancel(t *testing.T) {
	t.Run("before", func(t *testing.T) {
		b := newB300(t, nil)
		io := newFaultIO(b.node.Root)
		before := configs(t, b.node.Root)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		rep := runCtx(t, ctx, io, b.plan(t), Options{})
		nics := nicPorts(t, b)
		var failed []pci.Address
		for _, c := range rep.Changes {
			if _, nic := nics[c.Addr]; nic {
				if c.Result != ResultFailed || c.Error != "not written: context canceled" || c.Attempts != 0 || c.After != iso {
					t.Errorf("nic port %s", c)
				}
				failed = append(failed, c.Addr)
			} else if c.Result != ResultUnchanged {
				t.Errorf("other port %s", c)
			}
		}
		failedOnly(t, rep, failed...)
		if len(io.writes) != 0 {
			t.Errorf("writes after cancel: %v", io.writes)
		}
		if d := diffConfigs(before, configs(t, b.node.Root)); len(d) != 0 {
			t.Errorf("cancelled run changed %v", d)
		}
	})
	t.Run("during", func(t *testing.T) {
		b := newB300(t, nil)
		fio := newFaultIO(b.node.Root)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		before := configs(t, b.node.Root)
		rep := runCtx(t, ctx, cancelIO{fio, cancel}, b.plan(t), Options{})
		first := b.node.Addr("cx-dsp-nic0")
		var failed []pci.Address
		for _, c := range rep.Changes {
			switch {
			case c.Addr == first:
				if c.Result != ResultApplied || c.After != isoDT {
					t.Errorf("first nic port %s", c)
				}
			case c.Position == posNIC:
				if c.Result != ResultFailed || !strings.Contains(c.Error, "not written: context canceled") || c.Attempts != 0 {
					t.Errorf("nic port after cancel %s", c)
				}
				failed = append(failed, c.Addr)
			default:
				if c.Result != ResultUnchanged {
					t.Errorf("other port %s", c)
				}
			}
		}
		failedOnly(t, rep, failed...)
		if len(failed) != 7 || len(fio.writes) != 1 || fio.writes[0].addr != first {
			t.Errorf("%d ports refused, writes %v: want one write, to %s", len(failed), fio.writes, first)
		}
		diff := diffConfigs(before, configs(t, b.node.Root))
		if len(diff) != 1 || !diff[fmt.Sprintf("%s+0x%03x", first, b.dev(t, "cx-dsp-nic0").ACS.CtlOffset())] {
			t.Errorf("changed %v, want the first nic port's ACSCtl only", diff)
		}
	})
}

// A context done during the retries stops them (the real backoff timer included), and
// then nothing more is written: no retry, no restore of the port, no later port.
func TestApplyContextStopsRetries(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic0")
	// The first write fails with EIO having landed in part (isolation bits dropped): a
	// retry would succeed, and so would a restore.
	io.faults[a] = &fault{writeErr: syscall.EIO, writeErrN: 1, clobber: []byte{0x40, 0x00}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	waits := 0
	sleep := func(ctx context.Context, d time.Duration) error {
		waits++
		cancel()
		return sleepCtx(ctx, d) // Backoff is an hour: this returns only because ctx is done
	}
	var ports []topology.ACSPort
	for _, p := range plan {
		if p.Unit <= 1 {
			ports = append(ports, p)
		}
	}
	rep := runCtx(t, ctx, io, ports, Options{Backoff: time.Hour, Sleep: sleep})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || c.Attempts != 1 || !strings.Contains(c.Error, "retries stopped: context canceled") || !strings.Contains(c.Error, "input/output error") {
		t.Errorf("%s", c)
	}
	if c.Note != "" {
		t.Errorf("port touched after the cancel: %s", c)
	}
	if waits != 1 {
		t.Errorf("%d waits, want 1", waits)
	}
	if len(io.writes) != 1 || io.writes[0].addr != a || io.writes[0].n >= 0 {
		t.Errorf("writes %v, want the one failed write to %s", io.writes, a)
	}
	nic1 := byAddr(rep)[b.node.Addr("cx-dsp-nic1")]
	if nic1.Result != ResultFailed || nic1.Error != "not written: context canceled" {
		t.Errorf("unit 1: %s", nic1)
	}
}

// The manifest's words: addresses and registers as text, results as the words above.
func TestChangeJSON(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic5")
	io.faults[a] = &fault{readOnly: uint16(pci.ACSDT)}
	rep := run(t, io, []topology.ACSPort{b.planPort(t, b.plan(t), "cx-dsp-nic5")}, Options{})
	j, err := json.Marshal(rep.Changes[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"bdf":"` + a.String() + `"`, `"unit":"gpu5"`, `"position":"nic-port"`, `"mask":"0x005d"`, `"flags":"0x005d"`,
		`"before":"0x001d"`, `"target":"0x005d"`, `"after":"0x001d"`, `"result":"mismatch"`, `"attempts":1`, `"error":"wrote 0x005d, reads back 0x001d"`} {
		if !strings.Contains(string(j), want) {
			t.Errorf("%s lacks %s", j, want)
		}
	}
	var back Change
	if err := json.Unmarshal(j, &back); err != nil || !reflect.DeepEqual(back, rep.Changes[0]) {
		t.Errorf("round trip: %+v, %v", back, err)
	}
}
