package pci

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
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
	return scanner{root: root}.scan()
}

// readKind says what a scan read: a file's bytes, a link's target, or (for a function
// whose files are missing) a directory's existence.
type readKind int

const (
	readFile readKind = iota
	readLink
	readDir
)

// scanner reads a sysfs root. seen, when set, is told of every successful read with the
// path relative to the root (slash-separated) and the bytes or link target it got: the
// snapshot writer captures exactly those, and the benchmark counts them.
type scanner struct {
	root string
	seen func(rel string, kind readKind, data []byte)
	st   *scanState
}

func (s scanner) note(rel string, kind readKind, data []byte) {
	if s.seen != nil {
		s.seen(rel, kind, data)
	}
}

// scanState is what the copies of a scanner share: a read buffer, and the directory the
// last read was in, held open so that a function's attributes are opened relative to it
// (openat) instead of walking its deep /sys/devices path once per file.
type scanState struct {
	buf   []byte
	dir   string
	dirfd int
}

func (st *scanState) close() {
	if st.dir != "" {
		unix.Close(st.dirfd)
		st.dir = ""
	}
}

// at returns a descriptor for the directory holding rel and rel's last element.
func (s scanner) at(rel string) (int, string, string, error) {
	dir, name := path.Split(rel)
	full := filepath.Join(s.root, filepath.FromSlash(rel))
	if s.st.dir != dir || dir == "" {
		s.st.close()
		fd, err := unix.Open(filepath.Join(s.root, filepath.FromSlash(dir)), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, "", full, err
		}
		s.st.dir, s.st.dirfd = dir, fd
	}
	return s.st.dirfd, name, full, nil
}

// readFile reads a whole sysfs attribute with openat, read and close alone: os.ReadFile
// adds an fstat, fcntls and a poller registration per file, and a path walk from the
// root, which together more than double the cost of a scan.
func (s scanner) readFile(rel string) ([]byte, error) {
	dirfd, name, full, err := s.at(rel)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: full, Err: err}
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: full, Err: err}
	}
	defer unix.Close(fd)
	b := s.st.buf[:0]
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := unix.Read(fd, b[len(b):cap(b)])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			s.st.buf = b
			return nil, &fs.PathError{Op: "read", Path: full, Err: err}
		}
		if n == 0 {
			break
		}
		b = b[:len(b)+n]
	}
	s.st.buf = b
	out := append([]byte(nil), b...)
	s.note(rel, readFile, out)
	return out, nil
}

func (s scanner) readlink(rel string) (string, error) {
	dirfd, name, full, err := s.at(rel)
	if err != nil {
		return "", &fs.PathError{Op: "readlink", Path: full, Err: err}
	}
	var buf [512]byte
	n, err := unix.Readlinkat(dirfd, name, buf[:])
	if err != nil {
		return "", &fs.PathError{Op: "readlink", Path: full, Err: err}
	}
	t := string(buf[:n])
	if n == len(buf) {
		// Possibly truncated: fall back to the growing reader.
		if t, err = os.Readlink(full); err != nil {
			return "", err
		}
	}
	s.note(rel, readLink, []byte(t))
	return t, nil
}

func (s scanner) statDir(rel string) error {
	_, err := os.Stat(filepath.Join(s.root, filepath.FromSlash(rel)))
	if err == nil {
		s.note(rel, readDir, nil)
	}
	return err
}

func (s scanner) scan() (*Tree, error) {
	if s.root == "" {
		s.root = "/"
	}
	if s.st == nil {
		s.st = &scanState{buf: make([]byte, 0, 2*ExtendedSize)}
	}
	defer s.st.close()
	dir := filepath.Join(s.root, DevicesDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("pci scan %s: %w", dir, unwrapPath(err))
	}
	s.note(DevicesDir, readDir, nil)
	t := &Tree{Root: s.root}
	parents := map[Address]Address{}
	for _, e := range ents {
		a, err := ParseAddress(e.Name())
		if err != nil {
			t.Problems = append(t.Problems, fmt.Sprintf("%s: not a PCI address, skipped", e.Name()))
			continue
		}
		d, parent, err := s.readDevice(a)
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
	}
	// Bad bus numbers in a dump (or crafted links in a snapshot) can make two bridges
	// each other's parent; everything that walks up the tree relies on it ending.
	for _, d := range t.Devices {
		steps := 0
		for p := d.Parent; p != nil && steps <= len(t.Devices); p = p.Parent {
			if p == d {
				d.problem("parent %s is its own descendant, unlinked", d.Parent.Addr)
				d.Parent = nil
				break
			}
			steps++
		}
	}
	for _, d := range t.Devices {
		if d.Parent != nil {
			d.Parent.Children = append(d.Parent.Children, d)
		} else {
			t.Roots = append(t.Roots, d)
		}
	}
}

// readDevice reads one function. The error return is for a function that is gone (its
// directory vanished between listing and reading); everything else becomes a problem.
func (s scanner) readDevice(a Address) (*Device, *Address, error) {
	d := &Device{Addr: a, NUMANode: -1, IOMMUGroup: -1}
	link := path.Join(DevicesDir, a.String())
	dir := link
	var parent *Address
	if target, err := s.readlink(link); err == nil {
		// /sys/bus/pci/devices/<bdf> -> ../../../devices/pci0000:00/0000:00:01.0/<bdf>
		rel := path.Clean(path.Join(DevicesDir, filepath.ToSlash(target)))
		if path.IsAbs(target) || strings.HasPrefix(rel, "../") || rel == ".." {
			d.problem("sysfs link %s points outside the root", target)
		} else {
			d.SysPath = "/" + rel
			dir = rel
			if pa, err := ParseAddress(path.Base(path.Dir(rel))); err == nil {
				parent = &pa
			}
		}
	} else if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("%s: vanished during scan", a)
	}

	cfg, err := s.readFile(path.Join(dir, "config"))
	switch {
	case err == nil:
		d.Config = cfg
		d.decodeConfig()
		// An SR-IOV VF's Vendor and Device ID registers read 0xffff (SR-IOV 1.1 3.4.1.1);
		// the kernel's files hold the IDs it took from the PF, as lspci shows them.
		if d.VendorID == 0xffff && d.DeviceID == 0xffff {
			s.readIDFiles(d, dir, "vendor", "device")
		}
	case errors.Is(err, fs.ErrNotExist):
		if serr := s.statDir(dir); errors.Is(serr, fs.ErrNotExist) {
			return nil, nil, fmt.Errorf("%s: vanished during scan", a)
		}
		d.problem("config: %v", unwrapPath(err))
		s.readIDFiles(d, dir)
	default:
		d.problem("config: %v", unwrapPath(err))
		s.readIDFiles(d, dir)
	}

	if v, ok := s.readText(d, dir, "numa_node"); ok {
		if n, err := strconv.Atoi(v); err == nil {
			d.NUMANode = n
		} else {
			d.problem("numa_node: malformed %q", v)
		}
	}
	if v, ok := s.readLinkBase(d, dir, "driver"); ok {
		d.Driver = v
	}
	if v, ok := s.readText(d, dir, "driver_override"); ok && v != "(null)" {
		d.DriverOverride = v
	}
	if v, ok := s.readLinkBase(d, dir, "iommu_group"); ok {
		if n, err := strconv.Atoi(v); err == nil {
			d.IOMMUGroup = n
		} else {
			d.problem("iommu_group: malformed link %q", v)
		}
	}
	// Reading vpd makes the kernel talk to the device (and can be slow on some), so it is
	// read only where config space advertises a VPD capability.
	if Find(d.Caps, CapVPD) != 0 {
		if b, err := s.readFile(path.Join(dir, "vpd")); err == nil {
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
// files still name the function. names limits it to some of them.
func (s scanner) readIDFiles(d *Device, dir string, names ...string) {
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
		if len(names) > 0 && !slices.Contains(names, f.name) {
			continue
		}
		txt, ok := s.readText(d, dir, f.name)
		if !ok {
			continue
		}
		v, err := strconv.ParseUint(strings.TrimPrefix(txt, "0x"), 16, 32)
		if err != nil {
			d.problem("%s: malformed %q", f.name, txt)
			continue
		}
		f.set(v)
	}
}

// readText reads a one-line sysfs attribute. A missing file is not a problem (optional
// attributes come and go with kernel versions); an unreadable one is.
func (s scanner) readText(d *Device, dir, name string) (string, bool) {
	b, err := s.readFile(path.Join(dir, name))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			d.problem("%s: %v", name, unwrapPath(err))
		}
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}

func (s scanner) readLinkBase(d *Device, dir, name string) (string, bool) {
	t, err := s.readlink(path.Join(dir, name))
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
