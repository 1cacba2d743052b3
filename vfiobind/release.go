package vfiobind

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
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
// drivers_probe so the kernel matches a host driver by ID again. Then it reads the
// function's driver link, since stores that succeed do not say where the function ended
// (drivers_probe succeeds whatever it binds, and vfio-pci may match the function by ID,
// through vfio-pci.ids= or new_id): a function still on vfio-pci, whose link cannot be
// read, or that is gone, is an error. A host driver that is not loaded leaves the
// function unbound, which is reported (DriverAfter ""), not an error. Functions are
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
	checked := false
	defer func() {
		if err != nil {
			fr.Err = err.Error()
			if !checked {
				if drv, rerr := currentDriver(sys, a); rerr == nil {
					fr.DriverAfter = drv
				}
			}
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
		fallthrough
	case "":
		if err := write(ctx, sys, &fr, driversProbe, a.String()); err != nil {
			return fr, fmt.Errorf("%s: drivers_probe: %w", a, err)
		}
	default:
		// Already on a host driver: nothing to hand back, but the link is still checked.
	}
	checked = true
	fr.DriverAfter, err = releasedTo(sys, a)
	return fr, err
}

// releasedTo reads the driver a released function ended on: "" when none (its host
// driver is not loaded). Still vfio-pci, a link that cannot be read, or a function whose
// directory is gone, is an error: the release is not what it claims.
func releasedTo(sys Sysfs, a pci.Address) (string, error) {
	t, err := sys.ReadLink(devPath(a, "driver"))
	switch {
	case errors.Is(err, os.ErrNotExist):
		if serr := sys.Stat(path.Join(pci.DevicesDir, a.String())); serr != nil {
			return "", fmt.Errorf("%s: no driver link after release, and the function itself is not there: %w", a, serr)
		}
		return "", nil
	case err != nil:
		return "", fmt.Errorf("%s: cannot read its driver link after release, so where it ended is unknown: %w", a, err)
	}
	drv := path.Base(filepath.ToSlash(t))
	if drv == VFIODriver {
		return drv, fmt.Errorf("%s: still on %s after release (vfio-pci.ids= or new_id matching it?)", a, VFIODriver)
	}
	return drv, nil
}
