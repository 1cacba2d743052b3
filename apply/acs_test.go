package apply

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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

func run(t *testing.T, b *b300, io pci.ConfigIO, ports []topology.ACSPort, opt Options) Report {
	t.Helper()
	opt.IO = io
	if opt.Sleep == nil {
		s := &sleeps{}
		opt.Sleep = s.sleep
	}
	rep, err := ACS(context.Background(), ports, b.units, opt)
	if err != nil {
		t.Fatal(err)
	}
	return rep
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
	rep := run(t, b, io, plan, Options{})
	nics := nicPorts(t, b)
	if len(rep.Changes) != len(plan) {
		t.Fatalf("%d changes for %d ports", len(rep.Changes), len(plan))
	}
	for _, c := range rep.Changes {
		if _, nic := nics[c.Addr]; nic {
			if c.Result != ResultWritten || c.Before != iso || c.Target != isoDT || c.After != isoDT || c.Attempts != 1 {
				t.Errorf("nic port %s", c)
			}
			continue
		}
		if c.Result != ResultAlreadySet || c.Before != iso || c.After != iso || c.Attempts != 0 {
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
	for _, u := range b.units {
		if u.Status != topology.StatusReady || len(u.Reasons) != 0 {
			t.Errorf("unit %d: %s %v", u.ID, u.Status, u.Reasons)
		}
	}
	if rep.Failed() || len(rep.Advice) != 0 {
		t.Errorf("failed=%v advice=%v", rep.Failed(), rep.Advice)
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
	rep2 := run(t, b, io2, plan, Options{})
	for _, c := range rep2.Changes {
		if c.Result != ResultAlreadySet {
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
	rep := run(t, b, io, b.plan(t), Options{DryRun: true})
	n := 0
	for _, c := range rep.Changes {
		if c.Result == ResultDryRun {
			n++
			if c.Target != isoDT || c.After != iso {
				t.Errorf("dry run %s", c)
			}
		}
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
	rep := run(t, b, io, plan, Options{KernelRelease: kernel})
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
			if c.Result != ResultLockedDown || c.After != iso || c.Attempts != 1 || !strings.Contains(c.Error, "operation not permitted") {
				t.Errorf("nic port %s", c)
			}
		} else if c.Result != ResultAlreadySet {
			t.Errorf("other port %s", c)
		}
	}
	for _, u := range b.units {
		wantArg := "pci=config_acs=1x111x1@" + b.node.Addr(fmt.Sprintf("cx-dsp-nic%d", u.ID)).String() + " "
		if u.Status != topology.StatusDegraded || len(u.Reasons) != 1 || !strings.Contains(u.Reasons[0], wantArg) {
			t.Errorf("unit %d: %s %q", u.ID, u.Status, u.Reasons)
		}
	}
	if d := diffConfigs(before, configs(t, b.node.Root)); len(d) != 0 {
		t.Errorf("locked-down run changed %v", d)
	}
}

// A locked-down port that does not isolate yet cannot be fixed from user space: the unit
// is failed, not merely degraded.
func TestApplyLockdownWithoutIsolation(t *testing.T) {
	b := newB300(t, func(s *pcitest.Spec) {
		setACSCtl(s, "gpu-dsp2", 0)
	})
	io := newFaultIO(b.node.Root)
	for _, d := range b.tree.Devices {
		io.faults[d.Addr] = &fault{writeErr: syscall.EPERM, writeErrN: -1}
	}
	rep := run(t, b, io, b.plan(t), Options{})
	for _, u := range b.units {
		want := topology.StatusDegraded
		if u.ID == 2 {
			want = topology.StatusFailed
		}
		if u.Status != want {
			t.Errorf("unit %d: %s, want %s (%v)", u.ID, u.Status, want, u.Reasons)
		}
	}
	if !strings.Contains(rep.Advice[0], "xx111x1@"+b.node.Addr("gpu-dsp2").String()) || strings.Contains(rep.Advice[0], "running") {
		t.Errorf("advice %q", rep.Advice[0])
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
			rep := run(t, b, io, b.plan(t), Options{Sleep: s.sleep, Backoff: time.Millisecond})
			c := byAddr(rep)[a]
			if c.Result != ResultWritten || c.Attempts != 3 || c.After != isoDT {
				t.Errorf("%s", c)
			}
			if fmt.Sprint(s.d) != "[1ms 2ms]" {
				t.Errorf("waits %v, want [1ms 2ms]", s.d)
			}
			if b.units[2].Status != topology.StatusReady {
				t.Errorf("unit 2 %s", b.units[2].Status)
			}
		})
		t.Run(errno.Error()+"/persistent", func(t *testing.T) {
			b := newB300(t, nil)
			io := newFaultIO(b.node.Root)
			a := b.node.Addr("cx-dsp-nic2")
			io.faults[a] = &fault{writeErr: errno, writeErrN: -1}
			s := &sleeps{}
			before := configs(t, b.node.Root)
			rep := run(t, b, io, b.plan(t), Options{Sleep: s.sleep, Retries: 3})
			c := byAddr(rep)[a]
			if c.Result != ResultFailed || c.Attempts != 4 || !strings.Contains(c.Error, "after 4 attempts") || !strings.Contains(c.Error, errno.Error()) || c.After != iso {
				t.Errorf("%s", c)
			}
			if len(s.d) != 3 || s.d[0] != DefaultBackoff || s.d[2] != 4*DefaultBackoff {
				t.Errorf("waits %v", s.d)
			}
			for _, u := range b.units {
				want := topology.StatusReady
				if u.ID == 2 {
					want = topology.StatusFailed
				}
				if u.Status != want {
					t.Errorf("unit %d: %s, want %s", u.ID, u.Status, want)
				}
			}
			if !strings.Contains(b.units[2].Reasons[0], a.String()) {
				t.Errorf("unit 2 reason %q does not name the port", b.units[2].Reasons[0])
			}
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
	rep := run(t, b, io, b.plan(t), Options{Retries: 2})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || !strings.Contains(c.Error, "read ACSCtl") || !strings.Contains(c.Error, "after 3 attempts") {
		t.Errorf("%s", c)
	}
	if b.units[6].Status != topology.StatusFailed || b.units[5].Status != topology.StatusReady {
		t.Errorf("units %s %s", b.units[6].Status, b.units[5].Status)
	}
}

func TestApplyReadOnlyBits(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic5")
	io.faults[a] = &fault{readOnly: uint16(pci.ACSDT)}
	rep := run(t, b, io, b.plan(t), Options{})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || c.After != iso || !strings.Contains(c.Error, "wrote 0x005d, reads back 0x001d") {
		t.Errorf("%s", c)
	}
	if b.units[5].Status != topology.StatusFailed || !strings.Contains(b.units[5].Reasons[0], "0x005d") {
		t.Errorf("unit 5: %s %v", b.units[5].Status, b.units[5].Reasons)
	}
	if b.units[4].Status != topology.StatusReady {
		t.Errorf("unit 4: %s", b.units[4].Status)
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
	rep := run(t, b, io, b.plan(t), Options{Retries: 2})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || c.After&iso != iso || !strings.Contains(c.Note, "restored isolation bits") {
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

// A partial write on a port that stays locked: the note says isolation is lost, and
// the unit is failed.
func TestApplyPartialWriteUnrecoverable(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic1")
	io.faults[a] = &fault{writeErr: syscall.EIO, writeErrN: -1, clobber: []byte{0x40, 0x00}}
	rep := run(t, b, io, b.plan(t), Options{Retries: -1})
	c := byAddr(rep)[a]
	if c.Result != ResultFailed || c.Attempts != 1 || !strings.Contains(c.Note, "isolation bits SV RR CR UF clear") {
		t.Errorf("%s", c)
	}
	if b.units[1].Status != topology.StatusFailed {
		t.Errorf("unit 1 %s", b.units[1].Status)
	}
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
		rep := run(t, b, io, b.plan(t), Options{})
		c := byAddr(rep)[a]
		if c.Result != ResultFailed || !strings.Contains(c.Error, "device vanished") || c.Note != "" {
			t.Errorf("%s", c)
		}
		if b.units[4].Status != topology.StatusFailed || b.units[3].Status != topology.StatusReady || rep.Writes() != 7 {
			t.Errorf("units %s %s, %d writes", b.units[4].Status, b.units[3].Status, rep.Writes())
		}
	})
	t.Run("all-ones", func(t *testing.T) {
		b := newB300(t, nil)
		a := b.node.Addr("cx-dsp-nic4")
		io := newFaultIO(b.node.Root)
		io.faults[a] = &fault{allOnesNow: true}
		rep := run(t, b, io, b.plan(t), Options{})
		c := byAddr(rep)[a]
		if c.Result != ResultFailed || !strings.Contains(c.Error, "device vanished") || !strings.Contains(c.Error, "all ones") {
			t.Errorf("%s", c)
		}
		if len(io.writes) != 7 {
			t.Errorf("%d writes, want 7", len(io.writes))
		}
	})
	t.Run("between-read-and-write", func(t *testing.T) {
		b := newB300(t, nil)
		a := b.node.Addr("cx-dsp-nic4")
		io := newFaultIO(b.node.Root)
		io.faults[a] = &fault{writeErr: syscall.ENODEV, writeErrN: -1}
		rep := run(t, b, io, b.plan(t), Options{})
		c := byAddr(rep)[a]
		if c.Result != ResultFailed || !strings.Contains(c.Error, "device vanished") || c.Attempts != 1 {
			t.Errorf("%s", c)
		}
	})
}

func TestApplyCmdline(t *testing.T) {
	b := newB300(t, nil)
	plan := b.plan(t)
	arg := topology.KernelArg(plan)
	cmdline := "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro " + arg + " intel_iommu=on"

	// The kernel did not apply it (this tree still has DT off): written, with a note.
	rep := run(t, b, newFaultIO(b.node.Root), plan, Options{Cmdline: cmdline})
	nics := nicPorts(t, b)
	for _, c := range rep.Changes {
		if _, nic := nics[c.Addr]; nic && (c.Result != ResultWritten || !strings.Contains(c.Note, "kernel did not apply pci=config_acs=1x111x1@")) {
			t.Errorf("%s", c)
		}
	}
	// The kernel applied it: verified, nothing written.
	io := newFaultIO(b.node.Root)
	rep = run(t, b, io, plan, Options{Cmdline: cmdline})
	for _, c := range rep.Changes {
		if c.Result != ResultVerified {
			t.Errorf("%s", c)
		}
	}
	if len(io.writes) != 0 {
		t.Errorf("verify-only run wrote %v", io.writes)
	}
	// A different setting for the port is not the same argument: the plan is checked as
	// usual ("already set"), not claimed as the kernel's.
	rep = run(t, b, newFaultIO(b.node.Root), plan[:1], Options{Cmdline: "pci=noaer,config_acs=0x111x1@" + plan[0].Addr.String()})
	if rep.Changes[0].Result != ResultAlreadySet {
		t.Errorf("%s", rep.Changes[0])
	}
}

func TestApplyBadInput(t *testing.T) {
	b := newB300(t, nil)
	if _, err := ACS(context.Background(), nil, nil, Options{}); err == nil {
		t.Error("no IO accepted")
	}
	p := b.port(t, "cx-dsp-nic0", 0, posNIC, isoDT)
	bad := p
	bad.Offset = 0xffe
	none := p
	none.Offset = 0
	ghost := p
	ghost.Addr = pci.MustParseAddress("0000:ff:1f.7")
	ghost.Unit = 99
	rep := run(t, b, newFaultIO(b.node.Root), []topology.ACSPort{bad, none, ghost}, Options{})
	if c := rep.Changes[0]; c.Result != ResultFailed || !strings.Contains(c.Error, "outside extended config space") {
		t.Errorf("%s", c)
	}
	if c := rep.Changes[1]; c.Result != ResultNoACS {
		t.Errorf("%s", c)
	}
	if c := rep.Changes[2]; c.Result != ResultFailed || !strings.Contains(c.Error, "vanished") {
		t.Errorf("%s", c)
	}
	if b.units[0].Status != topology.StatusFailed {
		t.Errorf("unit 0 %s", b.units[0].Status)
	}
}

func TestApplyContextStopsRetries(t *testing.T) {
	b := newB300(t, nil)
	io := newFaultIO(b.node.Root)
	a := b.node.Addr("cx-dsp-nic0")
	io.faults[a] = &fault{writeErr: syscall.EIO, writeErrN: -1}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rep, err := ACS(ctx, b.plan(t)[:1], b.units, Options{IO: io, Backoff: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	c := rep.Changes[0]
	if c.Result != ResultFailed || c.Attempts != 1 || !strings.Contains(c.Error, "retries stopped") || !errors.Is(context.Canceled, context.Canceled) {
		t.Errorf("%s", c)
	}
}

func TestApplySkipsFailedUnit(t *testing.T) {
	b := newB300(t, nil)
	b.units[7].Degrade(topology.StatusFailed, "ats: required")
	io := newFaultIO(b.node.Root)
	rep := run(t, b, io, b.plan(t), Options{})
	for _, c := range rep.Changes {
		if (c.Unit == 7) != (c.Result == ResultSkipped) {
			t.Errorf("%s", c)
		}
	}
	if rep.Writes() != 7 || len(b.units[7].Reasons) != 1 {
		t.Errorf("%d writes; unit 7 reasons %v", rep.Writes(), b.units[7].Reasons)
	}
	for _, w := range io.writes {
		if w.addr == b.node.Addr("cx-dsp-nic7") {
			t.Errorf("failed unit's port written")
		}
	}
}
