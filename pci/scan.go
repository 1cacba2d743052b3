package pci

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Tree is every PCI function of a node, linked into the bridge hierarchy.
type Tree struct {
	Root     string    // the scanned root ("/" on a live node); "" for a dump
	Devices  []*Device // every function, in address order
	Roots    []*Device // functions on root buses (no parent bridge), in address order
	Problems []string  // what could not be read at the tree level (vanished functions, ...)

	byAddr map[Address]*Device
}

// Lookup returns the function at a, or nil.
func (t *Tree) Lookup(a Address) *Device { return t.byAddr[a] }

// Groups returns the functions of each IOMMU group.
func (t *Tree) Groups() map[int][]*Device {
	g := map[int][]*Device{}
	for _, d := range t.Devices {
		if d.IOMMUGroup >= 0 {
			g[d.IOMMUGroup] = append(g[d.IOMMUGroup], d)
		}
	}
	return g
}

// Err joins the problems of the tree and of every function, or returns nil.
func (t *Tree) Err() error {
	var errs []error
	for _, p := range t.Problems {
		errs = append(errs, errors.New(p))
	}
	for _, d := range t.Devices {
		if err := d.Err(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// DevicesDir is where the kernel lists PCI functions, relative to the scan root.
const DevicesDir = "sys/bus/pci/devices"

// Scan reads every PCI function under root/sys/bus/pci/devices. root is "/" on a live
// node, or any directory holding a copy (a synthetic tree, an unpacked snapshot). Only a
// missing or unreadable devices directory is an error; what cannot be read about one
// function is recorded in its Problems and the scan goes on.
func Scan(root string) (*Tree, error) {
	if root == "" {
		root = "/"
	}
	dir := filepath.Join(root, DevicesDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("pci scan %s: %w", dir, err)
	}
	t := &Tree{Root: root}
	parents := map[Address]Address{}
	for _, e := range ents {
		a, err := ParseAddress(e.Name())
		if err != nil {
			t.Problems = append(t.Problems, fmt.Sprintf("%s: not a PCI address, skipped", e.Name()))
			continue
		}
		d, parent, err := readDevice(root, a)
		if err != nil {
			t.Problems = append(t.Problems, err.Error())
			continue
		}
		if parent != nil {
			parents[a] = *parent
		}
		t.Devices = append(t.Devices, d)
	}
	t.link(parents)
	return t, nil
}

// NewTree links functions read from elsewhere (a dump) into a tree; a function's parent
// is the bridge whose secondary bus it sits on.
func NewTree(devs []*Device) *Tree {
	t := &Tree{Devices: devs}
	t.link(nil)
	return t
}

// link sorts the functions and connects parents: from the sysfs path where it named one,
// else from the bridges' bus numbers (how lspci -t rebuilds a tree from a dump).
func (t *Tree) link(parents map[Address]Address) {
	sort.Slice(t.Devices, func(i, j int) bool { return t.Devices[i].Addr.Less(t.Devices[j].Addr) })
	t.byAddr = make(map[Address]*Device, len(t.Devices))
	type busKey struct {
		domain uint16
		bus    uint8
	}
	bridgeFor := map[busKey]*Device{}
	for _, d := range t.Devices {
		t.byAddr[d.Addr] = d
		if d.IsBridge() && d.SecondaryBus != 0 {
			k := busKey{d.Addr.Domain, d.SecondaryBus}
			if _, dup := bridgeFor[k]; !dup {
				bridgeFor[k] = d
			}
		}
	}
	t.Roots = t.Roots[:0]
	for _, d := range t.Devices {
		d.Parent, d.Children = nil, nil
	}
	for _, d := range t.Devices {
		if pa, ok := parents[d.Addr]; ok {
			d.Parent = t.byAddr[pa]
			if d.Parent == nil {
				d.problem("parent %s named by the sysfs path is missing", pa)
			}
		} else if parents == nil || d.SysPath == "" {
			if b := bridgeFor[busKey{d.Addr.Domain, d.Addr.Bus}]; b != nil && b != d {
				d.Parent = b
			}
		}
		if d.Parent != nil {
			d.Parent.Children = append(d.Parent.Children, d)
		} else {
			t.Roots = append(t.Roots, d)
		}
	}
}

// readDevice reads one function. The error return is for a function that is gone (its
// directory vanished between listing and reading); everything else becomes a problem.
func readDevice(root string, a Address) (*Device, *Address, error) {
	d := &Device{Addr: a, NUMANode: -1, IOMMUGroup: -1}
	link := filepath.Join(root, DevicesDir, a.String())
	dir := link
	var parent *Address
	if target, err := os.Readlink(link); err == nil {
		// /sys/bus/pci/devices/<bdf> -> ../../../devices/pci0000:00/0000:00:01.0/<bdf>
		rel := path.Clean(path.Join(DevicesDir, filepath.ToSlash(target)))
		if strings.HasPrefix(rel, "../") {
			d.problem("sysfs link %s points outside the root", target)
		} else {
			d.SysPath = "/" + rel
			dir = filepath.Join(root, filepath.FromSlash(rel))
			if pa, err := ParseAddress(path.Base(path.Dir(rel))); err == nil {
				parent = &pa
			}
		}
	} else if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("%s: vanished during scan", a)
	}

	cfg, err := os.ReadFile(filepath.Join(dir, "config"))
	switch {
	case err == nil:
		d.Config = cfg
		d.decodeConfig()
	case errors.Is(err, fs.ErrNotExist):
		if _, serr := os.Stat(dir); errors.Is(serr, fs.ErrNotExist) {
			return nil, nil, fmt.Errorf("%s: vanished during scan", a)
		}
		d.problem("config: %v", unwrapPath(err))
		d.readIDFiles(dir)
	default:
		d.problem("config: %v", unwrapPath(err))
		d.readIDFiles(dir)
	}

	if s, ok := d.readText(dir, "numa_node"); ok {
		if n, err := strconv.Atoi(s); err == nil {
			d.NUMANode = n
		} else {
			d.problem("numa_node: malformed %q", s)
		}
	}
	if s, ok := d.readLinkBase(dir, "driver"); ok {
		d.Driver = s
	}
	if s, ok := d.readText(dir, "driver_override"); ok && s != "(null)" {
		d.DriverOverride = s
	}
	if s, ok := d.readLinkBase(dir, "iommu_group"); ok {
		if n, err := strconv.Atoi(s); err == nil {
			d.IOMMUGroup = n
		} else {
			d.problem("iommu_group: malformed link %q", s)
		}
	}
	// Reading vpd makes the kernel talk to the device (and can be slow on some), so it is
	// read only where config space advertises a VPD capability.
	if Find(d.Caps, CapVPD) != 0 {
		if b, err := os.ReadFile(filepath.Join(dir, "vpd")); err == nil {
			v, perr := ParseVPD(b)
			d.VPD = v
			if perr != nil {
				d.problem("%v", perr)
			}
		} else if !errors.Is(err, fs.ErrNotExist) {
			d.problem("vpd: %v", unwrapPath(err))
		}
	}
	return d, parent, nil
}

// readIDFiles is the fallback when config space cannot be read: the kernel's own text
// files still name the function.
func (d *Device) readIDFiles(dir string) {
	for _, f := range []struct {
		name string
		set  func(uint64)
	}{
		{"vendor", func(v uint64) { d.VendorID = uint16(v) }},
		{"device", func(v uint64) { d.DeviceID = uint16(v) }},
		{"subsystem_vendor", func(v uint64) { d.SubsystemVendor = uint16(v) }},
		{"subsystem_device", func(v uint64) { d.SubsystemDevice = uint16(v) }},
		{"class", func(v uint64) { d.Class = uint32(v) }},
		{"revision", func(v uint64) { d.Revision = uint8(v) }},
	} {
		s, ok := d.readText(dir, f.name)
		if !ok {
			continue
		}
		v, err := strconv.ParseUint(strings.TrimPrefix(s, "0x"), 16, 32)
		if err != nil {
			d.problem("%s: malformed %q", f.name, s)
			continue
		}
		f.set(v)
	}
}

// readText reads a one-line sysfs attribute. A missing file is not a problem (optional
// attributes come and go with kernel versions); an unreadable one is.
func (d *Device) readText(dir, name string) (string, bool) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			d.problem("%s: %v", name, unwrapPath(err))
		}
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}

func (d *Device) readLinkBase(dir, name string) (string, bool) {
	t, err := os.Readlink(filepath.Join(dir, name))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			d.problem("%s: %v", name, unwrapPath(err))
		}
		return "", false
	}
	return path.Base(filepath.ToSlash(t)), true
}

// unwrapPath drops the *PathError's path (the message already names the device and the
// file) so the problem does not carry the scan root.
func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
