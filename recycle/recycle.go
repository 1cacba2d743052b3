// Package recycle hands a unit from one tenant to the next on a running host, between
// two VMs, without a reboot: it refuses while anything holds the unit's
// /dev/vfio/<group> or a function's /dev/vfio/devices/vfioN open, and without a
// generation counter; it records the unit as not ready in a new signed manifest
// generation, releases it from vfio-pci, erases its NVMe and resets its functions
// (package erase), binds it back, and records the verdict (package decision) in a
// further generation. A crash midway leaves the unit off vfio-pci with the last
// generation saying it is not ready; never ready with data on it.
package recycle

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/record"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// EnvelopeName is the manifest file recycle replaces, the one the boot wrote.
const EnvelopeName = "manifest.dsse.json"

// Options say what to recycle and how to record it.
type Options struct {
	Root    string // "/" on a node
	Profile string
	Units   []topology.UnitID
	Policy  erase.Policy // "" is require
	// Dir is where the manifest is replaced (the boot's /run/passage).
	Dir string
	// Signers sign each generation; Verifier checks the previous manifest before its
	// other units are carried into the new one.
	Signers  []manifest.Signer
	Verifier manifest.Verifier
	Measurer manifest.Measurer
	// Attest, when set, attests each generation once it is signed and measured (quote over
	// PCR 13 ending in it: stages/boot.WriteAttestation), so a verifier's verify --attest
	// takes the newest manifest without anyone quoting by hand. Without it (no TPM) any
	// earlier attestation beside the manifest is removed: it would be of an older one.
	// It is called with the generation lock held (Recorder.AttestHeld, not Attest).
	Attest func(dir string, signed *manifest.Signed) error
	// Counters give the generation, first that answers (manifest.NextGeneration).
	Counters []manifest.Counter
	// Sysfs and Open default to the kernel under Root; tests simulate both.
	Sysfs vfiobind.Sysfs
	Open  erase.Opener
	// Writes, when set, is held around each generation's write, from reading the
	// previous manifest to the attestation: recycles of other units running at once (the
	// DRA plugin's turnaround) share the counter, the envelope and PCR 13, and a
	// generation written from a manifest read before another's write would carry that
	// unit's old verdict forward.
	Writes sync.Locker
	// Who names this writer in the node's generation lock (manifest.LockGenerations),
	// which every generation's write holds, Writes or not: other processes (passage
	// recycle, unbind, the plugin) share the counter, the event log and PCR 13 too.
	// "" is "recycle". LockWait bounds the wait for it (0: manifest.DefaultLockWait).
	Who      string
	LockWait time.Duration
	// Crash, when set, is called between steps with the step's name; a non-nil error
	// stops the run there, as a crash would (tests).
	Crash func(step string) error
	Log   io.Writer
	Erase erase.RunOptions
	// Tick is how often a running erase is shown on Log (a sanitize can take hours);
	// 0 is 10 s.
	Tick time.Duration
}

// erase runs the erase, saying on Log every Tick which NVMe is at which step (with the
// controller's SPROG while it sanitizes).
func (o *Options) erase(ctx context.Context, sys vfiobind.Sysfs, labels *topology.Labels, units []*topology.Unit, open erase.Opener) *erase.Report {
	ro := o.Erase
	if o.Log == nil {
		return erase.Run(ctx, sys, labels, units, open, ro)
	}
	if ro.Progress == nil {
		ro.Progress = &erase.Progress{}
	}
	every := o.Tick
	if every <= 0 {
		every = 10 * time.Second
	}
	start := time.Now()
	stop := make(chan struct{})
	shown := make(chan struct{})
	go func() {
		defer close(shown)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				if p := ro.Progress.String(); p != "" {
					o.logf("erasing (%s): %s", time.Since(start).Round(time.Second), p)
				}
			}
		}
	}()
	rep := erase.Run(ctx, sys, labels, units, open, ro)
	close(stop)
	<-shown
	return rep
}

// Result is what a recycle did.
type Result struct {
	Verdicts  []decision.Verdict // the recycled units'
	Erase     *erase.Report
	Bind      *vfiobind.Report
	InFlight  uint64 // the generation that marked the units not ready
	Final     uint64 // the generation with the verdicts
	Signed    *manifest.Signed
	Manifest  *manifest.Manifest
	Refusal   []Holder
	Decision  *decision.Decision
	Completed bool
	// Unattested says why the final generation has no attestation beside it although one
	// was asked for (Options.Attest): nil when it has, or when none was asked for.
	Unattested error
}

// ErrHeld is returned when a unit's group or device cdev is open: nothing was written.
var ErrHeld = errors.New("a unit's vfio group or device is held open")

func (o *Options) logf(format string, a ...any) {
	if o.Log != nil {
		fmt.Fprintf(o.Log, format+"\n", a...)
	}
}

// ErrNoCounter is returned when no generation counter is given: nothing was written. A
// generation of 0 (source none) is below any --min-generation a hypervisor holds, so it
// would never see the not-ready generation, and would keep trusting the last ready one
// while the unit is erased.
var ErrNoCounter = errors.New("no generation counter (a TPM NV counter, or a generation file the operator names)")

// Run recycles the units. The error is for what stopped it; Result says how far it got.
func Run(ctx context.Context, o Options) (*Result, error) {
	if len(o.Counters) == 0 {
		return &Result{}, ErrNoCounter
	}
	if o.Policy == "" {
		o.Policy = erase.PolicyRequire
	}
	if o.Root == "" {
		o.Root = "/"
	}
	res := &Result{}
	tree, live, d, err := o.decide()
	if err != nil {
		return res, err
	}
	res.Decision = d
	var units []*topology.Unit
	var groups []int
	var fns []*pci.Device
	for _, id := range o.Units {
		u := d.Labels.Unit(id)
		if u == nil {
			return res, fmt.Errorf("unit %s: no such unit on this node", id)
		}
		units = append(units, u)
		for _, f := range u.Functions() {
			if f != nil {
				groups = append(groups, f.IOMMUGroup)
				fns = append(fns, f)
			}
		}
	}
	hs, herr := Holders(o.Root, groups, fns)
	if len(hs) > 0 {
		res.Refusal = hs
		return res, fmt.Errorf("%w: %s", ErrHeld, hs[0])
	}
	if herr != nil {
		return res, fmt.Errorf("cannot tell whether the unit's vfio group is in use: %w", herr)
	}

	var sys vfiobind.Sysfs = vfiobind.Root(o.Root)
	if o.Sysfs != nil {
		sys = o.Sysfs
	}
	open := o.Open
	if open == nil {
		open = erase.DeviceOpener(o.Root, 30*time.Second)
	}

	// 1. Not ready, signed, before anything is touched.
	pending := map[topology.UnitID]decision.Verdict{}
	for _, v := range d.Unvouched(o.Units, "recycle: in progress: released for erase and reset; not ready until a later generation says so") {
		pending[v.Unit] = v
	}
	m, _, _, err := o.write(ctx, o.units(d, pending, nil, nil, nil))
	if err != nil {
		return res, fmt.Errorf("recycle: the not-ready generation: %w", err)
	}
	res.InFlight = m.Generation
	o.logf("generation %d: %s not ready (recycle in progress)", m.Generation, ids(units))
	if err := o.step("released"); err != nil {
		return res, err
	}
	// Again, now that the signed generation says not ready: a VM started in between
	// holds the group, and unbinding vfio-pci under it would block until it let go.
	if hs, err := Holders(o.Root, groups, fns); len(hs) > 0 || err != nil {
		res.Refusal = hs
		if err == nil {
			err = fmt.Errorf("%w: %s", ErrHeld, hs[0])
		}
		return res, fmt.Errorf("recycle: left not ready, nothing released: %w", err)
	}

	// 2. Off vfio-pci.
	for _, u := range units {
		for _, f := range u.Functions() {
			if f == nil {
				continue
			}
			fr, err := vfiobind.Park(ctx, sys, f.Addr, vfiobind.VFIODriver, o.Erase.Bind)
			if err != nil {
				return res, fmt.Errorf("release %s: %w", f.Addr, err)
			}
			o.logf("%s: %s -> (none)", f.Addr, fr.DriverBefore)
		}
	}
	if err := o.step("erase"); err != nil {
		return res, err
	}

	// 3. Erase and reset; 4. ACS as decided (unchanged unless someone changed it); 5. bind.
	if o.Open == nil {
		if err := nvmeDriver(o.Root, live.Release); err != nil {
			// Each NVMe's erase then says it did not reach the nvme driver.
			o.logf("%v", err)
		}
	}
	res.Erase = o.erase(ctx, sys, d.Labels, units, open)
	if err := o.step("bind"); err != nil {
		return res, err
	}
	acsRep, aerr := d.ExecuteACS(ctx, pci.SysfsConfig{Root: o.Root}, false)
	var acs *apply.Report
	if aerr == nil {
		acs = &acsRep
	}
	var bindUnits []*topology.Unit
	for _, u := range d.Bindable(acs, res.Erase) {
		if slices.Contains(o.Units, u.ID) {
			bindUnits = append(bindUnits, u)
		}
	}
	bind, berr := vfiobind.Bind(ctx, sys, tree, bindUnits, o.Erase.Bind)
	res.Bind = bind
	all := d.Conclude(decision.Execution{ACS: acs, ACSErr: aerr, Binding: true, Bind: bind, BindErr: berr, Erase: res.Erase})
	final := map[topology.UnitID]decision.Verdict{}
	for _, v := range all {
		if slices.Contains(o.Units, v.Unit) {
			final[v.Unit] = v
			res.Verdicts = append(res.Verdicts, v)
		}
	}
	m, signed, unattested, err := o.write(ctx, o.units(d, final, res.Erase, acs, bind))
	if err != nil {
		return res, fmt.Errorf("recycle: the final generation: %w", err)
	}
	res.Final, res.Signed, res.Manifest, res.Completed = m.Generation, signed, m, true
	res.Unattested = unattested
	o.logf("generation %d: %s", m.Generation, verdictLine(res.Verdicts))
	return res, nil
}

// Withdraw is unbind's half of a recycle: before functions are handed back to host
// drivers, it refuses while anything holds the groups or device cdevs of the units that
// hold any of addrs (ErrHeld), then writes a signed generation in which those units are
// failed with reason, every other unit carried from the previous manifest: the last
// signed word on the node never says ready for a unit off vfio-pci. It returns that
// generation's manifest and, as Result.Unattested does, why it has no attestation
// although one was asked for (Options.Attest); nothing is released here.
func Withdraw(ctx context.Context, o Options, addrs []pci.Address, reason string) (m *manifest.Manifest, unattested, err error) {
	if len(o.Counters) == 0 {
		return nil, nil, ErrNoCounter
	}
	if o.Root == "" {
		o.Root = "/"
	}
	tree, _, d, err := o.decide()
	if err != nil {
		return nil, nil, err
	}
	want := map[pci.Address]bool{}
	for _, a := range addrs {
		want[a] = true
	}
	var ids []topology.UnitID
	var groups []int
	var fns []*pci.Device
	for _, u := range d.Units() {
		var mine bool
		for _, f := range u.Functions() {
			mine = mine || (f != nil && want[f.Addr])
		}
		if !mine {
			continue
		}
		ids = append(ids, u.ID)
		for _, f := range u.Functions() {
			if f != nil {
				groups = append(groups, f.IOMMUGroup)
				fns = append(fns, f)
			}
		}
	}
	for _, a := range addrs {
		if f := tree.Lookup(a); f != nil {
			groups = append(groups, f.IOMMUGroup)
			fns = append(fns, f)
		}
	}
	hs, herr := Holders(o.Root, groups, fns)
	if len(hs) > 0 {
		return nil, nil, fmt.Errorf("%w: %s", ErrHeld, hs[0])
	}
	if herr != nil {
		return nil, nil, fmt.Errorf("cannot tell whether the unit's vfio group or device is in use: %w", herr)
	}
	if len(ids) == 0 {
		return nil, nil, nil // no unit's function: nothing a manifest vouches for
	}
	pending := map[topology.UnitID]decision.Verdict{}
	for _, v := range d.Unvouched(ids, reason) {
		pending[v.Unit] = v
	}
	m, _, unattested, err = o.write(ctx, o.units(d, pending, nil, nil, nil))
	return m, unattested, err
}

// decide scans the node and decides on it as the boot did (decision.Decide).
func (o *Options) decide() (*pci.Tree, decision.Live, *decision.Decision, error) {
	tree, err := pci.Scan(o.Root)
	if err != nil {
		return nil, decision.Live{}, nil, err
	}
	prof, err := topology.LoadProfile(o.Profile)
	if err != nil {
		return nil, decision.Live{}, nil, err
	}
	live, lerr := decision.ReadLive(o.Root)
	if lerr != nil {
		o.logf("kernel state: %v", lerr)
	}
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: prof, Erase: o.Policy, Live: live, For: decision.CommandRecycle})
	return tree, live, d, err
}

func (o *Options) step(name string) error {
	if o.Crash != nil {
		return o.Crash(name)
	}
	return nil
}

func ids(us []*topology.Unit) string {
	s := ""
	for i, u := range us {
		if i > 0 {
			s += ", "
		}
		s += u.ID.String()
	}
	return s
}

func verdictLine(vs []decision.Verdict) string {
	s := ""
	for i, v := range vs {
		if i > 0 {
			s += ", "
		}
		s += v.Unit.String() + " " + string(v.Status)
	}
	return s
}

// previous is the last manifest in Dir, verified, or nil (its units are then not carried
// and say so).
func (o *Options) previous() *manifest.Manifest {
	if o.Verifier == nil {
		return nil
	}
	env, err := manifest.ReadEnvelope(filepath.Join(o.Dir, EnvelopeName))
	if err != nil {
		o.logf("previous manifest: %v", err)
		return nil
	}
	v, err := manifest.Verify(env, o.Verifier, manifest.VerifyOptions{})
	if err != nil {
		o.logf("previous manifest: %v", err)
		return nil
	}
	return v.Manifest
}

// write builds, signs and writes one generation, read under Writes: what content puts
// in it (the units, given the previous manifest, verified, or nil), over what every
// generation of the same boot carries from the previous one (its profile, guest plan,
// stages, the kubelet's key and the hostname). A content that returns an error stops it
// before a generation is taken: nothing is written. unattested says why the generation
// has no attestation although one was asked for (attest).
func (o *Options) write(ctx context.Context, content func(m, prev *manifest.Manifest) error) (m *manifest.Manifest, signed *manifest.Signed, unattested, err error) {
	if o.Writes != nil {
		o.Writes.Lock()
		defer o.Writes.Unlock()
	}
	// After Writes: this process's writers queue in Go, only one of them in flock.
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, nil, nil, err
	}
	who := o.Who
	if who == "" {
		who = "recycle"
	}
	lock, err := manifest.LockGenerations(ctx, o.Dir, who, o.LockWait)
	if err != nil {
		return nil, nil, nil, err
	}
	defer lock.Unlock()
	prev := o.previous()
	m, err = manifest.Build(o.Root, time.Now())
	if err != nil {
		return nil, nil, nil, err
	}
	if prev != nil {
		m.Profile = prev.Profile
		m.GuestPlan = prev.GuestPlan
		m.Stages = prev.Stages
		// The kubelet's key is the boot's (initramfs/kubelet): every generation of the
		// same boot signs it again, so the record's verified key stays the one the
		// kubelet holds. Another boot's key is not carried.
		if prev.BootID == m.BootID {
			m.Node.KubeletKey = prev.Node.KubeletKey
			// The node is the one the boot named: its record (passage-control's
			// PassageNode) is the hostname the boot had. The hostname read now is the
			// reader's UTS namespace's (proc/sys/kernel/hostname under any root), a
			// pod's own name in passage-dra's container.
			if prev.Node.Hostname != "" && prev.Node.Hostname != manifest.UnsetHostname {
				m.Node.Hostname = prev.Node.Hostname
			}
		}
	}
	m.Errors = []string{}
	if cpus, err := record.NUMACPUs(o.Root); err != nil {
		m.Errors = append(m.Errors, fmt.Sprintf("numa cpus: %v", err))
	} else {
		m.NUMACPUs = cpus
	}
	if err := content(m, prev); err != nil {
		return nil, nil, nil, err
	}
	gen, src, gerr := manifest.NextGeneration(o.Counters...)
	if gerr != nil || src == manifest.GenerationNone {
		// Not signed at all rather than signed as generation 0 (ErrNoCounter).
		return m, nil, nil, fmt.Errorf("%w: %v", ErrNoCounter, gerr)
	}
	m.Generation, m.GenerationSource = gen, src
	signed, err = manifest.WriteSigned(ctx, m, o.Dir, EnvelopeName, o.Measurer, o.Signers...)
	if signed == nil {
		return m, nil, nil, err
	}
	if err != nil {
		o.logf("manifest generation %d: %v", gen, err)
	}
	return m, signed, o.attest(gen, signed, err == nil), nil
}

// units is the content of a generation decided on the node (d): the units of vs with
// their verdicts and what was done to them; every other unit as the previous manifest
// had it (or failed, when there is none to carry it from).
func (o *Options) units(d *decision.Decision, vs map[topology.UnitID]decision.Verdict,
	er *erase.Report, acs *apply.Report, bind *vfiobind.Report) func(m, prev *manifest.Manifest) error {
	return func(m, prev *manifest.Manifest) error {
		if prev == nil {
			m.Profile = manifest.Profile{Name: d.Profile.Name}
		}
		recs := map[string]manifest.Unit{}
		for _, r := range record.Units(d, slices.Collect(maps.Values(vs)), record.Execution{ACS: acs, Bind: bind, Erase: er}, record.Drivers(o.Root)) {
			recs[r.ID] = r
		}
		for _, u := range d.Units() {
			if _, mine := vs[u.ID]; mine {
				m.Units = append(m.Units, recs[u.ID.String()])
				continue
			}
			if pu := prevUnit(prev, u.ID); pu != nil {
				m.Units = append(m.Units, *pu)
				continue
			}
			v := d.Unvouched([]topology.UnitID{u.ID}, "recycle: no verified earlier manifest to carry this unit from")[0]
			m.Units = append(m.Units, manifest.Unit{ID: u.ID.String(), Status: string(v.Status), Reasons: v.Reasons, NUMANode: u.NUMANode,
				ModuleID: u.ModuleID, ModuleSource: u.ModuleSource})
		}
		m.NVLink = record.NVLink(d.Profile)
		return nil
	}
}

// AttestationSuffix names a manifest's attestation beside it (attest.Suffix; repeated so
// recycle does not link the verifier's code).
const AttestationSuffix = ".attest.json"

// attest writes generation gen's attestation when it was measured, and otherwise removes
// the one beside the manifest: an attestation of the previous generation would say
// nothing true of this one. It returns why the generation is not attested when an
// attestation was asked for (Attest set), nil when it is or none was.
func (o *Options) attest(gen uint64, signed *manifest.Signed, measured bool) error {
	stale := filepath.Join(o.Dir, EnvelopeName+AttestationSuffix)
	var why error
	switch {
	case o.Attest == nil:
	case !measured || o.Measurer == nil:
		why = fmt.Errorf("manifest generation %d: not measured into PCR 13, so not attested", gen)
	default:
		err := o.Attest(o.Dir, signed)
		if err == nil {
			o.logf("manifest generation %d attested (%s)", gen, EnvelopeName+AttestationSuffix)
			return nil
		}
		why = fmt.Errorf("manifest generation %d: attestation: %w", gen, err)
		o.logf("%v", why)
	}
	if err := os.Remove(stale); err != nil && !errors.Is(err, fs.ErrNotExist) {
		o.logf("manifest generation %d: %s: %v", gen, stale, err)
	}
	return why
}

func prevUnit(prev *manifest.Manifest, id topology.UnitID) *manifest.Unit {
	if prev == nil {
		return nil
	}
	for i := range prev.Units {
		if prev.Units[i].ID == id.String() {
			return &prev.Units[i]
		}
	}
	return nil
}
