// Package boot is the stage list of `passage boot`: the thin layer between the generic
// runner (package stages) and the domain packages (pci, topology, firmware, vfiobind,
// manifest, initramfs/kmod, initramfs/netboot). Each stage calls one domain function and
// translates its outcome into a stages.Result and unit statuses.
package boot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/initramfs/kmod"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
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
	// OpenNVMe opens an NVMe controller for the erase stage; nil is the kernel's
	// (erase.DeviceOpener). Tests put simulated controllers here.
	OpenNVMe erase.Opener
	// SetHostname sets the kernel's hostname (the hostname stage); nil is sethostname(2)
	// on the live root and a write of <Root>/proc/sys/kernel/hostname in a tree. Tests
	// record calls here.
	SetHostname func(name string) error
	// PublishPolicy bounds each request of the publish stage (the envelope, the nonce,
	// the attestation, the enrolment's answer); nil is netboot.DefaultPublish. Tests
	// record its waits here.
	PublishPolicy *netboot.PublishPolicy

	earlyLinks chan []string // the host stage's background link-up; see joinEarlyLinks
	tpmReady   chan tpmPrep  // the TPM opened ahead of the manifest stage; see StartTPM

	Release string
	Modules *kmod.Index
	Tree    *pci.Tree

	// mu guards what the stages hand on: a stage keeps its results only if it finished
	// within its deadline (commit), so a stage the runner abandoned can change nothing
	// that the stages after it, or the manifest, read.
	mu sync.Mutex
	// Decision is the decide stage's verdict, before anything is written.
	Decision *decision.Decision
	// ACSRun is what the acs stage did, port by port; nil unless the stage completed.
	ACSRun *apply.Report
	// Bind is what the vfio stage did; nil unless the stage completed.
	Bind *vfiobind.Report
	// EraseRun is what the erase stage did; nil unless the stage completed.
	EraseRun *erase.Report
	// Verdicts are the units' final verdicts (Decision.Conclude), from the manifest stage.
	Verdicts []decision.Verdict
	Leases   []netboot.Lease
	Manifest *manifest.Manifest
	Signed   *manifest.Signed

	// metricsText is the manifest as Prometheus metrics, for the push stage; its
	// Pushgateway instance is metricsInstance (stages/boot/metrics.go).
	metricsText     []byte
	metricsInstance string
}

// commit keeps a stage's result, unless the stage's time is up: the runner has then
// failed it (or is about to), and what it still produces must reach nobody.
func (b *Boot) commit(ctx context.Context, keep func()) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if ctx.Err() != nil {
		return false
	}
	keep()
	return true
}

// results returns what the stages committed.
func (b *Boot) results() (*decision.Decision, *apply.Report, *vfiobind.Report) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.Decision, b.ACSRun, b.Bind
}

// signed returns the signed manifest the manifest stage committed (nil without one).
func (b *Boot) signed() *manifest.Signed {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.Signed
}

// ManifestSigned says whether the manifest stage wrote a signed manifest: a boot without
// one cannot go on (its emergency action is taken whatever passage.emergency_on says).
func (b *Boot) ManifestSigned() bool { return b.signed() != nil }

// Units are the decision's units (nil before the decide stage completed).
func (b *Boot) Units() []*topology.Unit {
	d, _, _ := b.results()
	if d == nil {
		return nil
	}
	return d.Units()
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
func UnitID(id topology.UnitID) string { return id.String() }

func toStatus(s topology.Status) stages.Status {
	switch s {
	case topology.StatusFailed:
		return stages.Failed
	case topology.StatusDegraded:
		return stages.Degraded
	}
	return stages.OK
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
//
// One exception, the node's name: the hostname stage names the node just before the
// manifest signs that name. When the name can come only from DHCP option 12 (no
// passage.hostname=, none in the kernel, the network on: HostnameFromDHCP), the network
// stage runs before the hostname stage instead of after the manifest. The manifest then
// waits for the network, bounded by the network stage's own deadline
// (passage.net_timeout), and is written whatever the network did: Always, with no
// Needs; a dead network costs it that deadline and the name, never the manifest. The
// network stage's result (the lease the name came from) is then in the manifest. A
// boot whose name is given on its command line, as a fleet's iPXE script or signed image
// gives it, keeps the manifest ahead of the network.
func (b *Boot) Stages() []stages.Stage {
	c := b.Config
	list := []stages.Stage{
		{Name: "modules", Run: b.modules},
		{Name: "scan", Run: b.scan},
		{Name: "decide", Needs: []string{"scan"}, Run: b.decide},
		{Name: "acs", Needs: []string{"decide"}, Run: b.acs},
		{Name: "erase", Needs: []string{"decide", "acs"}, Timeout: c.EraseTimeout, Run: b.erase},
		{Name: "vfio", Needs: []string{"decide", "acs"}, Run: b.vfio},
		{Name: "host", Run: b.host},
	}
	network := stages.Stage{Name: "network", Timeout: c.NetTimeout, Run: b.network}
	named := []stages.Stage{
		{Name: "hostname", Run: b.hostname},
		{Name: "manifest", Always: true, Run: b.manifest},
	}
	if b.HostnameFromDHCP() {
		list = append(append(list, network), named...)
	} else {
		list = append(append(list, named...), network)
	}
	return append(list,
		stages.Stage{Name: "publish", Needs: b.publishNeeds(), Timeout: b.publishTimeout(), Run: b.publish},
		stages.Stage{Name: "push", Needs: []string{"network", "manifest"}, Timeout: c.NetTimeout, Run: b.push},
	)
}

func (b *Boot) openModules() error {
	if b.Modules != nil {
		return nil
	}
	if b.kernelRelease() == "" {
		return fmt.Errorf("kernel release: %s unreadable", b.path("proc/sys/kernel/osrelease"))
	}
	ix, err := kmod.OpenRelease(b.Root, b.Release)
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

func (b *Boot) scan(ctx context.Context, _ *stages.State, r *stages.Result) error {
	// The TPM's slow start (key creation, counter increment: the guest's TPM driver
	// polls, which costs CPU) overlaps the PCIe stages, and starts after the modules
	// stage: loading the vfio stack comes first on the boot's critical path.
	b.StartTPM()
	t, err := pci.Scan(b.Root)
	if err != nil {
		return err
	}
	if !b.commit(ctx, func() { b.Tree = t }) {
		return ctx.Err()
	}
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

// decide computes the node's decision (package decision): labels and units, ATS under
// passage.ats=, the isolation audit against the planned ACS, lockdown, the ACS targets
// and the kernel argument, every unit's verdict. It writes nothing; the stages after it
// execute it, and the manifest stage concludes.
func (b *Boot) decide(ctx context.Context, st *stages.State, r *stages.Result) error {
	p, err := topology.LoadProfile(b.Config.Profile)
	if err != nil {
		return err
	}
	policy, err := firmware.ParsePolicy(string(b.Config.ATS))
	if err != nil {
		return err
	}
	live, err := decision.ReadLive(b.Root)
	if err != nil {
		r.Degrade("%v", err)
	}
	live.Cmdline = b.Config.Cmdline
	if b.Release != "" {
		// Set by the caller: it knows better than a tree without /proc.
		live.Release = b.Release
	}
	b.mu.Lock()
	tree := b.Tree
	b.mu.Unlock()
	var erasePolicy erase.Policy // "": the decision takes the profile's default
	if b.Config.Erase != "" {
		if erasePolicy, err = erase.ParsePolicy(b.Config.Erase); err != nil {
			return err
		}
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: p, ATS: policy, Erase: erasePolicy, Live: live})
	if err != nil {
		return err
	}
	for _, pr := range d.Labels.Problems {
		r.Degrade("%s", pr)
	}
	if d.LabelErr != nil {
		r.Degrade("labelling: %s: every unit failed, nothing will be written", strings.ReplaceAll(d.LabelErr.Error(), "\n", "; "))
	}
	for _, f := range d.ATS {
		if f.Missing() {
			r.Degrade("%s", f)
		}
	}
	for _, f := range d.Audit {
		r.Findingf("%s", f)
	}
	if live.LockedDown() {
		// What it costs each unit is in the unit's verdict; ports the kernel set from
		// the command line cost nothing.
		r.Findingf("kernel lockdown %s: config writes are refused; ports are read back, not written", live.Lockdown)
	}
	if im := d.Image; im != nil {
		r.Findingf("%s", im.Summary())
		for _, diff := range im.Differences {
			r.Findingf("  %s", diff)
		}
	}
	if d.KernelArg != "" {
		r.Findingf("the plan as a kernel argument: %s", d.KernelArg)
	}
	units := d.Units()
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
	r.Findingf("profile %s: %d units", p.Name, len(units))
	if !b.commit(ctx, func() { b.Decision = d }) {
		return ctx.Err()
	}
	st.SetUnits(su)
	if d.NoUnits != "" {
		// Nothing this boot prepares is what the profile is for: the boot fails, and its
		// manifest (written all the same) says why.
		return errors.New(d.NoUnits)
	}
	return nil
}

// acs executes the decision's ACS plan (apply.ACS: write, read back, stop a unit at its
// first failure, restore isolation bits a failed write may have cost).
func (b *Boot) acs(ctx context.Context, _ *stages.State, r *stages.Result) error {
	d, _, _ := b.results()
	rep, err := d.ExecuteACS(ctx, b.configIO(), b.DryRun)
	if err != nil {
		return err
	}
	for _, c := range rep.Changes {
		line := c.String()
		switch c.Result {
		case apply.ResultApplied:
			r.Changef("%s", line)
		case apply.ResultFailed, apply.ResultMismatch, apply.ResultLockedDown, apply.ResultNoACS:
			r.Degrade("%s", line)
		default:
			r.Findingf("%s", line)
		}
	}
	for _, a := range rep.Advice {
		r.Degrade("%s", a)
	}
	if !b.commit(ctx, func() { b.ACSRun = &rep }) {
		return fmt.Errorf("acs: %w", ctx.Err())
	}
	return nil
}

// vfio binds the units the decision passes through and the acs stage left bindable.
func (b *Boot) vfio(ctx context.Context, _ *stages.State, r *stages.Result) error {
	d, acsRun, _ := b.results()
	if b.DryRun {
		return stages.Skip("dry run")
	}
	er := b.eraseResult()
	bind := d.Bindable(acsRun, er)
	in := map[topology.UnitID]bool{}
	for _, u := range bind {
		in[u.ID] = true
	}
	for _, u := range d.Units() {
		if !in[u.ID] {
			r.Findingf("unit %s: not to be bound (failed), left untouched", UnitID(u.ID))
		}
	}
	var sys vfiobind.Sysfs = vfiobind.Root(b.Root)
	if b.Sysfs != nil {
		sys = b.Sysfs
	}
	rep, err := d.ExecuteBind(ctx, sys, acsRun, er, vfiobind.Options{})
	if rep != nil {
		if rep.ModulesErr != "" {
			r.Degrade("vfio modules: %s", rep.ModulesErr)
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
			if !ur.Bound() {
				r.Degrade("unit %s: %s", UnitID(ur.ID), ur.Error)
			}
		}
	}
	if err != nil {
		return err
	}
	if !b.commit(ctx, func() { b.Bind = rep }) {
		return fmt.Errorf("vfio: %w", ctx.Err())
	}
	return nil
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
func (b *Boot) host(ctx context.Context, _ *stages.State, r *stages.Result) error {
	early := b.Config.Net != initramfs.NetOff && !b.DryRun
	if len(b.Config.HostModules) == 0 {
		if !early {
			return stages.Skip("passage.host_modules is empty")
		}
		// A built-in NIC driver still gains from the head start.
		r.Findingf("passage.host_modules is empty: no host driver to load")
	} else {
		if !b.DryRun {
			// A host driver list may hold nvme (the host's own disk): no unit's NVMe may
			// be claimed by it when it loads (guardNVMe).
			var sys vfiobind.Sysfs = vfiobind.Root(b.Root)
			if b.Sysfs != nil {
				sys = b.Sysfs
			}
			b.guardNVMe(ctx, sys, r)
		}
		if err := b.loadHostModules(r); err != nil {
			return err
		}
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
// not a unit's passthrough function nor an NVSwitch management function (Fabric
// Manager's and NVLSM's, on the NVLink management fabric), preferring those the label
// stage called mgmt-nic. notes say which netdevs were left out and why.
func (b *Boot) netIfaces() (ifs, notes []string, err error) {
	if b.Config.Net != initramfs.NetAuto {
		return []string{b.Config.Net}, nil, nil
	}
	cands, err := netboot.Candidates(b.Root)
	if err != nil {
		return nil, nil, err
	}
	pass := map[string]bool{}
	for _, u := range b.Units() {
		for _, f := range u.Functions() {
			if f != nil {
				pass[f.Addr.String()] = true
			}
		}
	}
	var out, mgmt []string
	for _, c := range cands {
		if d, _, _ := b.results(); d != nil {
			a, err := pci.ParseAddress(c.BDF)
			switch role := d.Labels.RoleOf(a); {
			case err != nil:
			case role == topology.RoleMgmtNIC:
				mgmt = append(mgmt, c.Name)
			case role == topology.RoleNVSwitchMgmt:
				notes = append(notes, fmt.Sprintf("%s (%s) is an NVSwitch management function: not used", c.Name, c.BDF))
				continue
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
			p := netboot.DefaultDHCP
			p.Waiting = r.Wait // an abandoned network stage names the carrier or reply it waited for
			return netboot.UpAny(ctx, ifs, p)
		}
	}
	leases, err := up(ctx, ifs)
	// Under the lock: the hostname stage reads them, and a network stage abandoned at its
	// deadline may still be writing.
	b.mu.Lock()
	b.Leases = leases
	b.mu.Unlock()
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

// publishNeeds is what the publish stage waits for: the manifest, and the network
// unless passage.net=off, in which case the boot brings up none and publishes only to a
// loopback passage.url (publish refuses any other, initramfs.LoopbackURL), so tests, a
// load generator and anyone checking a control plane run the boot's own publish and
// enrolment without a VM.
func (b *Boot) publishNeeds() []string {
	if b.Config.Net == initramfs.NetOff {
		return []string{"manifest"}
	}
	return []string{"network", "manifest"}
}

// publishClient is the publish stage's HTTP client: nil (http.DefaultClient) after a
// network stage; with passage.net=off one whose dialer connects only to loopback
// addresses, so "localhost" cannot resolve its way off the machine, and which takes no
// proxy from the environment.
func (b *Boot) publishClient() *http.Client {
	if b.Config.Net != initramfs.NetOff {
		return nil
	}
	d := &net.Dialer{Control: func(network, address string, _ syscall.RawConn) error {
		host, _, err := net.SplitHostPort(address)
		if err != nil {
			return fmt.Errorf("publish: dial %s: %w", address, err)
		}
		if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
			return fmt.Errorf("publish: dial %s: not a loopback address (passage.net=off)", address)
		}
		return nil
	}}
	return &http.Client{Transport: &http.Transport{DialContext: d.DialContext, TLSHandshakeTimeout: 10 * time.Second}}
}

// PublishForMaxBackoff is the longest backoff step of a publish bounded by
// passage.publish_for: a boot that may try for half an hour backs off further than one
// that has five tries (a control plane's Retry-After sets the wait when it gives one).
const PublishForMaxBackoff = 30 * time.Second

// publishTimeout is the publish stage's deadline: with passage.publish_for, its budget
// plus one try (a request begun as the budget ends may finish); without, the runner's
// (passage.stage_timeout).
func (b *Boot) publishTimeout() time.Duration {
	if b.Config.PublishFor <= 0 {
		return 0
	}
	p := b.basePublishPolicy()
	return b.Config.PublishFor + p.PerTry
}

func (b *Boot) basePublishPolicy() netboot.PublishPolicy {
	if b.PublishPolicy != nil {
		return *b.PublishPolicy
	}
	return netboot.DefaultPublish
}

// publishPolicy is what bounds each exchange of the publish stage: DefaultPublish (or
// the test's), bounded by passage.publish_for in time instead of in tries when given.
func (b *Boot) publishPolicy(r *stages.Result) netboot.PublishPolicy {
	p := b.basePublishPolicy()
	if b.Config.PublishFor > 0 {
		p.For = b.Config.PublishFor
		p.MaxBackoff = max(p.MaxBackoff, PublishForMaxBackoff)
	}
	p.Waiting = r.Wait
	p.Note = func(s string) { r.Findingf("%s", s) }
	return p
}

func (b *Boot) publish(ctx context.Context, _ *stages.State, r *stages.Result) error {
	if b.Config.URL == "" {
		return stages.Skip("passage.url not set")
	}
	if b.Config.Net == initramfs.NetOff {
		if err := initramfs.LoopbackURL(b.Config.URL); err != nil {
			return stages.Skip("%v", err)
		}
	}
	if err := initramfs.SecureURL(b.Config.URL, b.Config.URLInsecure); err != nil {
		return err
	}
	signed := b.signed()
	if signed == nil {
		return stages.Skip("no signed envelope to publish")
	}
	p := b.publishPolicy(r)
	hc := b.publishClient()
	if hc != nil {
		defer hc.CloseIdleConnections()
	}
	att, err := netboot.Publish(ctx, hc, b.Config.URL, signed.Envelope, p)
	for i, a := range att {
		r.Findingf("try %d: status %d %s", i+1, a.Status, a.Err)
	}
	if err != nil {
		return err
	}
	r.Changef("envelope %s posted to %s", signed.Digest, b.Config.URL)
	// The attestation goes with it, when the manifest stage made one: the control plane
	// verifies both from what it received. Made fresh for the control plane's nonce
	// first; the manifest stage's (over the payload digest) when that cannot be had.
	name := EnvelopeName + attest.Suffix
	path := filepath.Join(initramfs.RunDir, name)
	if _, err := ReadBeneath(b.Root, path, attest.MaxFile); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	// The TPM is opened when first needed (a quote over the control plane's nonce, an
	// enrolment's activation), not to post the manifest stage's attestation as it is, and
	// stays open from the quote to the activation: the AK that answers the challenge is
	// the one that quoted (the same template in the same TPM).
	var tpm *bootTPM
	openTPM := func() bootTPM {
		if tpm == nil {
			t := b.openTPM(r)
			tpm = &t
		}
		return *tpm
	}
	defer func() {
		if tpm != nil && tpm.closer != nil {
			tpm.closer.Close()
		}
	}()
	if err := b.attestOnline(ctx, r, hc, openTPM, signed, p); err != nil {
		// Not a degraded boot: the attestation says its nonce is the payload digest, and a
		// verifier that wants its own nonce refuses it, naming the nonce.
		r.Findingf("%s: no nonce from the control plane, the offline attestation (nonce: the payload digest) is posted: %v", name, err)
	} else {
		r.Changef("%s: quoted again over the control plane's nonce", name)
	}
	body, err := ReadBeneath(b.Root, path, attest.MaxFile)
	if err == nil {
		body, err = attest.WithEnvelope(body, signed.Envelope)
	}
	if err != nil {
		r.Degrade("%s not posted: %v", name, err)
		return nil
	}
	activate := func(record string, challenge json.RawMessage) ([]byte, []byte, error) {
		r.Findingf("enrolment: the control plane challenges this TPM for record %s", record)
		k, ok := openTPM().signer.(*tpmkey.TPM)
		if !ok {
			return nil, nil, fmt.Errorf("no TPM to activate the credential with (%v)", openTPM().err)
		}
		return attest.Answer(k.Transport(), challenge)
	}
	d, err := netboot.DeliverAttestation(ctx, hc, b.Config.URL, body, activate, p)
	for i, a := range d.Attestation {
		r.Findingf("%s try %d: status %d %s", name, i+1, a.Status, a.Err)
	}
	for i, a := range d.Activation {
		r.Findingf("activation try %d: status %d %s", i+1, a.Status, a.Err)
	}
	if err != nil {
		r.Degrade("%s not posted: %v", name, err)
		return nil
	}
	if d.Record != "" {
		r.Changef("enrolled: credential activated in the TPM, record %s", d.Record)
		r.Changef("%s posted to %s after enrolment as record %s", name, b.Config.URL, d.Record)
		return nil
	}
	r.Changef("%s posted to %s", name, b.Config.URL)
	return nil
}

// attestOnline fetches a nonce from passage.url (bounded and retried as the publish is)
// and replaces the manifest stage's attestation with one quoted over it: a verifier that
// issued the nonce knows the quote is newer than its request, which a quote over the
// payload digest cannot show (it can be shown again later).
func (b *Boot) attestOnline(ctx context.Context, r *stages.Result, hc *http.Client, openTPM func() bootTPM, signed *manifest.Signed, p netboot.PublishPolicy) error {
	nonce, atts, err := netboot.FetchNonce(ctx, hc, b.Config.URL, p)
	for i, a := range atts {
		r.Findingf("nonce try %d: status %d %s", i+1, a.Status, a.Err)
	}
	if err != nil {
		return err
	}
	tpm := openTPM()
	k, ok := tpm.signer.(*tpmkey.TPM)
	if !ok {
		return fmt.Errorf("tpm: not open for the quote (%v)", tpm.err)
	}
	dir, err := Beneath(b.Root, initramfs.RunDir)
	if err != nil {
		return err
	}
	return WriteAttestation(b.Root, k, dir, signed.Payload, nonce)
}

// Mark prints a timeline marker on the console (a no-op without one).
func (b *Boot) Mark(event string) {
	if b.Console != nil {
		emit.Mark(b.Console, b.Root, event)
	}
}
