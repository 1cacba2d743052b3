package erase

import (
	"context"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// NVMeDriver is the host driver erasing goes through.
const NVMeDriver = "nvme"

// Opener opens the controller of an NVMe function once it is on the nvme driver; name
// is the kernel's name for it (nvme3).
type Opener func(ctx context.Context, a pci.Address) (c Controller, name string, err error)

// NVMeReport is what erasing one NVMe function did.
type NVMeReport struct {
	Addr       pci.Address `json:"addr"`
	Controller string      `json:"controller,omitempty"`
	Result
	// Moves are the driver moves around the erase: onto nvme, then parked for vfio-pci.
	Moves []vfiobind.FunctionReport `json:"moves,omitempty"`
}

// ResetReport is what resetting one function did.
type ResetReport struct {
	Addr pci.Address `json:"addr"`
	// Methods is reset_method as the kernel offered it: the kernel tries them in this
	// order and uses the first that works (pci_reset_function).
	Methods string `json:"methods"`
	// Err is why the reset did not happen or failed; "" when the kernel reported it done.
	Err string `json:"error,omitempty"`
}

// UnitReport is one unit's erase and resets.
type UnitReport struct {
	ID     topology.UnitID `json:"unit"`
	NVMe   []NVMeReport    `json:"nvme"`
	Resets []ResetReport   `json:"resets"`
	// Err is what stopped the unit outside any one device (the run cut short).
	Err string `json:"error,omitempty"`
}

// Problems lists every reason the unit is not known to be erased and reset.
func (u *UnitReport) Problems() []string {
	var out []string
	if u.Err != "" {
		out = append(out, u.Err)
	}
	for _, n := range u.NVMe {
		if !n.Erased() {
			why := n.Err
			if why == "" {
				why = "not erased"
			}
			out = append(out, fmt.Sprintf("erase %s: %s", n.Addr, why))
		}
		for _, m := range n.Moves {
			if m.Err != "" {
				out = append(out, fmt.Sprintf("erase %s: %s", n.Addr, m.Err))
			}
		}
	}
	for _, r := range u.Resets {
		if r.Err != "" {
			out = append(out, fmt.Sprintf("reset %s: %s", r.Addr, r.Err))
		}
	}
	return out
}

// Report is what Run did, unit by unit.
type Report struct {
	Units    []UnitReport  `json:"units"`
	Duration time.Duration `json:"duration_ns"`
}

// Unit returns the report of unit id, or nil.
func (r *Report) Unit(id topology.UnitID) *UnitReport {
	if r == nil {
		return nil
	}
	for i := range r.Units {
		if r.Units[i].ID == id {
			return &r.Units[i]
		}
	}
	return nil
}

// RunOptions tune Run.
type RunOptions struct {
	Erase Options
	Bind  vfiobind.Options
	// Park is the override a function is left with once erased and reset ("vfio-pci":
	// only the binding step can claim it). "" is vfio-pci.
	Park string
	// Progress, when set, holds what each NVMe of the run is doing now.
	Progress *Progress
}

// Progress is what each NVMe of a Run is doing at the moment, for a stage that shows its
// wait on the console: "0000:15:00.0 sanitize-block-erase 37% (SPROG 24248/65536)". The
// zero value is ready; a nil *Progress records nothing.
type Progress struct {
	mu  sync.Mutex
	now map[pci.Address]string
}

func (p *Progress) set(a pci.Address, step string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.now == nil {
		p.now = map[pci.Address]string{}
	}
	if step == "" {
		delete(p.now, a)
		return
	}
	p.now[a] = step
}

// String lists the NVMe still being erased with their step, in address order; "" when
// none is.
func (p *Progress) String() string {
	if p == nil {
		return ""
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	addrs := make([]pci.Address, 0, len(p.now))
	for a := range p.now {
		addrs = append(addrs, a)
	}
	slices.SortFunc(addrs, func(x, y pci.Address) int { return strings.Compare(x.String(), y.String()) })
	parts := make([]string, len(addrs))
	for i, a := range addrs {
		parts[i] = a.String() + " " + p.now[a]
	}
	return strings.Join(parts, ", ")
}

// Run erases every NVMe of the units and resets every function, all units in parallel:
// each NVMe is moved to the nvme driver, erased and verified through it, then taken off
// it and parked with an override only vfio-pci matches; then every function of the unit
// is reset through the kernel, as far as labels allow it (Reset). It reports and decides
// nothing; units whose run went wrong say why in their report. Nothing is written once
// ctx ends.
func Run(ctx context.Context, sys vfiobind.Sysfs, labels *topology.Labels, units []*topology.Unit, open Opener, opts RunOptions) *Report {
	start := time.Now()
	if opts.Park == "" {
		opts.Park = vfiobind.VFIODriver
	}
	rep := &Report{Units: make([]UnitReport, len(units))}
	var wg sync.WaitGroup
	for i, u := range units {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rep.Units[i] = runUnit(ctx, sys, labels, u, open, opts)
		}()
	}
	wg.Wait()
	rep.Duration = time.Since(start)
	return rep
}

func runUnit(ctx context.Context, sys vfiobind.Sysfs, labels *topology.Labels, u *topology.Unit, open Opener, opts RunOptions) (ur UnitReport) {
	ur = UnitReport{ID: u.ID, NVMe: []NVMeReport{}, Resets: []ResetReport{}}
	defer func() {
		if p := recover(); p != nil {
			ur.Err = fmt.Sprintf("erase panicked: %v", p)
		}
	}()
	for _, d := range u.NVMe {
		ur.NVMe = append(ur.NVMe, eraseOne(ctx, sys, d.Addr, open, opts))
	}
	if err := ctx.Err(); err != nil {
		ur.Err = fmt.Sprintf("cut short before the resets: %v", err)
		return ur
	}
	for _, f := range u.Functions() {
		if f != nil {
			ur.Resets = append(ur.Resets, Reset(ctx, sys, labels, f.Addr))
		}
	}
	return ur
}

func eraseOne(ctx context.Context, sys vfiobind.Sysfs, a pci.Address, open Opener, opts RunOptions) (r NVMeReport) {
	r.Addr = a
	step := func(s string) { opts.Progress.set(a, s) }
	defer step("")
	step("bind to " + NVMeDriver)
	mv, err := vfiobind.BindDriver(ctx, sys, a, NVMeDriver, opts.Bind)
	r.Moves = append(r.Moves, mv)
	if err == nil {
		var c Controller
		c, r.Controller, err = open(ctx, a)
		if err == nil {
			eo := opts.Erase
			eo.Progress = step
			r.Result = Erase(ctx, c, eo)
			if cerr := c.Close(); cerr != nil && r.Err == "" {
				r.Err = "close: " + cerr.Error()
			}
		}
	}
	if err != nil {
		r.Err = err.Error()
	}
	// Off nvme whatever happened: a controller that was not erased must not stay where
	// the host can mount it, and one that was is only for vfio-pci to take.
	step("park for " + opts.Park)
	pk, perr := vfiobind.Park(ctx, sys, a, opts.Park, opts.Bind)
	// The move is only reported, the error too: it counts in Problems through Moves.
	_ = perr
	r.Moves = append(r.Moves, pk)
	return r
}

// Reset resets one function through the kernel: the reset attribute, which tries the
// methods reset_method lists in order (pci_reset_function). What a reset clears is the
// device's to say: FLR returns a function to its power-on state as its designer chose,
// and a GPU's memory is not guaranteed zeroed by it.
//
// Every reset passage makes comes through here, and labels must allow it first
// (topology.Labels.ResetRefusal): only a function passage passes through is reset, never
// one the host keeps, above all not an NVSwitch management function, whose FLR resets
// its NVSwitch. A refusal writes nothing and is the report's error; without labels
// nothing is reset.
func Reset(ctx context.Context, sys vfiobind.Sysfs, labels *topology.Labels, a pci.Address) ResetReport {
	rr := ResetReport{Addr: a}
	if err := labels.ResetRefusal(a); err != nil {
		rr.Err = "refused: " + err.Error()
		return rr
	}
	dir := path.Join(pci.DevicesDir, a.String())
	if ar, ok := sys.(vfiobind.AttrReader); ok {
		b, err := ar.ReadFile(path.Join(dir, "reset_method"))
		if err != nil {
			rr.Err = fmt.Sprintf("reset_method: %v: no reset this kernel can do", err)
			return rr
		}
		rr.Methods = strings.TrimSpace(string(b))
		if rr.Methods == "" {
			rr.Err = "reset_method is empty: no reset this kernel can do"
			return rr
		}
	}
	if err := ctx.Err(); err != nil {
		rr.Err = "not reset: " + err.Error()
		return rr
	}
	if err := sys.WriteFile(path.Join(dir, "reset"), []byte("1")); err != nil {
		rr.Err = "reset: " + err.Error()
	}
	return rr
}

// ErrNoController is an NVMe function the nvme driver holds without a controller.
var ErrNoController = errors.New("no nvme controller under the function")
