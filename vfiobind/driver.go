package vfiobind

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/passage-boot/passage/pci"
)

// AttrReader reads a sysfs attribute; a Sysfs that implements it lets a caller read
// what the kernel offers (reset_method) through the same root as its writes.
type AttrReader interface {
	ReadFile(name string) ([]byte, error)
}

// maxAttr bounds an attribute read: sysfs shows at most a page.
const maxAttr = 4096

// ReadFile reads an attribute beneath the root, a regular file only, bounded.
func (r Root) ReadFile(name string) ([]byte, error) {
	f, err := pci.OpenAttr(r.dir(), name, os.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, maxAttr))
}

// Driver returns the driver bound to the function: "" when none.
func Driver(sys Sysfs, a pci.Address) (string, error) { return currentDriver(sys, a) }

// BindDriver moves one function to drv the way binding moves it to vfio-pci: the
// override first (so from the moment its driver lets go only drv can match), unbind the
// driver it has, drivers_probe, then wait for the driver link to name drv. It is for a
// host driver a step needs for a while (nvme, to erase through it); the caller moves the
// function on (Unbind, then Bind) when done.
func BindDriver(ctx context.Context, sys Sysfs, a pci.Address, drv string, opts Options) (fr FunctionReport, err error) {
	opts = opts.withDefaults()
	start := opts.Clock.Now()
	fr = FunctionReport{Addr: a, Group: -1}
	defer func() {
		if err != nil {
			fr.Err = err.Error()
		}
		if d, rerr := currentDriver(sys, a); rerr == nil {
			fr.DriverAfter = d
		}
		fr.Duration = opts.Clock.Now().Sub(start)
	}()
	before, err := currentDriver(sys, a)
	if err != nil {
		return fr, err
	}
	fr.DriverBefore = before
	if _, err := steer(ctx, sys, &fr, a, before, drv); err != nil {
		return fr, err
	}
	return fr, verify(ctx, sys, a, drv, "", opts)
}

// Park takes a function off whatever driver holds it and sets its override to override,
// so nothing but that driver can claim it until someone probes it (a function between
// two steps: erased, not yet bound to vfio-pci). It checks the function ended unbound.
func Park(ctx context.Context, sys Sysfs, a pci.Address, override string, opts Options) (fr FunctionReport, err error) {
	opts = opts.withDefaults()
	start := opts.Clock.Now()
	fr = FunctionReport{Addr: a, Group: -1}
	defer func() {
		if err != nil {
			fr.Err = err.Error()
		}
		fr.Duration = opts.Clock.Now().Sub(start)
	}()
	before, err := currentDriver(sys, a)
	if err != nil {
		return fr, err
	}
	fr.DriverBefore = before
	var errs []error
	// A failed override does not stop the unbind: off its driver with no override is
	// still better than on it.
	if err := write(ctx, sys, &fr, devPath(a, "driver_override"), override); err != nil {
		errs = append(errs, fmt.Errorf("%s: write driver_override: %w", a, err))
	}
	if before != "" {
		if err := write(ctx, sys, &fr, driverPath(before, "unbind"), a.String()); err != nil {
			errs = append(errs, fmt.Errorf("%s: unbind %s: %w", a, before, err))
		}
	}
	after, err := currentDriver(sys, a)
	if err != nil {
		return fr, errors.Join(append(errs, err)...)
	}
	fr.DriverAfter = after
	if after != "" {
		errs = append(errs, errors.New(a.String()+": still bound to "+after+" after unbind"))
	}
	return fr, errors.Join(errs...)
}
