package vfiobind

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strings"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// Clock is time as binding sees it; tests advance a fake one instead of sleeping.
type Clock interface {
	Now() time.Time
	// Sleep waits for d or until ctx ends, returning ctx's error in that case.
	Sleep(ctx context.Context, d time.Duration) error
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Options tune Bind and Release. The zero value is what a node uses, except Modules.
type Options struct {
	// Modules loads the vfio stack before any binding. nil means the caller has loaded
	// it; Bind still checks that the vfio-pci driver is registered.
	Modules ModuleLoader
	// VerifyTimeout bounds the wait for the driver link and /dev/vfio/<group> after
	// drivers_probe (default 2s). The probe runs synchronously in the write, but udev-less
	// devtmpfs node creation and async probing drivers can lag it.
	VerifyTimeout time.Duration
	// PollInterval is the step of that wait (default 10ms).
	PollInterval time.Duration
	// Clock defaults to the wall clock.
	Clock Clock
}

func (o Options) withDefaults() Options {
	if o.VerifyTimeout <= 0 {
		o.VerifyTimeout = 2 * time.Second
	}
	if o.PollInterval <= 0 {
		o.PollInterval = 10 * time.Millisecond
	}
	if o.Clock == nil {
		o.Clock = realClock{}
	}
	return o
}

// FunctionReport is what binding (or releasing) did to one function.
type FunctionReport struct {
	Addr pci.Address `json:"addr"`
	// Group is the IOMMU group, -1 when none.
	Group        int    `json:"iommu_group"`
	DriverBefore string `json:"driver_before"` // "" when unbound
	DriverAfter  string `json:"driver_after"`
	// Duration is the whole sequence for the function: override, unbind, probe, verify.
	Duration time.Duration `json:"duration_ns"`
	// Err is why the function did not end where it should; "" on success.
	Err string `json:"error,omitempty"`
	// RolledBack says the function was returned to its state before binding because its
	// unit failed; RollbackErr is what went wrong doing that.
	RolledBack  bool   `json:"rolled_back,omitempty"`
	RollbackErr string `json:"rollback_error,omitempty"`
	// Writes are the sysfs writes made for the function, in order ("path <- value").
	Writes []string `json:"writes,omitempty"`
}

// UnitReport is one unit's outcome: bound when Error is "".
type UnitReport struct {
	ID        topology.UnitID  `json:"id"`
	Error     string           `json:"error,omitempty"`
	Functions []FunctionReport `json:"functions,omitempty"`
}

// Bound says whether every function of the unit ended on vfio-pci.
func (u UnitReport) Bound() bool { return u.Error == "" }

// Report is Bind's outcome.
type Report struct {
	// ModulesErr is why loading the vfio stack failed, "" when it did not.
	ModulesErr string        `json:"modules_error,omitempty"`
	Units      []UnitReport  `json:"units"`
	Duration   time.Duration `json:"duration_ns"`
}

// Unit returns the report of unit id, or nil.
func (r *Report) Unit(id topology.UnitID) *UnitReport {
	for i := range r.Units {
		if r.Units[i].ID == id {
			return &r.Units[i]
		}
	}
	return nil
}

// Bind loads the vfio stack and binds every function of each unit to vfio-pci. Which
// units go is the caller's decision (package decision: audited, isolated, none failed);
// Bind executes it and reports, unit by unit, and judges nothing. A unit whose binding
// fails is returned to its state before (override restored, host driver re-probed where
// one was unbound), so no IOMMU group ends half on vfio-pci; the other units proceed.
// Devices outside the units' passthrough sets are never written, and nothing at all is
// written once ctx is done: a unit cut short then stays as it is, and its report says so.
// The error is for what stops the whole run: bad arguments or a cancelled context (the
// report then covers what was done).
func Bind(ctx context.Context, sys Sysfs, tree *pci.Tree, units []*topology.Unit, opts Options) (*Report, error) {
	if sys == nil || tree == nil {
		return nil, errors.New("vfiobind: nil sysfs or tree")
	}
	opts = opts.withDefaults()
	start := opts.Clock.Now()
	rep := &Report{}
	defer func() { rep.Duration = opts.Clock.Now().Sub(start) }()

	sorted := make([]*topology.Unit, 0, len(units))
	for _, u := range units {
		if u != nil {
			sorted = append(sorted, u)
		}
	}
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].ID < sorted[j].ID })

	var stackErr error
	if len(sorted) > 0 {
		stackErr = loadStack(sys, opts.Modules, rep)
	}
	var runErr error
	for _, u := range sorted {
		ur := UnitReport{ID: u.ID}
		switch {
		case stackErr != nil:
			ur.Error = fmt.Sprintf("vfio stack: %v", stackErr)
		case runErr != nil:
			ur.Error = fmt.Sprintf("not bound: %v", runErr)
		default:
			var err error
			ur.Functions, err = bindUnit(ctx, sys, tree, u, opts)
			if err != nil {
				ur.Error = err.Error()
				if ctx.Err() != nil {
					runErr = ctx.Err()
				}
			}
		}
		rep.Units = append(rep.Units, ur)
	}
	return rep, runErr
}

// loadStack loads the vfio modules and checks the driver registered. A load error with
// the driver nonetheless present (built in, or loaded earlier from elsewhere) is
// recorded and binding goes on: what binding needs is the driver.
func loadStack(sys Sysfs, ml ModuleLoader, rep *Report) error {
	var lerr error
	if ml != nil {
		if lerr = ml.Load(Modules...); lerr != nil {
			rep.ModulesErr = lerr.Error()
		}
	}
	if err := sys.Stat(driversDir + "/" + VFIODriver); err != nil {
		if lerr != nil {
			return fmt.Errorf("%w (and driver %s not registered)", lerr, VFIODriver)
		}
		return fmt.Errorf("driver %s not registered: %w", VFIODriver, err)
	}
	return nil
}

// fnState is what a function looked like before binding touched it.
type fnState struct {
	dev       *pci.Device
	driver    string
	override  string
	wroteOvr  bool // driver_override was written
	reportIdx int
}

// bindUnit binds the unit's functions in order: GPU, NICs, data-direct, NVMe. On the
// first failure it returns every touched function to its state before and reports the
// unit failed.
func bindUnit(ctx context.Context, sys Sysfs, tree *pci.Tree, u *topology.Unit, opts Options) ([]FunctionReport, error) {
	var reps []FunctionReport
	var touched []*fnState
	var failure error
	for _, ud := range unitFunctions(u) {
		if err := ctx.Err(); err != nil {
			failure = fmt.Errorf("%s: %w", u.ID, err)
			break
		}
		d := tree.Lookup(ud.Addr)
		if d == nil {
			// The decision refuses such a unit (bad-unit); a caller that did not ask it
			// gets an error, not a crash.
			failure = fmt.Errorf("%s: %s is not in the scanned tree", u.ID, ud.Addr)
			break
		}
		st := &fnState{dev: d, override: d.DriverOverride, reportIdx: len(reps)}
		fr, err := bindFunction(ctx, sys, st, opts)
		reps = append(reps, fr)
		touched = append(touched, st)
		if err != nil {
			failure = fmt.Errorf("%s: %w", u.ID, err)
			break
		}
	}
	if failure == nil {
		return reps, nil
	}
	if ctx.Err() != nil {
		// Cut short: nothing more is written, rollback included. The unit is off
		// vfio-pci or half on it, and its report (and so the manifest) says failed.
		return reps, failure
	}
	for i := len(touched) - 1; i >= 0; i-- {
		st := touched[i]
		fr := &reps[st.reportIdx]
		after, err := restore(ctx, sys, st, fr)
		fr.RolledBack = true
		fr.DriverAfter = after
		if err != nil {
			fr.RollbackErr = err.Error()
			failure = fmt.Errorf("%w; rollback: %v", failure, err)
		}
	}
	return reps, failure
}

// write performs one sysfs write and logs it in the function's report. Once ctx is done
// it writes nothing: a stage past its deadline has been given up on, and whatever it
// would still write would race with what runs after it.
func write(ctx context.Context, sys Sysfs, fr *FunctionReport, name, value string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%s: not written: %w", name, err)
	}
	fr.Writes = append(fr.Writes, name+" <- "+strings.TrimSpace(value))
	return sys.WriteFile(name, []byte(value))
}

// bindFunction is the per-BDF sequence. The override goes first so that from the
// moment the host driver lets go, the only driver the kernel will match is vfio-pci.
func bindFunction(ctx context.Context, sys Sysfs, st *fnState, opts Options) (fr FunctionReport, err error) {
	d := st.dev
	a := d.Addr
	start := opts.Clock.Now()
	fr = FunctionReport{Addr: a, Group: d.IOMMUGroup}
	defer func() {
		if err != nil {
			fr.Err = err.Error()
			if drv, rerr := currentDriver(sys, a); rerr == nil {
				fr.DriverAfter = drv
			}
		}
		fr.Duration = opts.Clock.Now().Sub(start)
	}()

	before, err := currentDriver(sys, a)
	if err != nil {
		return fr, err
	}
	st.driver, fr.DriverBefore = before, before

	wrote, err := steer(ctx, sys, &fr, a, before, VFIODriver)
	st.wroteOvr = wrote
	if err != nil {
		return fr, err
	}
	if err := verify(ctx, sys, a, VFIODriver, VFIODevNode(d.IOMMUGroup), opts); err != nil {
		return fr, err
	}
	fr.DriverAfter = VFIODriver
	return fr, nil
}

// steer makes the three writes that move a function from driver before to drv: the
// override first (so from the moment its driver lets go only drv can match), the unbind
// of before, drivers_probe; none when it is on drv already. wrote says the override was
// written (a sysfs store that fails changes nothing: no override to restore).
func steer(ctx context.Context, sys Sysfs, fr *FunctionReport, a pci.Address, before, drv string) (wrote bool, err error) {
	if err := write(ctx, sys, fr, devPath(a, "driver_override"), drv); err != nil {
		return false, fmt.Errorf("%s: write driver_override: %w", a, err)
	}
	if before == drv {
		return true, nil
	}
	if before != "" {
		if err := write(ctx, sys, fr, driverPath(before, "unbind"), a.String()); err != nil {
			return true, fmt.Errorf("%s: unbind %s: %w", a, before, err)
		}
	}
	if err := write(ctx, sys, fr, driversProbe, a.String()); err != nil {
		return true, fmt.Errorf("%s: drivers_probe: %w", a, err)
	}
	return true, nil
}

// verify waits for the driver link to name drv and, when node is set (the group's
// /dev/vfio node), for node to exist. drivers_probe reports success even when the probe
// fails, so only these say the binding happened.
func verify(ctx context.Context, sys Sysfs, a pci.Address, want, node string, opts Options) error {
	deadline := opts.Clock.Now().Add(opts.VerifyTimeout)
	for {
		drv, err := currentDriver(sys, a)
		if err != nil {
			return err
		}
		var nodeErr error
		if drv == want {
			if node == "" {
				return nil
			}
			nodeErr = sys.Stat(node)
			if nodeErr == nil {
				return nil
			}
		}
		if !opts.Clock.Now().Before(deadline) {
			switch {
			case drv == "":
				return fmt.Errorf("%s: no driver bound after drivers_probe (want %s; waited %v)", a, want, opts.VerifyTimeout)
			case drv != want:
				return fmt.Errorf("%s: driver is %s after drivers_probe (want %s; waited %v)", a, drv, want, opts.VerifyTimeout)
			case errors.Is(nodeErr, fs.ErrNotExist):
				return fmt.Errorf("%s: bound to %s but /%s is missing (waited %v)", a, want, node, opts.VerifyTimeout)
			default:
				return fmt.Errorf("%s: bound to %s but /%s: %w", a, want, node, nodeErr)
			}
		}
		if err := opts.Clock.Sleep(ctx, opts.PollInterval); err != nil {
			return fmt.Errorf("%s: verify: %w", a, err)
		}
	}
}

// restore returns a function to its state before binding: the old override back (the
// kernel clears it on an empty write), vfio-pci off if it got the function, and the
// host driver re-probed if one was unbound. It returns the driver it ends on.
func restore(ctx context.Context, sys Sysfs, st *fnState, fr *FunctionReport) (string, error) {
	a := st.dev.Addr
	var errs []error
	if st.wroteOvr {
		val := st.override
		if val == "" {
			val = "\n"
		}
		if err := write(ctx, sys, fr, devPath(a, "driver_override"), val); err != nil {
			errs = append(errs, fmt.Errorf("%s: restore driver_override: %w", a, err))
		}
	}
	cur, err := currentDriver(sys, a)
	if err != nil {
		return "", errors.Join(append(errs, err)...)
	}
	if cur == st.driver {
		return cur, errors.Join(errs...)
	}
	if cur != "" {
		if err := write(ctx, sys, fr, driverPath(cur, "unbind"), a.String()); err != nil {
			errs = append(errs, fmt.Errorf("%s: unbind %s: %w", a, cur, err))
		}
	}
	if st.driver != "" {
		if err := write(ctx, sys, fr, driversProbe, a.String()); err != nil {
			errs = append(errs, fmt.Errorf("%s: re-probe %s: %w", a, st.driver, err))
		}
	}
	after, err := currentDriver(sys, a)
	if err != nil {
		errs = append(errs, err)
	} else if after != st.driver {
		errs = append(errs, fmt.Errorf("%s: driver is %q after rollback, was %q", a, after, st.driver))
	}
	return after, errors.Join(errs...)
}
