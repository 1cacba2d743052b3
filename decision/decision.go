// Package decision computes what passage will do to a node, once, as a value: roles and
// units, ATS findings under the ATS policy, group viability and the isolation audit, the
// ACS targets and their kernel argument, every unit's status with its reasons, the bind
// set, and the guest plan. Decide reads a scanned tree and the running kernel's state
// and writes nothing; every check runs before any write. `passage plan` prints a
// decision, `apply --dry-run` is one against the live node, `apply` and `boot` execute
// one (package apply for ACS, vfiobind for binding) and Conclude folds what execution
// reported back into the units' verdicts, failing closed: a unit whose execution did not
// complete, for whatever reason, ends failed, never ready.
//
// This is the only place a unit's status is decided. The packages below report what
// they find or did (a port without ACS, a function without ATS, a shared IOMMU group, a
// write that failed); only Decide and Conclude turn that into a verdict.
package decision

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// Live is the running kernel's state a decision depends on, read under a root so the
// same code reads a node, a QEMU guest or a synthetic tree.
type Live struct {
	Cmdline string // /proc/cmdline: pci=config_acs= makes matching ports verify-only
	Release string // /proc/sys/kernel/osrelease: only sharpens advice
	// Lockdown is the selected mode of /sys/kernel/security/lockdown ("none",
	// "integrity", "confidentiality"); "" when the file is absent (no securityfs, or a
	// tree without it), which reads as not locked down.
	Lockdown string
	// KernelLog are the kernel log's lines about ACS (ReadKernelLog): what the kernel did
	// with pci=config_acs=. nil when there is no log to read.
	KernelLog []string `json:",omitempty"`
}

// LockedDown says the kernel refuses config-space writes from user space: both
// integrity and confidentiality modes do (pci_write_config in drivers/pci/pci-sysfs.c).
func (l Live) LockedDown() bool { return l.Lockdown == "integrity" || l.Lockdown == "confidentiality" }

// maxLiveFile bounds each kernel-state file: /proc/cmdline is at most a few KiB
// (COMMAND_LINE_SIZE), the others a line.
const maxLiveFile = 64 << 10

// ReadLive reads the kernel's state under root, as every read under a root goes: beneath
// it (a link cannot lead outside), regular files only (a FIFO is an error, never a
// hang), bounded. A file that is absent (a synthetic tree, a snapshot) reads as ""; one
// that cannot be read is an error naming it.
func ReadLive(root string) (Live, error) {
	var l Live
	var errs []error
	read := func(name string) string {
		f, err := pci.OpenAttr(root, name, os.O_RDONLY)
		if err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
			return ""
		}
		defer f.Close()
		b, err := io.ReadAll(io.LimitReader(f, maxLiveFile+1))
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", filepath.Join(root, name), err))
			return ""
		case len(b) > maxLiveFile:
			errs = append(errs, fmt.Errorf("%s: larger than %d bytes", filepath.Join(root, name), maxLiveFile))
			return ""
		}
		return string(b)
	}
	// /proc/cmdline is the line as the kernel kept it, then the newline cmdline_proc_show
	// (fs/proc/cmdline.c) adds: only that comes off, as the boot reads it
	// (initramfs.ReadConfig). A space the kept line ends in counts: a line the kernel cut
	// at KernelKeeps bytes just after a space must not read one byte shorter, whole.
	l.Cmdline = strings.TrimRight(read("proc/cmdline"), "\n")
	l.Release = strings.TrimSpace(read("proc/sys/kernel/osrelease"))
	l.Lockdown = ParseLockdown(read("sys/kernel/security/lockdown"))
	log, err := ReadKernelLog(root)
	if err != nil {
		errs = append(errs, err)
	}
	l.KernelLog = log
	return l, errors.Join(errs...)
}

// ParseLockdown returns the selected mode of the lockdown file ("none [integrity]
// confidentiality" -> "integrity"); a single word is taken as it is.
func ParseLockdown(s string) string {
	for _, w := range strings.Fields(s) {
		if strings.HasPrefix(w, "[") && strings.HasSuffix(w, "]") {
			return strings.Trim(w, "[]")
		}
	}
	if f := strings.Fields(s); len(f) == 1 {
		return f[0]
	}
	return ""
}

// Input is everything a decision depends on.
type Input struct {
	Tree    *pci.Tree
	Profile *topology.Profile
	ATS     firmware.Policy // "" is prefer
	Live    Live
	Guest   topology.GuestOptions

	// Erase is passage.erase=: whether a unit's NVMe must be erased and its functions
	// reset before it is passed through; "" is the profile's default (off when the
	// profile names none). erase.go judges the reports.
	Erase erase.Policy

	// For is the command that will execute the decision ("" is the boot): the steps it
	// does not run are judged here, before any write (command.go).
	For Command
}

// Decision is the node's verdict before anything is written.
type Decision struct {
	Input
	Labels *topology.Labels
	// LabelErr is why labelling is unusable (rules that conflict, unlabeled functions a
	// profile forbids): every unit is then failed and nothing is written.
	LabelErr error
	ATS      []firmware.Finding
	Audit    []vfiobind.Finding
	// ACS is the plan, port by port: DT dropped for units without ATS, Skip set on the
	// ports of failed units.
	ACS       []topology.ACSPort
	KernelArg string
	Host      *topology.Matrix
	// Image is the ACS plan the kernel command line carries (pci=config_acs=,
	// passage.plan=) compared with this node's; nil when it carries none.
	Image *ImagePlan
	// Guest is the guest plan of the chosen units (GuestErr why there is none).
	Guest       *topology.Guest
	GuestMatrix *topology.Matrix
	GuestErr    error
	// NoUnits says the profile found none of the units it exists for ("" when it found
	// some): the node is not what the profile is for, and nothing it does is ready.
	NoUnits string
	// NotJudged names what the input cannot show and the verdicts therefore do not
	// cover (input.go): facts about the input, not about the node.
	NotJudged []string
}

// Units are the decision's units, their Status and Reasons the decided ones.
func (d *Decision) Units() []*topology.Unit { return d.Labels.Units }

// Decide computes the decision. The error is only for inputs it cannot decide on (no
// tree, no profile); everything the node itself gets wrong is in the verdicts.
func Decide(in Input) (*Decision, error) {
	if in.Tree == nil || in.Profile == nil {
		return nil, errors.New("decision: needs a tree and a profile")
	}
	if in.ATS == "" {
		in.ATS = firmware.PolicyPrefer
	}
	if in.For == "" {
		in.For = CommandBoot
	}
	if in.Erase == "" {
		p, err := erase.ParsePolicy(in.Profile.Erase)
		if err != nil {
			return nil, fmt.Errorf("decision: profile %s: %w", in.Profile.Name, err)
		}
		in.Erase = p
	}
	labels, lerr := topology.Label(in.Tree, in.Profile)
	if labels == nil {
		return nil, lerr
	}
	d := &Decision{Input: in, Labels: labels, LabelErr: lerr, NotJudged: notJudged(in.Tree), NoUnits: noUnits(in.Profile, labels)}
	units := labels.Units
	byID := map[topology.UnitID]*topology.Unit{}
	for _, u := range units {
		u.Status, u.Reasons = topology.StatusReady, nil
		byID[u.ID] = u
	}
	mark := func(id topology.UnitID, s topology.Status, reason string) {
		if u := byID[id]; u != nil && s != "" {
			u.Degrade(s, "%s", reason)
		}
	}
	if lerr != nil {
		why := "label: " + strings.ReplaceAll(lerr.Error(), "\n", "; ") + ": nothing is written on a labelling that contradicts itself"
		for _, u := range units {
			mark(u.ID, topology.StatusFailed, why)
		}
	}
	// What cannot be read about a passthrough function is never a reason for its unit to
	// be ready: its config space, driver or group may be anything. Only VPD (used to pair
	// a data-direct function) and NUMA placement (used for the guest layout) cost less,
	// VPD only while the profile gives no role by it: under one that does (b300's
	// nvswitch-bridge), a function whose VPD could not be read may be an NVSwitch
	// bridge PF labelled as an ordinary ConnectX PF. The same holds for every bridge on
	// the unit's path: a port whose capabilities cannot be read may or may not isolate.
	vpdRoles := in.Profile.UsesVPD()
	for _, u := range units {
		for _, f := range append(u.Functions(), u.Bridges...) {
			for _, p := range f.Problems {
				s, why := topology.StatusFailed, ""
				switch {
				case strings.HasPrefix(p, "vpd:") && vpdRoles:
					why = fmt.Sprintf(" (profile %s tells functions the host keeps by their VPD)", in.Profile.Name)
				case strings.HasPrefix(p, "vpd:") || strings.HasPrefix(p, "numa_node:"):
					s = topology.StatusDegraded
				}
				mark(u.ID, s, fmt.Sprintf("%s: cannot be read as it is: %s%s", f.Addr, p, why))
			}
			if !f.ExpressKnown() && len(f.Problems) == 0 {
				mark(u.ID, topology.StatusFailed, fmt.Sprintf("%s: capability list unreadable: %s", f.Addr, f.CapsUnknown))
			}
		}
	}
	for _, u := range units {
		if len(u.NICs) == 0 {
			mark(u.ID, topology.StatusDegraded, fmt.Sprintf("no GPU-adjacent NIC found for GPU %s", u.GPU.Addr))
		}
	}

	d.ATS = firmware.CheckATS(units)
	for _, f := range d.ATS {
		s, why := f.Verdict(in.ATS)
		mark(f.Unit, s, why)
	}
	d.markSteps(mark)

	ports := firmware.DropDT(topology.ACSPlan(units), d.ATS)
	for _, p := range ports {
		for _, id := range p.Units() {
			mark(id, p.Verdict, p.Problem)
		}
	}
	// A port is written while any unit whose path holds it may still pass through.
	live := func(p topology.ACSPort) bool {
		for _, id := range p.Units() {
			if u := byID[id]; u != nil && u.Status != topology.StatusFailed {
				return true
			}
		}
		return false
	}

	// The plan the signed image's command line carries, which the kernel programs
	// itself: a port it set is only read back.
	d.Image = imagePlan(in.Live, in.Tree, ports)

	// A locked-down kernel refuses every config write: the ports keep what they hold. A
	// port the image's argument plans as this node does, and which the kernel did not
	// set, is a mismatch; one it plans otherwise, or not at all, means the image was
	// planned for another topology, and fails the units that need it.
	locked := in.Live.LockedDown()
	if locked {
		need := map[topology.UnitID][]topology.ACSPort{}
		var order []topology.UnitID
		for _, p := range ports {
			if p.Offset == 0 || p.Target() == p.Current {
				continue
			}
			s, why, judged := d.Image.lockedPort(p, in.Live.Release)
			for _, id := range p.Units() {
				if u := byID[id]; u == nil || u.Status == topology.StatusFailed {
					continue
				}
				if judged {
					mark(id, s, why)
					continue
				}
				if need[id] == nil {
					order = append(order, id)
				}
				need[id] = append(need[id], p)
			}
		}
		for _, id := range order {
			s := topology.StatusDegraded
			for _, p := range need[id] {
				if want := p.Flags & pci.ACSIsolation; p.Current&want != want {
					s = topology.StatusFailed
				}
			}
			mark(id, s, lockdownReason(need[id], in.Live.Release))
		}
	}

	// The audit judges the ports as they will be once the plan is written, before
	// anything is.
	planned := map[pci.Address]pci.ACSBits{}
	for _, p := range ports {
		if p.Offset != 0 && !locked && live(p) {
			planned[p.Addr] = p.Target()
		}
	}
	d.Audit = vfiobind.AuditPlanned(in.Tree, units, planned)
	for _, f := range d.Audit {
		mark(f.Unit, f.Status, f.String())
	}

	var write []topology.ACSPort
	for i := range ports {
		// The audit counted on every port still live then; a unit it failed leaves a port
		// only when no other unit holds it, so nothing the audit relied on goes unwritten.
		if !live(ports[i]) {
			ports[i].Skip = "unit failed: not passed through, its ports are left as they are"
			continue
		}
		write = append(write, ports[i])
	}
	d.ACS = ports
	d.KernelArg = topology.KernelArg(write)

	nv := in.Profile.NVLinks
	d.Host = topology.HostMatrix(units, nv)
	d.Guest, d.GuestErr = topology.GuestPlan(units, in.Guest)
	if d.Guest != nil {
		d.GuestMatrix = d.Guest.Matrix(nv)
	}
	return d, nil
}

func lockdownReason(ports []topology.ACSPort, release string) string {
	return "acs: " + apply.LockdownAdvice(topology.KernelArg(ports), release)
}

// Verdict is one unit's status and the reasons for it.
type Verdict struct {
	Unit    topology.UnitID `json:"unit"`
	Status  topology.Status `json:"status"`
	Reasons []string        `json:"reasons,omitempty"`
}

// Usable says the unit may be passed through: ready, or degraded with a documented loss.
func (v Verdict) Usable() bool {
	return v.Status == topology.StatusReady || v.Status == topology.StatusDegraded
}

// Decided returns the verdicts as decided, before execution.
func (d *Decision) Decided() []Verdict {
	out := make([]Verdict, 0, len(d.Units()))
	for _, u := range d.Units() {
		out = append(out, Verdict{Unit: u.ID, Status: u.Status, Reasons: append([]string(nil), u.Reasons...)})
	}
	return out
}

func (d *Decision) unit(id topology.UnitID) *topology.Unit { return d.Labels.Unit(id) }

// Execution is what executing a decision reported. A step that did not complete (an
// error, a panic, a deadline) leaves its report nil and says why in its Err.
type Execution struct {
	// DryRun: nothing was to be written; the verdicts are the decision's.
	DryRun bool
	ACS    *apply.Report
	ACSErr error
	// Binding says binding was part of the execution (false for apply --no-bind).
	Binding bool
	Bind    *vfiobind.Report
	BindErr error
	// Erase is what the erase step reported (decision.Input.Erase active); EraseErr why
	// there is no report.
	Erase    *erase.Report
	EraseErr error
}

// Conclude is each unit's final verdict: the decided one, worsened by what execution
// reported. It fails closed: a unit the decision passes through ends ready or degraded
// only when every step that covers it completed and reported it done.
func (d *Decision) Conclude(x Execution) []Verdict {
	out := d.Decided()
	if x.DryRun {
		return out
	}
	byUnit := changesByUnit(x.ACS)
	var bound map[topology.UnitID]*vfiobind.UnitReport
	if x.Bind != nil {
		bound = make(map[topology.UnitID]*vfiobind.UnitReport, len(x.Bind.Units))
		for i := range x.Bind.Units {
			bound[x.Bind.Units[i].ID] = &x.Bind.Units[i]
		}
	}
	for i := range out {
		v := &out[i]
		if v.Status == topology.StatusFailed {
			continue
		}
		add := func(s topology.Status, reason string) {
			v.Status = v.Status.Worse(s)
			for _, r := range v.Reasons {
				if r == reason {
					return
				}
			}
			v.Reasons = append(v.Reasons, reason)
		}
		if x.ACS == nil {
			add(topology.StatusFailed, "acs: did not complete: "+errText(x.ACSErr))
		} else {
			s, reasons := d.acsVerdict(byUnit[v.Unit])
			for _, r := range reasons {
				add(s, r)
			}
		}
		if v.Status != topology.StatusFailed {
			s, reasons := d.eraseVerdict(v.Unit, x.Erase, x.EraseErr)
			for _, r := range reasons {
				add(s, r)
			}
		}
		if !x.Binding || v.Status == topology.StatusFailed {
			continue
		}
		ur := bound[v.Unit]
		switch {
		case x.Bind == nil:
			add(topology.StatusFailed, "vfio: did not complete: "+errText(x.BindErr))
		case ur == nil:
			add(topology.StatusFailed, "vfio: not bound: "+errText(x.BindErr))
		case !ur.Bound():
			add(topology.StatusFailed, "vfio: "+ur.Error)
		}
	}
	return out
}

func errText(err error) string {
	if err == nil {
		return "no report"
	}
	return strings.ReplaceAll(err.Error(), "\n", "; ")
}

// changesByUnit indexes an ACS report's changes by every unit whose path holds the port
// (nil report: none).
func changesByUnit(rep *apply.Report) map[topology.UnitID][]apply.Change {
	out := map[topology.UnitID][]apply.Change{}
	if rep != nil {
		for _, c := range rep.Changes {
			for _, u := range c.Units() {
				out[u] = append(out[u], c)
			}
		}
	}
	return out
}

// acsVerdict is what a unit's ACS changes make of it beyond what the decision foresaw.
func (d *Decision) acsVerdict(changes []apply.Change) (topology.Status, []string) {
	var s topology.Status
	var reasons []string
	var locked []topology.ACSPort
	var unwritten []string
	for _, c := range changes {
		if d.foreseen(c) {
			continue // the decision judged the port as it still is
		}
		switch c.Result {
		case apply.ResultFailed, apply.ResultMismatch:
			s = s.Worse(topology.StatusFailed)
			reasons = append(reasons, fmt.Sprintf("acs %s (%s): %s: %s", c.Addr, c.Position, c.Result, c.Error))
		case apply.ResultLockedDown:
			if !c.Isolated() {
				s = s.Worse(topology.StatusFailed)
			} else {
				s = s.Worse(topology.StatusDegraded)
			}
			locked = append(locked, topology.ACSPort{Addr: c.Addr, Offset: c.Offset - pci.ACSCtlReg, Mask: c.Mask, Flags: c.Flags})
		case apply.ResultSkipped, apply.ResultNoACS:
			// Not written, for a unit asked about (one the decision passes through): a
			// port it relies on is not as planned. Fail closed, whatever the cause.
			unwritten = append(unwritten, fmt.Sprintf("acs %s (%s): %s (%s)", c.Addr, c.Position, c.Result, c.Note))
		}
	}
	if len(locked) > 0 {
		reasons = append(reasons, lockdownReason(locked, d.Live.Release))
	}
	if s != topology.StatusFailed && len(unwritten) > 0 {
		s = topology.StatusFailed
		reasons = append(reasons, unwritten...)
	}
	return s, reasons
}

// foreseen says a port left unwritten by a locked-down kernel (refused, or set by
// pci=config_acs= otherwise than asked) reads what the decision judged it by: then the
// decision's verdict stands. A port that changed between the decision and its execution
// is judged by what execution found.
func (d *Decision) foreseen(c apply.Change) bool {
	if !d.Live.LockedDown() || c.Result != apply.ResultLockedDown && c.Result != apply.ResultMismatch || !c.Read {
		return false
	}
	for _, p := range d.ACS {
		if p.Addr == c.Addr {
			return p.Current == c.Before
		}
	}
	return false
}

// passable are the units the decision passes through whose ports all reached a state
// they may be passed through in.
func (d *Decision) passable(rep *apply.Report) []*topology.Unit {
	var out []*topology.Unit
	byUnit := changesByUnit(rep)
	for _, u := range d.Units() {
		if u.Status == topology.StatusFailed {
			continue
		}
		if s, _ := d.acsVerdict(byUnit[u.ID]); s == topology.StatusFailed {
			continue
		}
		out = append(out, u)
	}
	return out
}

// Err is why the decision as a whole fails, before any unit's verdict: labels that
// contradict each other, or a profile that found none of its units. nil otherwise.
func (d *Decision) Err() error {
	switch {
	case d.LabelErr != nil:
		return d.LabelErr
	case d.NoUnits != "":
		return errors.New(d.NoUnits)
	}
	return nil
}

// Failed says whether the verdicts hold a failed unit: then the command exits 1. A
// degraded unit is usable with a documented loss, and exits 0 like a ready one.
func Failed(vs []Verdict) bool {
	for _, v := range vs {
		if v.Status == topology.StatusFailed {
			return true
		}
	}
	return false
}

// UnitsJSON lists the units as inspect, plan, apply and the manifest's readers see them,
// with the given verdicts.
func (d *Decision) UnitsJSON(vs []Verdict) []topology.UnitJSON {
	out := []topology.UnitJSON{}
	for _, v := range vs {
		u := d.unit(v.Unit)
		if u == nil {
			continue
		}
		j := u.JSON()
		j.Status, j.Reasons = v.Status, v.Reasons
		out = append(out, j)
	}
	return out
}

// ExecuteACS writes the decision's ACS plan through cfg (read only with dryRun) and
// reports port by port. The ports of failed units are not touched.
func (d *Decision) ExecuteACS(ctx context.Context, cfg pci.ConfigIO, dryRun bool) (apply.Report, error) {
	return apply.ACS(ctx, d.ACS, apply.Options{IO: cfg, Cmdline: d.Live.Cmdline, Tree: d.Input.Tree, KernelRelease: d.Live.Release,
		DryRun: dryRun, LockedDown: d.Live.LockedDown()})
}
