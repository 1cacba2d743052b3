// Package boot is the stage list of `passage boot`: the thin layer between the generic
// runner (package stages) and the domain packages (pci, topology, firmware, vfiobind,
// manifest, initramfs/kmod, initramfs/netboot). Each stage calls one domain function and
// translates its outcome into a stages.Result and unit statuses.
package boot

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/initramfs/kmod"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// Boot is one boot's inputs and the domain data the stages hand each other.
type Boot struct {
	Root    string // "/" on the node; every path below is taken under it
	Config  initramfs.Config
	DryRun  bool      // read and report, write nothing to sysfs, load no module, touch no NIC
	Console io.Writer // timeline markers
	Now     func() time.Time
	// Config space access for the ACS stage and the isolation audit; nil is
	// <Root>/sys/bus/pci/devices/<bdf>/config. Tests inject faults here.
	ConfigIO pci.ConfigIO
	// Sysfs is what vfio binding writes; nil is vfiobind.Root(Root). Tests put a
	// simulated kernel here.
	Sysfs vfiobind.Sysfs
	// OpenTPM opens the TPM for signing, measuring and the generation counter; nil is
	// tpmkey.ForBoot. The returned value may also be a manifest.Counter and an io.Closer.
	OpenTPM func(root string) (manifest.Signer, manifest.Measurer, error)
	// Mount mounts a block device for passage.out; nil uses the kernel (u-root's TryMount).
	Mount func(dev, dir string) (unmount func() error, err error)
	// LinkUp sets a network interface up without waiting for carrier (the host stage's
	// head start for the network stage); nil is netboot.LinkUp. Tests record calls here.
	LinkUp func(iface string) error
	// NetUp brings the network stage's interfaces up and leases addresses; nil is
	// netboot.UpAny with netboot.DefaultDHCP. Tests put a fake DHCP exchange here.
	NetUp func(ctx context.Context, ifaces []string) ([]netboot.Lease, error)

	earlyLinks chan []string // the host stage's background link-up; see joinEarlyLinks
	tpmReady   chan tpmPrep  // the TPM opened ahead of the manifest stage; see StartTPM

	Release  string
	Modules  *kmod.Index
	Tree     *pci.Tree
	Profile  *topology.Profile
	Labels   *topology.Labels
	Units    []*topology.Unit
	ATS      []firmware.Finding
	ACSPlan  []topology.ACSPort           // after DropDT
	ACSRun   *apply.Report                // what the acs stage did, port by port
	ACS      map[int][]manifest.ACSChange // by unit
	Bind     *vfiobind.Report
	Leases   []netboot.Lease
	Manifest *manifest.Manifest
	Signed   *manifest.Signed
}

func (b *Boot) path(p string) string { return filepath.Join(b.Root, p) }

func (b *Boot) configIO() pci.ConfigIO {
	if b.ConfigIO != nil {
		return b.ConfigIO
	}
	return pci.SysfsConfig{Root: b.Root}
}

// kernelRelease is the running kernel's release, "" when /proc does not say (a synthetic
// tree): it only sharpens advice.
func (b *Boot) kernelRelease() string {
	if b.Release == "" {
		if rel, err := os.ReadFile(b.path("proc/sys/kernel/osrelease")); err == nil {
			b.Release = strings.TrimSpace(string(rel))
		}
	}
	return b.Release
}

func (b *Boot) now() time.Time {
	if b.Now != nil {
		return b.Now()
	}
	return time.Now()
}

// RunDir is where this boot's results go: <root>/run/passage.
func (b *Boot) RunDir() string { return b.path(initramfs.RunDir) }

// UnitID names a topology unit in the runner's state, the console table and the manifest.
func UnitID(id int) string { return fmt.Sprintf("gpu%d", id) }

func toStatus(s topology.Status) stages.Status {
	switch s {
	case topology.StatusFailed:
		return stages.Failed
	case topology.StatusDegraded:
		return stages.Degraded
	}
	return stages.OK
}

// syncUnits copies the topology units' statuses and reasons (which the domain packages
// update in place) into the runner's state, where status only worsens.
func (b *Boot) syncUnits(st *stages.State, stage string) {
	seen := map[string]int{}
	for _, u := range st.Units() {
		seen[u.ID] = len(u.Reasons)
	}
	for _, u := range b.Units {
		id := UnitID(u.ID)
		// Reasons the state already holds are not added twice.
		var newReasons []string
		if n := seen[id]; n < len(u.Reasons) {
			newReasons = u.Reasons[n:]
		}
		for _, r := range newReasons {
			st.Mark(id, toStatus(u.Status), r)
		}
		if len(newReasons) == 0 {
			st.Mark(id, toStatus(u.Status), "")
		}
	}
}

// Stages returns the boot's stage list. The handoff is not a stage: it never returns, so
// cmd/passage/boot.go does it after the report.
//
// The manifest comes before network and publish. It is the signed statement of how the
// node's PCIe was prepared, and nothing the network stage produces (a DHCP lease) is
// something the hypervisor trusts or uses to build guests; the envelope has to be signed
// before publish anyway. Written first, it cannot be delayed or endangered by a slow or
// dead management network (carrier timeout, up to 2 x 7 s of DHCP retries,
// passage.net_timeout). network and publish are the delivery phase: their results go to
// the console and log.jsonl, as every stage's do, not into the manifest.
func (b *Boot) Stages() []stages.Stage {
	c := b.Config
	return []stages.Stage{
		{Name: "modules", Run: b.modules},
		{Name: "scan", Run: b.scan},
		{Name: "label", Needs: []string{"scan"}, Run: b.label},
		{Name: "firmware", Needs: []string{"label"}, Run: b.firmware},
		{Name: "acs", Needs: []string{"label"}, Run: b.acs},
		{Name: "vfio", Needs: []string{"label"}, Run: b.vfio},
		{Name: "host", Run: b.host},
		{Name: "manifest", Always: true, Run: b.manifest},
		{Name: "network", Timeout: c.NetTimeout, Run: b.network},
		{Name: "publish", Needs: []string{"network", "manifest"}, Run: b.publish},
	}
}

func (b *Boot) openModules() error {
	if b.Modules != nil {
		return nil
	}
	if b.kernelRelease() == "" {
		return fmt.Errorf("kernel release: %s unreadable", b.path("proc/sys/kernel/osrelease"))
	}
	ix, err := kmod.Open(b.path(filepath.Join("lib/modules", b.Release)))
	if err != nil {
		return err
	}
	b.Modules = ix
	return nil
}

// loadModules loads names one at a time so one missing module does not hide the others.
func (b *Boot) loadModules(r *stages.Result, names []string) (failed []string) {
	if b.DryRun {
		order, err := b.Modules.Order(names...)
		if err != nil {
			r.Findingf("order %v: %v", names, err)
			return names
		}
		r.Findingf("dry run: would load %s", strings.Join(order, " "))
		return nil
	}
	reported := map[string]bool{}
	for _, n := range names {
		res, err := b.Modules.Load(n)
		for _, m := range res {
			// A dependency shared by several names comes back from each Load: say it once.
			if reported[m.Name] {
				continue
			}
			reported[m.Name] = true
			switch {
			case m.Err != nil:
				r.Findingf("module %s: %v", m.Name, m.Err)
			case m.AlreadyLoaded:
				r.Findingf("module %s: already loaded or built in", m.Name)
			default:
				r.Changef("module %s loaded (%s)", m.Name, m.Duration.Round(time.Microsecond))
			}
		}
		if err != nil {
			r.Findingf("module %s: %v", n, err)
			failed = append(failed, n)
		}
	}
	return failed
}

// modules loads the vfio stack before anything can bind a passthrough device to a host
// driver: a device that a host driver claims first must be unbound again, and some
// (NVMe with a mounted namespace) cannot be.
func (b *Boot) modules(_ context.Context, _ *stages.State, r *stages.Result) error {
	if err := b.openModules(); err != nil {
		return err
	}
	if failed := b.loadModules(r, vfiobind.Modules); len(failed) > 0 {
		return fmt.Errorf("vfio stack: %s did not load", strings.Join(failed, ", "))
	}
	return nil
}

func (b *Boot) scan(_ context.Context, _ *stages.State, r *stages.Result) error {
	t, err := pci.Scan(b.Root)
	if err != nil {
		return err
	}
	b.Tree = t
	r.Findingf("%d functions", len(t.Devices))
	for _, p := range t.Problems {
		r.Degrade("%s", p)
	}
	for _, d := range t.Devices {
		for _, p := range d.Problems {
			r.Degrade("%s: %s", d.Addr, p)
		}
	}
	return nil
}

func (b *Boot) label(_ context.Context, st *stages.State, r *stages.Result) error {
	p, err := topology.LoadProfile(b.Config.Profile)
	if err != nil {
		return err
	}
	b.Profile = p
	l, err := topology.Label(b.Tree, p)
	if err != nil {
		return err
	}
	b.Labels, b.Units = l, l.Units
	units := l.Units
	for _, pr := range l.Problems {
		r.Degrade("%s", pr)
	}
	su := make([]stages.Unit, 0, len(units))
	for _, u := range units {
		x := stages.Unit{ID: UnitID(u.ID), Status: toStatus(u.Status), Reasons: append([]string(nil), u.Reasons...)}
		if u.GPU != nil {
			x.GPU = u.GPU.Addr.String()
		}
		for _, n := range u.NICs {
			x.NICs = append(x.NICs, n.Addr.String())
		}
		for _, f := range u.Functions() {
			if f != nil {
				x.Members = append(x.Members, f.Addr.String())
			}
		}
		su = append(su, x)
	}
	st.SetUnits(su)
	r.Findingf("profile %s: %d units", p.Name, len(units))
	if len(units) == 0 {
		r.Degrade("no GPU units found")
	}
	return nil
}

func (b *Boot) firmware(_ context.Context, st *stages.State, r *stages.Result) error {
	policy, err := firmware.ParsePolicy(string(b.Config.ATS))
	if err != nil {
		return err
	}
	b.ATS = firmware.CheckATS(b.Units, policy)
	for _, f := range b.ATS {
		if f.Missing() {
			r.Degrade("%s", f)
		}
	}
	b.syncUnits(st, "firmware")
	return nil
}

// acs plans ACS Control for every unit's ports (topology.ACSPlan, which fails a unit with
// a port lacking ACS), drops DT where a unit's NIC lacks ATS (firmware.DropDT), and has
// apply.ACS write and read back each port. apply lowers the units it cannot finish and
// gives the lockdown advice (pci=config_acs=, with the kernel version that has it).
func (b *Boot) acs(ctx context.Context, st *stages.State, r *stages.Result) error {
	// ACSPlan degrades units in place: it runs once per boot.
	b.ACSPlan = firmware.DropDT(topology.ACSPlan(b.Units), b.ATS)
	rep, err := apply.ACS(ctx, b.ACSPlan, b.Units, apply.Options{
		IO: b.configIO(), Cmdline: b.Config.Cmdline, KernelRelease: b.kernelRelease(), DryRun: b.DryRun,
	})
	if err != nil {
		return err
	}
	b.ACSRun = &rep
	b.ACS = map[int][]manifest.ACSChange{}
	for _, c := range rep.Changes {
		mc := acsChange(c)
		b.ACS[c.Unit] = append(b.ACS[c.Unit], mc)
		line := fmt.Sprintf("acs %s (unit %s, %s): ACSCtl %#04x -> %#04x, reads %#04x: %s",
			c.Addr, UnitID(c.Unit), c.Position, uint16(c.Before), uint16(c.Target), uint16(c.After), mc.Result)
		switch c.Result {
		case apply.ResultWritten:
			r.Changef("%s", line)
		case apply.ResultFailed, apply.ResultLockedDown, apply.ResultNoACS:
			r.Degrade("%s", line)
		default:
			r.Findingf("%s", line)
		}
	}
	for _, a := range rep.Advice {
		r.Degrade("%s", a)
	}
	if rep.ConfigACS != "" {
		r.Findingf("the plan as a kernel argument: %s", rep.ConfigACS)
	}
	b.syncUnits(st, "acs")
	return nil
}

// acsChange is apply's record of one port in the manifest's words (SCHEMA.md: result is
// applied, unchanged, mismatch or failed: ...).
func acsChange(c apply.Change) manifest.ACSChange {
	mc := manifest.ACSChange{Port: c.Addr.String(), Target: c.Target.Lspci()}
	read := c.Offset != 0 && c.Result != apply.ResultSkipped
	if read {
		mc.Before, mc.After = c.Before.Lspci(), c.After.Lspci()
	}
	switch c.Result {
	case apply.ResultWritten:
		mc.Result = "applied"
	case apply.ResultAlreadySet:
		mc.Result = "unchanged"
	case apply.ResultVerified:
		mc.Result = "unchanged: applied by the kernel (pci=config_acs=)"
	case apply.ResultDryRun:
		mc.Result = "unchanged: dry run"
	case apply.ResultSkipped:
		mc.Result = "unchanged: unit failed before the acs stage"
	case apply.ResultNoACS:
		mc.Result = "failed: no ACS capability"
	case apply.ResultLockedDown:
		mc.Result = "failed: locked down: " + c.Error
	case apply.ResultFailed:
		if c.After != c.Target && c.Error != "" && strings.Contains(c.Error, "reads back") {
			mc.Result = "mismatch: " + c.Error
		} else {
			mc.Result = "failed: " + c.Error
		}
	default:
		mc.Result = string(c.Result)
	}
	if c.Note != "" {
		mc.Result += " (" + c.Note + ")"
	}
	return mc
}

func (b *Boot) vfio(ctx context.Context, st *stages.State, r *stages.Result) error {
	if b.DryRun {
		for _, f := range vfiobind.AuditLive(b.Tree, b.Units, b.configIO()) {
			r.Findingf("%s", f)
		}
		return stages.Skip("dry run")
	}
	// Every unit goes to Bind: it binds none of a failed unit's functions, and its audit
	// still says what else is wrong with it (a group shared with a host device).
	units := b.Units
	for _, u := range units {
		if u.Status == topology.StatusFailed {
			r.Findingf("unit %s: failed before binding, left untouched", UnitID(u.ID))
		}
	}
	// The tree was scanned before the acs stage wrote the ports: the audit reads their
	// ACS Control as it is now.
	var sys vfiobind.Sysfs = vfiobind.Root(b.Root)
	if b.Sysfs != nil {
		sys = b.Sysfs
	}
	rep, err := vfiobind.Bind(ctx, sys, b.Tree, units, vfiobind.Options{Config: b.configIO()})
	b.Bind = rep
	if rep != nil {
		if rep.ModulesErr != "" {
			r.Degrade("vfio modules: %s", rep.ModulesErr)
		}
		for _, f := range rep.Findings {
			r.Findingf("%s", f)
		}
		for _, ur := range rep.Units {
			for _, f := range ur.Functions {
				if f.DriverAfter != f.DriverBefore {
					r.Changef("%s: %s -> %s (group %d)", f.Addr, orNone(f.DriverBefore), f.DriverAfter, f.Group)
				}
				if f.Err != "" {
					r.Findingf("%s: %s", f.Addr, f.Err)
				}
			}
		}
	}
	b.syncUnits(st, "vfio")
	return err
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

// host loads the drivers of host-kept devices (management NIC, NVSwitch management) only
// now, after every passthrough function sits on vfio-pci, so none can claim one. Then it
// sets the network stage's links up (linkUpEarly).
func (b *Boot) host(_ context.Context, _ *stages.State, r *stages.Result) error {
	early := b.Config.Net != initramfs.NetOff && !b.DryRun
	if len(b.Config.HostModules) == 0 {
		if !early {
			return stages.Skip("passage.host_modules is empty")
		}
		// A built-in NIC driver still gains from the head start.
		r.Findingf("passage.host_modules is empty: no host driver to load")
	} else if err := b.loadHostModules(r); err != nil {
		return err
	}
	if early {
		b.linkUpEarly(r)
	}
	return nil
}

func (b *Boot) loadHostModules(r *stages.Result) error {
	if err := b.openModules(); err != nil {
		return err
	}
	var missing []string
	for _, n := range b.Config.HostModules {
		if b.Modules.Module(n) == nil && !b.Modules.Builtin(n) {
			missing = append(missing, n)
		}
	}
	for _, n := range missing {
		r.Findingf("module %s: not in the image", n)
	}
	var present []string
	for _, n := range b.Config.HostModules {
		if !contains(missing, n) {
			present = append(present, n)
		}
	}
	if len(present) == 0 {
		return fmt.Errorf("none of the host drivers %v is in the image", b.Config.HostModules)
	}
	if failed := b.loadModules(r, present); len(failed) > 0 {
		r.Degrade("host drivers not loaded: %s", strings.Join(failed, ", "))
	}
	return nil
}

// linkUpEarly starts setting the network stage's interfaces up, in the background and
// without waiting for carrier: the driver's open (rings, PHY reset) and the PHY's
// negotiation (about 2 s for an e1000e) run while the manifest is built and signed
// instead of in front of it or in the network stage's wait. The network stage joins it
// (joinEarlyLinks) and reports how each went; it sets the links up again and waits, so
// this is only a head start and its failure only a finding.
func (b *Boot) linkUpEarly(r *stages.Result) {
	ifs, _, err := b.netIfaces()
	if err != nil {
		r.Findingf("early link-up: %v", err)
		return
	}
	if len(ifs) == 0 {
		r.Findingf("early link-up: no network interface yet")
		return
	}
	up := b.LinkUp
	if up == nil {
		up = netboot.LinkUp
	}
	done := make(chan []string, 1)
	b.earlyLinks = done
	go func() {
		var out []string
		for _, n := range ifs {
			start := time.Now()
			if err := up(n); err != nil {
				out = append(out, fmt.Sprintf("early link-up %s: %v", n, err))
				continue
			}
			out = append(out, fmt.Sprintf("early link-up %s: up in %s, in the background from the host stage", n, time.Since(start).Round(time.Microsecond)))
		}
		done <- out
	}()
	r.Changef("link-up of %s started in the background (the network stage reports it)", strings.Join(ifs, ", "))
}

// joinEarlyLinks waits for the host stage's early link-up, if it started one, and makes
// its outcome findings of the network stage.
func (b *Boot) joinEarlyLinks(ctx context.Context, r *stages.Result) {
	if b.earlyLinks == nil {
		return
	}
	select {
	case lines := <-b.earlyLinks:
		for _, l := range lines {
			r.Findingf("%s", l)
		}
	case <-ctx.Done():
		r.Findingf("early link-up: still running when the network stage's time ran out")
	}
	b.earlyLinks = nil
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// netIfaces picks the interfaces for passage.net=auto: every PCI-backed netdev that is
// not a unit's passthrough function, preferring those the label stage called mgmt-nic.
// notes say which netdevs were left out and why.
func (b *Boot) netIfaces() (ifs, notes []string, err error) {
	if b.Config.Net != initramfs.NetAuto {
		return []string{b.Config.Net}, nil, nil
	}
	cands, err := netboot.Candidates(b.Root)
	if err != nil {
		return nil, nil, err
	}
	pass := map[string]bool{}
	for _, u := range b.Units {
		for _, f := range u.Functions() {
			if f != nil {
				pass[f.Addr.String()] = true
			}
		}
	}
	var out, mgmt []string
	for _, c := range cands {
		if b.Labels != nil {
			if a, err := pci.ParseAddress(c.BDF); err == nil && b.Labels.RoleOf(a) == topology.RoleMgmtNIC {
				mgmt = append(mgmt, c.Name)
			}
		}
		if pass[c.BDF] {
			notes = append(notes, fmt.Sprintf("%s (%s) is a passthrough function: not used", c.Name, c.BDF))
			continue
		}
		out = append(out, c.Name)
	}
	if len(mgmt) > 0 {
		return mgmt, notes, nil
	}
	return out, notes, nil
}

func (b *Boot) network(ctx context.Context, _ *stages.State, r *stages.Result) error {
	if b.Config.Net == initramfs.NetOff {
		return stages.Skip("passage.net=off")
	}
	ifs, notes, err := b.netIfaces()
	for _, n := range notes {
		r.Findingf("%s", n)
	}
	if err != nil {
		return err
	}
	if b.DryRun {
		r.Findingf("dry run: would bring up %v", ifs)
		return stages.Skip("dry run")
	}
	b.joinEarlyLinks(ctx, r)
	up := b.NetUp
	if up == nil {
		up = func(ctx context.Context, ifs []string) ([]netboot.Lease, error) {
			return netboot.UpAny(ctx, ifs, netboot.DefaultDHCP)
		}
	}
	leases, err := up(ctx, ifs)
	b.Leases = leases
	for _, l := range leases {
		r.Changef("%s", l.Describe())
	}
	if len(leases) == 0 {
		return err
	}
	if err != nil {
		r.Findingf("%v", err)
	}
	return nil
}

func (b *Boot) publish(ctx context.Context, _ *stages.State, r *stages.Result) error {
	if b.Config.URL == "" {
		return stages.Skip("passage.url not set")
	}
	if b.Signed == nil {
		return stages.Skip("no signed envelope to publish")
	}
	att, err := netboot.Publish(ctx, nil, b.Config.URL, b.Signed.Envelope, netboot.DefaultPublish)
	for i, a := range att {
		r.Findingf("try %d: status %d %s", i+1, a.Status, a.Err)
	}
	if err != nil {
		return err
	}
	r.Changef("envelope %s posted to %s", b.Signed.Digest, b.Config.URL)
	return nil
}

// Mark prints a timeline marker on the console (a no-op without one).
func (b *Boot) Mark(event string) {
	if b.Console != nil {
		emit.Mark(b.Console, b.Root, event)
	}
}
