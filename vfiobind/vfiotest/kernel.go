// Package vfiotest simulates the kernel's side of vfio binding over a synthetic sysfs
// tree (package pcitest): driver_override, a driver's unbind, drivers_probe, the driver
// links, /dev/vfio/<group>, and module loading, with faults to inject. It records every
// write, so a test can prove a device was never touched.
package vfiotest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/passage-boot/passage/pci"
)

// Faults are the failures the kernel simulates.
type Faults struct {
	// UnbindBusy makes unbinding the function from a host driver fail with EBUSY (a
	// driver holding the device).
	UnbindBusy map[pci.Address]bool
	// ProbeErr makes drivers_probe for the function fail with the error while its
	// override names vfio-pci (the host driver still probes, so rollback can work).
	ProbeErr map[pci.Address]error
	// ProbeNoBind makes drivers_probe report success and bind nothing while the
	// override names vfio-pci: what the kernel does when vfio_pci_probe fails.
	ProbeNoBind map[pci.Address]bool
	// ProbeHost makes drivers_probe bind the function's host driver despite the
	// override (a driver that raced vfio-pci to it).
	ProbeHost map[pci.Address]bool
	// NoDevNode keeps /dev/vfio/<group> from appearing for these groups.
	NoDevNode map[int]bool
	// MissingModules are absent from the image: loading them fails.
	MissingModules map[string]bool
	// WriteErr fails a write to the exact path (relative to the root) with the error.
	WriteErr map[string]error
}

// Write is one write the kernel received.
type Write struct {
	Path string // relative to the root
	Data string
}

// Kernel is a simulated kernel over a synthetic tree. It implements vfiobind.Sysfs and
// vfiobind.ModuleLoader.
type Kernel struct {
	Root   string
	Faults Faults

	mu      sync.Mutex
	writes  []Write
	natural map[pci.Address]string // the host driver an ID match picks
	group   map[pci.Address]int
	loaded  map[string]bool
}

const (
	devicesDir = "sys/bus/pci/devices"
	driversDir = "sys/bus/pci/drivers"
	vfio       = "vfio-pci"
)

// New reads the tree under root: each function's driver now is the host driver that
// drivers_probe picks for it later when no override is set.
func New(root string) (*Kernel, error) {
	k := &Kernel{Root: root, natural: map[pci.Address]string{}, group: map[pci.Address]int{}, loaded: map[string]bool{}}
	ents, err := os.ReadDir(filepath.Join(root, devicesDir))
	if err != nil {
		return nil, fmt.Errorf("vfiotest: %w", err)
	}
	for _, e := range ents {
		a, err := pci.ParseAddress(e.Name())
		if err != nil {
			continue
		}
		dir := filepath.Join(root, devicesDir, e.Name())
		if t, err := os.Readlink(filepath.Join(dir, "driver")); err == nil && path.Base(t) != vfio {
			k.natural[a] = path.Base(filepath.ToSlash(t))
		}
		k.group[a] = -1
		if t, err := os.Readlink(filepath.Join(dir, "iommu_group")); err == nil {
			if g, err := strconv.Atoi(path.Base(filepath.ToSlash(t))); err == nil {
				k.group[a] = g
			}
		}
	}
	return k, nil
}

func (k *Kernel) abs(name string) string { return filepath.Join(k.Root, filepath.FromSlash(name)) }

// Writes returns every write received, in order.
func (k *Kernel) Writes() []Write {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]Write(nil), k.writes...)
}

// Touched returns the writes that concern the function: to its own attributes, or
// naming it in a driver's unbind/bind or drivers_probe.
func (k *Kernel) Touched(a pci.Address) []Write {
	var out []Write
	bdf := a.String()
	for _, w := range k.Writes() {
		if strings.Contains(w.Path, "/"+bdf+"/") || strings.TrimSpace(w.Data) == bdf {
			out = append(out, w)
		}
	}
	return out
}

// ResetWrites forgets the writes so far.
func (k *Kernel) ResetWrites() {
	k.mu.Lock()
	k.writes = k.writes[:0]
	k.mu.Unlock()
}

func (k *Kernel) ReadLink(name string) (string, error) { return os.Readlink(k.abs(name)) }

func (k *Kernel) Stat(name string) error {
	_, err := os.Stat(k.abs(name))
	return err
}

func pathErr(op, name string, err error) error { return &fs.PathError{Op: op, Path: name, Err: err} }

// WriteFile is a sysfs store. Like the kernel, it never creates a file.
func (k *Kernel) WriteFile(name string, data []byte) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.writes = append(k.writes, Write{Path: name, Data: string(data)})
	if err := k.Faults.WriteErr[name]; err != nil {
		return pathErr("write", name, err)
	}
	parts := strings.Split(name, "/")
	val := strings.TrimSpace(string(data))
	switch {
	case len(parts) == 6 && strings.HasPrefix(name, devicesDir+"/") && parts[5] == "driver_override":
		a, err := pci.ParseAddress(parts[4])
		if err != nil || !k.exists(a) {
			return pathErr("write", name, syscall.ENOENT)
		}
		// driver_override_store: a trailing newline is dropped, an empty value clears.
		v := strings.TrimSuffix(string(data), "\n")
		if v == "" {
			v = "(null)"
		}
		return os.WriteFile(k.abs(name), []byte(v+"\n"), 0o644)
	case len(parts) == 6 && strings.HasPrefix(name, driversDir+"/") && parts[5] == "unbind":
		drv := parts[4]
		if _, err := os.Stat(k.abs(path.Join(driversDir, drv))); err != nil {
			return pathErr("write", name, syscall.ENOENT)
		}
		a, err := pci.ParseAddress(val)
		if err != nil || !k.exists(a) || k.driver(a) != drv {
			return pathErr("write", name, syscall.ENODEV)
		}
		if drv != vfio && k.Faults.UnbindBusy[a] {
			return pathErr("write", name, syscall.EBUSY)
		}
		return k.unbind(a, drv)
	case name == "sys/bus/pci/drivers_probe":
		a, err := pci.ParseAddress(val)
		if err != nil || !k.exists(a) {
			return pathErr("write", name, syscall.ENODEV)
		}
		if err := k.Faults.ProbeErr[a]; err != nil && k.override(a) == vfio {
			return pathErr("write", name, err)
		}
		return k.probe(a)
	}
	// Any other attribute: a plain store into an existing file.
	f, err := os.OpenFile(k.abs(name), os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return err
	}
	_, werr := f.Write(data)
	return errors.Join(werr, f.Close())
}

func (k *Kernel) exists(a pci.Address) bool {
	_, ok := k.group[a]
	return ok
}

func (k *Kernel) devDir(a pci.Address) (string, error) {
	return filepath.EvalSymlinks(k.abs(path.Join(devicesDir, a.String())))
}

func (k *Kernel) driver(a pci.Address) string {
	t, err := os.Readlink(k.abs(path.Join(devicesDir, a.String(), "driver")))
	if err != nil {
		return ""
	}
	return path.Base(filepath.ToSlash(t))
}

func (k *Kernel) override(a pci.Address) string {
	b, err := os.ReadFile(k.abs(path.Join(devicesDir, a.String(), "driver_override")))
	if err != nil {
		return ""
	}
	if s := strings.TrimSpace(string(b)); s != "(null)" {
		return s
	}
	return ""
}

// probe is device_attach: a bound function stays; otherwise the override names the
// only driver that may match, else the ID match picks the host driver. A probe that
// fails leaves the function unbound and the store still succeeds.
func (k *Kernel) probe(a pci.Address) error {
	if k.driver(a) != "" {
		return nil
	}
	drv := k.override(a)
	if drv == "" || k.Faults.ProbeHost[a] {
		drv = k.natural[a]
	}
	if drv == "" || drv == vfio && k.Faults.ProbeNoBind[a] {
		return nil
	}
	if _, err := os.Stat(k.abs(path.Join(driversDir, drv))); err != nil {
		return nil // driver not registered: nothing matches
	}
	g := k.group[a]
	if drv == vfio && g < 0 {
		return nil // vfio_pci_probe: no iommu group, -EINVAL
	}
	dir, err := k.devDir(a)
	if err != nil {
		return err
	}
	ddir := k.abs(path.Join(driversDir, drv))
	if err := os.Symlink(rel(dir, ddir), filepath.Join(dir, "driver")); err != nil {
		return err
	}
	if err := os.Symlink(rel(ddir, dir), filepath.Join(ddir, a.String())); err != nil {
		return err
	}
	if drv == vfio && !k.Faults.NoDevNode[g] {
		node := k.abs(path.Join("dev/vfio", strconv.Itoa(g)))
		if err := os.MkdirAll(filepath.Dir(node), 0o755); err != nil {
			return err
		}
		if _, err := os.Stat(node); errors.Is(err, fs.ErrNotExist) {
			if err := os.WriteFile(node, nil, 0o600); err != nil {
				return err
			}
		}
	}
	return nil
}

func (k *Kernel) unbind(a pci.Address, drv string) error {
	dir, err := k.devDir(a)
	if err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(dir, "driver")); err != nil {
		return err
	}
	if err := os.Remove(k.abs(path.Join(driversDir, drv, a.String()))); err != nil {
		return err
	}
	if drv != vfio {
		return nil
	}
	// vfio removes the group's node with the last device of the group it held.
	g := k.group[a]
	for o, og := range k.group {
		if og == g && o != a && k.driver(o) == vfio {
			return nil
		}
	}
	err = os.Remove(k.abs(path.Join("dev/vfio", strconv.Itoa(g))))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// Load is module loading: a missing module fails (and leaves the driver unregistered);
// loading vfio-pci registers the driver.
func (k *Kernel) Load(names ...string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var errs []error
	for _, n := range names {
		c := strings.ReplaceAll(n, "-", "_")
		if k.Faults.MissingModules[c] || k.Faults.MissingModules[n] {
			errs = append(errs, fmt.Errorf("kmod %s: no such module in %s", c, "lib/modules"))
			continue
		}
		k.loaded[c] = true
		if c == "vfio_pci" {
			if err := k.register(vfio); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Loaded says whether a module was loaded.
func (k *Kernel) Loaded(name string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.loaded[strings.ReplaceAll(name, "-", "_")]
}

func (k *Kernel) register(drv string) error {
	d := k.abs(path.Join(driversDir, drv))
	if err := os.MkdirAll(d, 0o755); err != nil {
		return err
	}
	for _, f := range []string{"bind", "unbind", "new_id", "remove_id"} {
		if _, err := os.Stat(filepath.Join(d, f)); err != nil {
			if err := os.WriteFile(filepath.Join(d, f), nil, 0o200); err != nil {
				return err
			}
		}
	}
	return nil
}

func rel(from, to string) string {
	r, err := filepath.Rel(from, to)
	if err != nil {
		return to
	}
	return r
}

// ReadFile reads an attribute of the tree (reset_method and the like).
func (k *Kernel) ReadFile(name string) ([]byte, error) { return os.ReadFile(k.abs(name)) }
