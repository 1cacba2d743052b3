package vfiobind

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/passage-boot/passage/pci"
)

// CheckWholeGroups refuses a set of functions to release that leaves part of an IOMMU
// group on vfio-pci: a group in use by a guest must not have a member handed to a host
// driver. Bridges in a group do not count. The error names the missing members.
func CheckWholeGroups(tree *pci.Tree, fns []*pci.Device) error {
	in := map[pci.Address]bool{}
	for _, d := range fns {
		in[d.Addr] = true
	}
	groups := tree.Groups()
	done := map[int]bool{}
	var errs []error
	for _, d := range fns {
		g := d.IOMMUGroup
		if g < 0 || done[g] {
			continue
		}
		done[g] = true
		var missing []string
		for _, m := range groups[g] {
			if !in[m.Addr] && !m.IsBridge() && m.Driver == VFIODriver {
				missing = append(missing, m.Addr.String())
			}
		}
		if len(missing) > 0 {
			errs = append(errs, fmt.Errorf("iommu group %d: %s also on %s; release them together", g, strings.Join(missing, ", "), VFIODriver))
		}
	}
	return errors.Join(errs...)
}

// Release returns functions to their host drivers, for maintenance: clear
// driver_override, unbind vfio-pci if it holds the function, and write the BDF to
// drivers_probe so the kernel matches a host driver by ID again. A host driver that is
// not loaded leaves the function unbound, which is reported, not an error. Functions are
// released in address order; one that fails does not stop the others.
func Release(ctx context.Context, sys Sysfs, fns []*pci.Device, opts Options) ([]FunctionReport, error) {
	if sys == nil {
		return nil, errors.New("vfiobind: nil sysfs")
	}
	opts = opts.withDefaults()
	sorted := append([]*pci.Device(nil), fns...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Addr.Less(sorted[j].Addr) })
	var reps []FunctionReport
	var errs []error
	for _, d := range sorted {
		if err := ctx.Err(); err != nil {
			return reps, errors.Join(append(errs, err)...)
		}
		fr, err := releaseFunction(ctx, sys, d, opts)
		reps = append(reps, fr)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return reps, errors.Join(errs...)
}

func releaseFunction(ctx context.Context, sys Sysfs, d *pci.Device, opts Options) (fr FunctionReport, err error) {
	a := d.Addr
	start := opts.Clock.Now()
	fr = FunctionReport{Addr: a, Group: d.IOMMUGroup}
	defer func() {
		if err != nil {
			fr.Err = err.Error()
		}
		if drv, rerr := currentDriver(sys, a); rerr == nil {
			fr.DriverAfter = drv
		}
		fr.Duration = opts.Clock.Now().Sub(start)
	}()
	before, err := currentDriver(sys, a)
	if err != nil {
		return fr, err
	}
	fr.DriverBefore = before
	if err := write(ctx, sys, &fr, devPath(a, "driver_override"), "\n"); err != nil {
		return fr, fmt.Errorf("%s: clear driver_override: %w", a, err)
	}
	switch before {
	case VFIODriver:
		if err := write(ctx, sys, &fr, driverPath(VFIODriver, "unbind"), a.String()); err != nil {
			return fr, fmt.Errorf("%s: unbind %s: %w", a, VFIODriver, err)
		}
	case "":
	default:
		// Already on a host driver: nothing to hand back.
		return fr, nil
	}
	if err := write(ctx, sys, &fr, driversProbe, a.String()); err != nil {
		return fr, fmt.Errorf("%s: drivers_probe: %w", a, err)
	}
	return fr, nil
}
