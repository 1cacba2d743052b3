package boot

import (
	"context"
	"fmt"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/vfiobind"
)

// nvmeReady bounds the wait for the nvme driver to bring a controller live and scan its
// namespaces once the function is bound to it.
const nvmeReady = 30 * time.Second

func (b *Boot) eraseResult() *erase.Report {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.EraseRun
}

// erase erases the NVMe of every unit the ACS stage left passable and resets every one
// of their functions (package erase), before the vfio stage binds them. It only
// reports: the decision folds the report into the verdicts (a unit it does not cover,
// because this stage failed or ran out of time, is failed under passage.erase=require),
// and the vfio stage binds only what Bindable allows.
func (b *Boot) erase(ctx context.Context, _ *stages.State, r *stages.Result) error {
	d, acsRun, _ := b.results()
	if !d.Erase.Active() {
		return stages.Skip("passage.erase=off")
	}
	if b.DryRun {
		return stages.Skip("dry run")
	}
	units := d.ErasePlan(acsRun)
	r.Findingf("policy %s: %d units", d.Erase, len(units))
	var sys vfiobind.Sysfs = vfiobind.Root(b.Root)
	if b.Sysfs != nil {
		sys = b.Sysfs
	}
	b.guardNVMe(ctx, sys, r)
	// Whatever the erase did, no unit's NVMe is left on nvme at the end of the stage.
	defer b.guardNVMe(context.WithoutCancel(ctx), sys, r)
	if b.OpenNVMe == nil {
		if err := b.openModules(); err != nil {
			r.Degrade("nvme driver: %v", err)
		} else if failed := b.loadModules(r, []string{erase.NVMeDriver}); len(failed) > 0 {
			// Built in, or not there: the erase of each NVMe says which.
			r.Degrade("nvme driver: module did not load")
		}
	}
	open := b.OpenNVMe
	if open == nil {
		open = erase.DeviceOpener(b.Root, nvmeReady)
	}
	// A sanitize can run for hours: each console tick says which NVMe is at which step,
	// with the controller's own progress (SPROG) while it sanitizes.
	progress := &erase.Progress{}
	waited := r.WaitOn(func() string {
		if p := progress.String(); p != "" {
			return "the erase: " + p
		}
		return ""
	})
	rep := erase.Run(ctx, sys, d.Labels, units, open, erase.RunOptions{Erase: erase.Options{Overwrite: b.Config.EraseOverwrite}, Progress: progress})
	waited()
	for _, u := range rep.Units {
		for _, n := range u.NVMe {
			if n.Erased() {
				r.Changef("%s %s (%s, serial %s): %s, %d LBAs read back clean, %s", n.Addr, n.Controller, n.Model, n.Serial,
					n.Method, n.VerifiedLBAs, n.Duration.Round(time.Millisecond))
			}
		}
		for _, rr := range u.Resets {
			if rr.Err == "" {
				r.Changef("%s: reset (reset_method: %s)", rr.Addr, rr.Methods)
			}
		}
		for _, p := range u.Problems() {
			r.Degrade("unit %s: %s", UnitID(u.ID), p)
		}
	}
	if !b.commit(ctx, func() { b.EraseRun = rep }) {
		return fmt.Errorf("erase: %w", ctx.Err())
	}
	return nil
}

// PassthroughAddrs are the addresses of every function of every unit, whatever its
// verdict: the handoff never takes a block device below one of them for the root (a
// tenant's disk carries whatever identity the tenant wrote on it). Nil before a decision.
func (b *Boot) PassthroughAddrs() []string {
	d, _, _ := b.results()
	if d == nil {
		return nil
	}
	var out []string
	for _, u := range d.Units() {
		for _, f := range u.Functions() {
			if f != nil {
				out = append(out, f.Addr.String())
			}
		}
	}
	return out
}

// guardNVMe gives every unit's NVMe, in the erase plan or not, an override only vfio-pci
// matches, before the nvme driver is loaded: the driver probes every controller without
// one when it loads, and a unit's NVMe on it is a tenant's disk the host can mount. The
// erase moves its own controllers to nvme and back by name.
func (b *Boot) guardNVMe(ctx context.Context, sys vfiobind.Sysfs, r *stages.Result) {
	d, _, _ := b.results()
	if d == nil {
		return
	}
	for _, u := range d.Units() {
		for _, n := range u.NVMe {
			drv, err := vfiobind.Driver(sys, n.Addr)
			if err == nil && drv == vfiobind.VFIODriver {
				continue // already the guest's
			}
			if fr, err := vfiobind.Park(ctx, sys, n.Addr, vfiobind.VFIODriver, vfiobind.Options{}); err != nil {
				r.Degrade("unit %s: %s: not kept off nvme: %v", UnitID(u.ID), n.Addr, err)
			} else if fr.DriverBefore != "" {
				r.Changef("%s: %s -> (none), override %s", n.Addr, fr.DriverBefore, vfiobind.VFIODriver)
			}
		}
	}
}
