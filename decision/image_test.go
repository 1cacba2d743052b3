package decision

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/apply/applytest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// refuseWrites is a locked-down kernel's config space: reads work, writes are refused,
// and a test that expected none fails.
type refuseWrites struct {
	pci.ConfigIO
	t *testing.T
}

func (r refuseWrites) WriteConfig(a pci.Address, off int64, _ []byte) error {
	r.t.Errorf("config write to %s at %#x under lockdown", a, off)
	return syscall.EPERM
}

const testPlanDigest = "sha256:5b1f0c8e54c2b3d2b8a1f0e2d6c4a8b9e7f6d5c4b3a29180f7e6d5c4b3a29180"

// kernelBoot is a B300 node whose kernel was booted with arg (a pci=config_acs=) and set
// every port in set to its plan's target, as Linux 6.11+ does before passage runs; its
// log says so. It returns the tree's root and the plan the argument came from.
func kernelBoot(t *testing.T, drop func(topology.ACSPort) bool, unset func(topology.ACSPort) bool) (string, *Decision, Live) {
	t.Helper()
	node := pcitest.New(t, pcitest.B300())
	// The reference node: the plan `passage plan -o` saves and `make uki PLAN=` bakes.
	ref := b300Decision(t, Live{})
	var planned, set []topology.ACSPort
	for _, p := range ref.ACS {
		if p.Skip != "" || p.Offset == 0 || drop != nil && drop(p) {
			continue
		}
		planned = append(planned, p)
		if unset == nil || !unset(p) {
			set = append(set, p)
		}
	}
	log, err := applytest.KernelSets(pci.SysfsConfig{Root: node.Root}, set)
	if err != nil {
		t.Fatal(err)
	}
	live := Live{Cmdline: "console=ttyS0 " + topology.KernelArg(planned) + " " + PlanArg + "=" + testPlanDigest,
		Release: "6.12.117+deb13-amd64", Lockdown: "integrity", KernelLog: log}
	return node.Root, ref, live
}

// decideAndRun decides on the tree under root as the boot does and executes the ACS
// step on a kernel that refuses writes; it returns the decision, the report and the
// concluded verdicts (binding clean).
func decideAndRun(t *testing.T, root string, live Live) (*Decision, apply.Report, []Verdict) {
	t.Helper()
	d := b300DecisionAt(t, root, live)
	rep, err := d.ExecuteACS(context.Background(), refuseWrites{pci.SysfsConfig{Root: root}, t}, false)
	if err != nil {
		t.Fatal(err)
	}
	_, bind := cleanRun(d)
	return d, rep, d.Conclude(Execution{ACS: &rep, Binding: true, Bind: bind})
}

// TestImagePlanVerified: the signed image's command line carries the node's own plan
// and the kernel set every port: under lockdown every port is verified by read-back,
// nothing is written, every unit is ready, and the decision says the node matched.
func TestImagePlanVerified(t *testing.T) {
	root, _, live := kernelBoot(t, nil, nil)
	d, rep, vs := decideAndRun(t, root, live)
	for _, c := range rep.Changes {
		if c.Result != apply.ResultVerified && c.Result != apply.ResultSkipped && c.Result != apply.ResultNoACS {
			t.Errorf("%s: %s, want verified", c, c.Result)
		}
	}
	if rep.Writes() != 0 || len(rep.Changes) == 0 {
		t.Errorf("%d writes of %d ports", rep.Writes(), len(rep.Changes))
	}
	for _, v := range vs {
		if v.Status != topology.StatusReady {
			t.Errorf("unit %s: %s %q, want ready", v.Unit, v.Status, v.Reasons)
		}
	}
	if !slices.EqualFunc(vs, d.Decided(), func(a, b Verdict) bool { return a.Status == b.Status && slices.Equal(a.Reasons, b.Reasons) }) {
		t.Errorf("the run concluded %v, the decision said %v", vs, d.Decided())
	}
	im := d.Image
	if im == nil || !im.Matched || im.Digest != testPlanDigest || len(im.Differences) != 0 || !strings.HasPrefix(im.Kernel, "configured 48 ports") {
		t.Errorf("image plan %+v, want matched with the digest and 48 ports configured", im)
	}
	if arg := strings.Fields(live.Cmdline)[1]; im == nil || im.ConfigACS != arg {
		t.Errorf("image plan's argument %+v, want the line's %q", im, arg)
	}
}

// TestImagePlanMismatch: the kernel was asked for a port and did not set it (a kernel
// that ignored or refused the argument): the port is a mismatch naming what was asked
// and what it reads, the unit is degraded (its isolation holds, DT is lost), the other
// units stay ready, and the decision said so before anything ran.
func TestImagePlanMismatch(t *testing.T) {
	var missed pci.Address
	root, _, live := kernelBoot(t, nil, func(p topology.ACSPort) bool {
		if p.Position == "nic-port" && p.Unit == 2 {
			missed = p.Addr
			return true
		}
		return false
	})
	for _, tc := range []struct {
		name    string
		live    func(Live) Live
		because string
	}{
		{"not configured", func(l Live) Live { return l }, "the kernel configured other ports, not this one"},
		{"refused", func(l Live) Live {
			l.KernelLog = append(l.KernelLog, "6,12,100,-;PCI: Can't parse ACS command line parameter")
			return l
		}, "the kernel refused the argument"},
		{"too old", func(l Live) Live { l.Release, l.KernelLog = "6.1.0-57-amd64", []string{}; return l }, "Linux 6.1.0-57-amd64 ignores pci=config_acs="},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, rep, vs := decideAndRun(t, root, tc.live(live))
			for _, c := range rep.Changes {
				want := apply.ResultVerified
				if c.Addr == missed {
					want = apply.ResultMismatch
				}
				if c.Result != want && c.Offset != 0 && c.Result != apply.ResultSkipped {
					t.Errorf("%s: %s, want %s", c, c.Result, want)
				}
				if c.Addr == missed && !strings.Contains(c.Error, "asks 0x005d, reads 0x001d") {
					t.Errorf("%s: error %q does not say what was asked and what it reads", c.Addr, c.Error)
				}
			}
			for _, v := range vs {
				why := strings.Join(v.Reasons, "; ")
				switch {
				case v.Unit == 2:
					if v.Status != topology.StatusDegraded || !strings.Contains(why, "acs "+missed.String()+" (nic-port): mismatch") ||
						!strings.Contains(why, "asks ACSCtl 0x005d, reads 0x001d") || !strings.Contains(why, tc.because) {
						t.Errorf("unit 2: %s %q, want degraded: mismatch at %s because %q", v.Status, why, missed, tc.because)
					}
				case v.Status != topology.StatusReady:
					t.Errorf("unit %s: %s %q, want ready", v.Unit, v.Status, why)
				}
			}
			if !slices.EqualFunc(vs, d.Decided(), func(a, b Verdict) bool { return a.Status == b.Status && slices.Equal(a.Reasons, b.Reasons) }) {
				t.Errorf("the run concluded %v, the decision said %v", vs, d.Decided())
			}
		})
	}
}

// TestImagePlanOtherTopology: an image planned on a node where unit 5 did not pass
// through (its ports are not in the argument) boots a node where unit 5 is whole. The
// locked-down kernel cannot give unit 5's NIC port DT: unit 5 fails naming the port and
// the other topology; the others, whose ports the kernel set, are ready; the decision
// records that the node did not match the image's plan.
func TestImagePlanOtherTopology(t *testing.T) {
	var nicPort pci.Address
	root, _, live := kernelBoot(t, func(p topology.ACSPort) bool {
		if slices.Contains(p.Units(), 5) {
			if p.Position == "nic-port" {
				nicPort = p.Addr
			}
			return true
		}
		return false
	}, nil)
	d, _, vs := decideAndRun(t, root, live)
	for _, v := range vs {
		why := strings.Join(v.Reasons, "; ")
		switch {
		case v.Unit == 5:
			if v.Status != topology.StatusFailed || !strings.Contains(why, "acs "+nicPort.String()) || !strings.Contains(why, "planned for another topology") {
				t.Errorf("unit 5: %s %q, want failed naming %s and the other topology", v.Status, why, nicPort)
			}
		case v.Status != topology.StatusReady:
			t.Errorf("unit %s: %s %q, want ready", v.Unit, v.Status, why)
		}
	}
	if d.Image == nil || d.Image.Matched || len(d.Image.Differences) != 6 {
		t.Errorf("image plan %+v, want unmatched at unit 5's six ports", d.Image)
	}
	// No unit is ready on a port the decision could not account for.
	for _, p := range d.ACS {
		if p.Unit == 5 && p.Skip == "" {
			t.Errorf("port %s of failed unit 5 left to write", p.Addr)
		}
	}
}

// TestImagePlanWithoutLockdown: without lockdown a port the kernel set is verified and
// not rewritten, and one it did not set is written.
func TestImagePlanWithoutLockdown(t *testing.T) {
	root, _, live := kernelBoot(t, nil, func(p topology.ACSPort) bool { return p.Position == "nic-port" && p.Unit == 0 })
	live.Lockdown = "none"
	d := b300DecisionAt(t, root, live)
	rep, err := d.ExecuteACS(context.Background(), pci.SysfsConfig{Root: root}, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range rep.Changes {
		want := apply.ResultVerified
		if c.Position == "nic-port" && c.Unit == 0 {
			want = apply.ResultApplied
		}
		if c.Offset != 0 && c.Result != want {
			t.Errorf("%s: %s, want %s", c, c.Result, want)
		}
	}
}

// TestReadKernelLog: the log beneath the root, one line a record, only what speaks of
// ACS kept; none is nil, and a link out of the root is refused.
func TestReadKernelLog(t *testing.T) {
	root := t.TempDir()
	if got, err := ReadKernelLog(root); got != nil || err != nil {
		t.Errorf("no log: %q %v", got, err)
	}
	os.MkdirAll(filepath.Join(root, "dev"), 0o755)
	os.WriteFile(filepath.Join(root, KernelLogFile), []byte("6,1,2,-;pci 0000:05:00.0: Configured ACS to 0x005d\n SUBSYSTEM=pci\n DEVICE=+pci:0000:05:00.0\n6,2,3,-;random: crng init done\n"), 0o644)
	got, err := ReadKernelLog(root)
	if err != nil || len(got) != 1 || !strings.Contains(got[0], "Configured ACS") {
		t.Errorf("log: %q %v", got, err)
	}
	// A record read from the device comes whole, with its device lines.
	if m := kmsgMessage("6,1,2,-;pci 0000:05:00.0: Configured ACS to 0x005d\n SUBSYSTEM=pci\n DEVICE=+pci:0000:05:00.0\n"); m != "6,1,2,-;pci 0000:05:00.0: Configured ACS to 0x005d" {
		t.Errorf("record message %q", m)
	}
	// passage's own console, mirrored into the same log, quotes the kernel's words: never
	// taken for them.
	if m := apply.ParseKernelACSLog([]string{
		`12,9,9,-;passage:   - unit gpu1: acs 0000:0e:00.0: the kernel refused the argument ("PCI: Can't parse ACS command line parameter")`,
		`12,10,9,-;passage: acs 0000:05:00.0: Configured ACS to 0x005d`,
	}); m.Refused || len(m.Configured) != 0 {
		t.Errorf("passage's own lines read as the kernel's: %+v", m)
	}
	l := apply.ParseKernelACSLog(got)
	a, _ := pci.ParseAddress("0000:05:00.0")
	if !l.Read || l.Configured[a] != 0x5d {
		t.Errorf("parsed %+v", l)
	}
	os.Remove(filepath.Join(root, KernelLogFile))
	os.Symlink("/proc/self/environ", filepath.Join(root, KernelLogFile))
	if _, err := ReadKernelLog(root); err == nil {
		t.Error("a link as the log was read")
	}
	// The real kernel's log is readable by root: a smoke test of the record reader,
	// which must return (non-blocking) rather than wait for the next message.
	if os.Geteuid() == 0 {
		if _, err := ReadKernelLog("/"); err != nil {
			t.Errorf("/dev/kmsg: %v", err)
		}
	}
}

// TestImagePlanPortListedTwice: the image's argument lists a port twice, every control
// off first and the plan's entry second, spelled as the kernel may read it (the address,
// the address without its domain, a slot and function the kernel masks, a path from the
// root port). The kernel applied the first entry and stopped (__pci_config_acs): the
// decision judges the port by that entry, so the unit fails naming it and the node is
// not matched, although the plan's own entry is on the line too.
func TestImagePlanPortListedTwice(t *testing.T) {
	node := pcitest.New(t, pcitest.B300())
	ref := b300Decision(t, Live{})
	port := node.Addr("cx-dsp-nic3")
	for name, spelled := range map[string]string{
		"address":         port.String(),
		"no domain":       fmt.Sprintf("%02x:%02x.%x", port.Bus, port.Device, port.Function),
		"masked devfn":    fmt.Sprintf("0:%x:%x.%x", port.Bus, port.Device+0x20, port.Function+8),
		"path from rp3":   node.Addr("rp3").String() + "/00.0/00.0/00.0/00.0",
		"hex with prefix": fmt.Sprintf("0x0:0x%x:0x%x.0x%x", port.Bus, port.Device, port.Function),
	} {
		t.Run(name, func(t *testing.T) {
			root := pcitest.New(t, pcitest.B300()).Root
			var planned, set []topology.ACSPort
			for _, p := range ref.ACS {
				if p.Skip != "" || p.Offset == 0 {
					continue
				}
				planned = append(planned, p)
				if p.Addr == port {
					p.Mask, p.Flags = 0x7f, 0 // what the kernel applied: the first entry
				}
				set = append(set, p)
			}
			log, err := applytest.KernelSets(pci.SysfsConfig{Root: root}, set)
			if err != nil {
				t.Fatal(err)
			}
			weak := "0000000@" + spelled
			arg := strings.Replace(topology.KernelArg(planned), "pci=config_acs=", "pci=config_acs="+weak+";", 1)
			live := Live{Cmdline: "console=ttyS0 " + arg + " " + PlanArg + "=" + testPlanDigest,
				Release: "6.12.117+deb13-amd64", Lockdown: "integrity", KernelLog: log}
			d, _, vs := decideAndRun(t, root, live)
			for _, v := range vs {
				why := strings.Join(v.Reasons, "; ")
				switch {
				case v.Unit == 3:
					if v.Status != topology.StatusFailed || !strings.Contains(why, "acs "+port.String()) || !strings.Contains(why, weak) {
						t.Errorf("unit 3: %s %q, want failed naming %s and the entry the kernel applied (%s)", v.Status, why, port, weak)
					}
				case v.Status != topology.StatusReady:
					t.Errorf("unit %s: %s %q, want ready", v.Unit, v.Status, why)
				}
			}
			if d.Image == nil || d.Image.Matched || len(d.Image.Differences) != 1 || !strings.Contains(d.Image.Differences[0], weak) {
				t.Errorf("image plan %+v, want unmatched at %s only, naming %s", d.Image, port, weak)
			}
		})
	}
}

// TestImagePlanCutOff: a command line as long as the kernel keeps (COMMAND_LINE_SIZE - 1
// bytes) may be what is left of a longer one: it is not matched, even when what is left
// reads whole. One byte shorter, the same plan matches.
func TestImagePlanCutOff(t *testing.T) {
	root, _, live := kernelBoot(t, nil, nil)
	for _, tc := range []struct {
		length  int
		matched bool
	}{{KernelKeeps, false}, {MaxCmdline, true}} {
		l := live
		pad := tc.length - len(l.Cmdline) - len(" pad=")
		l.Cmdline = "pad=" + strings.Repeat("x", pad) + " " + l.Cmdline
		if len(l.Cmdline) != tc.length {
			t.Fatalf("line of %d bytes, want %d", len(l.Cmdline), tc.length)
		}
		d := b300DecisionAt(t, root, l)
		if d.Image == nil || d.Image.Matched != tc.matched {
			t.Fatalf("%d bytes: image plan %+v, want matched %v", tc.length, d.Image, tc.matched)
		}
		if !tc.matched && !strings.Contains(strings.Join(d.Image.Differences, "; "), "may have been cut off") {
			t.Errorf("%d bytes: differences %q, want the line named as possibly cut off", tc.length, d.Image.Differences)
		}
	}
}
