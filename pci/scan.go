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
	// NoGroups says why the input carries no IOMMU groups at all ("" when it does): an
	// lspci dump holds config space only. A fact about the input, not about the node:
	// no function's group can be judged from it.
	NoGroups string

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

// scanState is what the copies of a scanner share: a read buffer, config space storage,
// the root held open, and two directories held open so that each attribute is opened
// relative to a near directory instead of walking the deep /sys/devices path once per
// file: the devices listing (every function's link is read there) and the parent of the
// last function's directory. A bridge's functions, a PF's VFs, are siblings, so most
// functions are read as "<bdf>/config" and so on relative to a parent already open;
// opening each function's own directory instead costs an open and a close more per
// function.
//
// Everything resolves beneath the root, in the kernel: the held directories are opened
// from the root with openat2 RESOLVE_BENEATH (a link on the way that is absolute or
// climbs out fails), and an attribute is opened from its held directory with
// RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS: neither "<bdf>" nor the attribute may be a
// link, as neither is in sysfs. That is what makes a function's directory exactly the
// one its name says, so that two names cannot read one function.
type scanState struct {
	buf    []byte
	slab   []byte // config space storage: see configSlot
	rootfd int    // O_PATH descriptor of the root; -1 until open
	dirs   [2]heldDir
}

// heldDir is an O_PATH descriptor for dir (slash-separated, relative to the root).
type heldDir struct {
	dir string
	fd  int
}

const (
	heldDevices = iota
	heldParent
)

func (st *scanState) close() {
	for i := range st.dirs {
		if st.dirs[i].dir != "" {
			unix.Close(st.dirs[i].fd)
			st.dirs[i] = heldDir{}
		}
	}
	if st.rootfd >= 0 {
		unix.Close(st.rootfd)
		st.rootfd = -1
	}
}

// hold returns a descriptor for dir in slot, opening it (and closing what the slot held)
// unless the slot holds it already.
func (s scanner) hold(slot int, dir string) (int, error) {
	h := &s.st.dirs[slot]
	if h.dir == dir {
		return h.fd, nil
	}
	fd, err := openat2(s.st.rootfd, dir, unix.O_PATH|unix.O_DIRECTORY, unix.RESOLVE_BENEATH)
	if err != nil {
		return -1, err
	}
	if h.dir != "" {
		unix.Close(h.fd)
	}
	*h = heldDir{dir, fd}
	return fd, nil
}

// at returns a directory descriptor and a path relative to it for rel: a function's
// attribute is "<bdf>/<attr>" relative to the function's parent directory.
func (s scanner) at(rel string) (int, string, error) {
	dir, name := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if dir == DevicesDir {
		fd, err := s.hold(heldDevices, dir)
		return fd, name, err
	}
	parent, base := path.Split(dir)
	parent = strings.TrimSuffix(parent, "/")
	switch parent {
	case "":
		return s.st.rootfd, rel, nil
	case DevicesDir:
		// A function read through its link (the link could not be resolved).
		fd, err := s.hold(heldDevices, parent)
		return fd, base + "/" + name, err
	}
	fd, err := s.hold(heldParent, parent)
	return fd, base + "/" + name, err
}

func (s scanner) full(rel string) string { return filepath.Join(s.root, filepath.FromSlash(rel)) }

// pageSize is the most a kernfs (sysfs) file hands out per read; a read that returns less
// ended the file, as it does for a regular file (a snapshot, a synthetic tree).
const pageSize = 4096

// readFile reads a sysfs attribute into dst (from its length) with openat2, fstat, read
// and close alone: os.ReadFile adds fcntls and a poller registration per file, and a path
// walk from the root, which together more than double the cost of a scan. The fstat is
// openAttr's: what is not a regular file is never read (see openAttr). It stops at
// limit bytes, at a short read when short is set (sysfs text attributes and config space
// come whole in one read: the extra read that would return 0 is a syscall per file), or
// at EOF. The bytes are dst's: a caller passing the scan's shared buffer copies what it keeps.
func (s scanner) readFile(rel string, dst []byte, limit int, short bool) ([]byte, error) {
	dirfd, name, err := s.at(rel)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: s.full(rel), Err: err}
	}
	fd, err := openAttr(dirfd, name, unix.O_RDONLY, unix.RESOLVE_BENEATH|unix.RESOLVE_NO_SYMLINKS)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: s.full(rel), Err: err}
	}
	defer unix.Close(fd)
	b := dst
	for len(b) < limit {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		want := min(cap(b), limit) - len(b)
		n, err := unix.Read(fd, b[len(b):len(b)+want])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &fs.PathError{Op: "read", Path: s.full(rel), Err: err}
		}
		b = b[:len(b)+n]
		if n == 0 || short && n < want && n < pageSize {
			break
		}
	}
	if s.seen != nil {
		s.note(rel, readFile, append([]byte(nil), b...))
	}
	return b, nil
}

// configSlot returns an empty slice with room for one function's config space, cut from
// a slab shared by the functions of a scan (one allocation per 64 functions, not one each).
func (st *scanState) configSlot() []byte {
	if len(st.slab) < ExtendedSize {
		st.slab = make([]byte, 64*ExtendedSize)
	}
	b := st.slab[:0:ExtendedSize]
	st.slab = st.slab[ExtendedSize:]
	return b
}

func (s scanner) readlink(rel string) (string, error) {
	dirfd, name, err := s.at(rel)
	if err != nil {
		return "", &fs.PathError{Op: "readlink", Path: s.full(rel), Err: err}
	}
	var arr [512]byte
	buf := arr[:]
	for {
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", &fs.PathError{Op: "readlink", Path: s.full(rel), Err: err}
		}
		if n < len(buf) {
			t := string(buf[:n])
			if s.seen != nil {
				s.note(rel, readLink, []byte(t))
			}
			return t, nil
		}
		if len(buf) >= 1<<16 {
			return "", &fs.PathError{Op: "readlink", Path: s.full(rel), Err: unix.ENAMETOOLONG}
		}
		buf = make([]byte, 2*len(buf)) // possibly truncated: again, with room
	}
}

// checkDir checks that rel is a directory beneath the root whose last step is not a
// link, as a function's directory in sysfs is; it is the error path of a function whose
// config could not be read, and tells a function that is gone (fs.ErrNotExist) from one
// whose directory is not its own (errOutsideRoot, ELOOP: a link, ENOTDIR).
func (s scanner) checkDir(rel string) error {
	dirfd, name, err := s.at(rel + "/.")
	if err == nil {
		var fd int
		fd, err = openat2(dirfd, name, unix.O_PATH|unix.O_DIRECTORY, unix.RESOLVE_BENEATH|unix.RESOLVE_NO_SYMLINKS)
		if err == nil {
			unix.Close(fd)
			s.note(rel, readDir, nil)
			return nil
		}
	}
	return &fs.PathError{Op: "open", Path: s.full(rel), Err: err}
}

func (s scanner) scan() (*Tree, error) {
	if s.root == "" {
		s.root = "/"
	}
	if s.st == nil {
		s.st = &scanState{buf: make([]byte, 0, 2*ExtendedSize), rootfd: -1}
	}
	defer s.st.close()
	dir := filepath.Join(s.root, DevicesDir)
	names, err := s.list()
	if err != nil {
		return nil, fmt.Errorf("pci scan %s: %w", dir, unwrapPath(err))
	}
	s.note(DevicesDir, readDir, nil)
	t := &Tree{Root: s.root}
	fns := s.resolve(t, names)
	parents := map[Address]Address{}
	var vfs []pendingVF
	for i := range fns {
		f := &fns[i]
		d, vfDir, err := s.readDevice(f)
		if err != nil {
			t.Problems = append(t.Problems, err.Error())
			continue
		}
		if f.parent != nil {
			parents[f.addr] = *f.parent
		}
		if vfDir != "" {
			vfs = append(vfs, pendingVF{d, vfDir})
		}
		t.Devices = append(t.Devices, d)
	}
	s.vfIDs(t.Devices, vfs)
	t.link(parents)
	return t, nil
}

// list opens the root and returns the names in its devices directory, sorted.
func (s scanner) list() ([]string, error) {
	rfd, err := unix.Open(s.root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	s.st.rootfd = rfd
	fd, err := openat2(rfd, DevicesDir, unix.O_RDONLY|unix.O_DIRECTORY, unix.RESOLVE_BENEATH)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), filepath.Join(s.root, DevicesDir))
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	slices.Sort(names)
	return names, nil
}

// listed is a function as the devices directory names it, and the directory (relative to
// the root) its link resolves to.
type listed struct {
	addr    Address
	name    string   // the entry's name: addr, as the kernel spells it
	dir     string   // the function's directory, relative to the root
	sysPath string   // "/" + dir when dir came from the link
	parent  *Address // the bridge the link's path puts it below
}

// resolve reads the link of every entry of the devices directory and keeps the entries
// that name one function each: an entry that is not the kernel's spelling of a PCI
// address ("f2:00.0", "0000:F2:00.0"), whose link leads outside the root, or that
// leads to the directory of another function (the kernel names a function's directory
// as its entry) is a tree problem, not a function. A function can so be read once only.
func (s scanner) resolve(t *Tree, names []string) []listed {
	fns := make([]listed, 0, len(names))
	misnamed := false
	for _, name := range names {
		a, err := ParseAddress(name)
		if err != nil {
			t.Problems = append(t.Problems, fmt.Sprintf("%s: not a PCI address, skipped", name))
			continue
		}
		if c := a.String(); c != name {
			t.Problems = append(t.Problems, fmt.Sprintf("%s: not the kernel's name for %s, skipped", name, c))
			continue
		}
		f := listed{addr: a, name: name, dir: DevicesDir + "/" + name}
		if target, err := s.readlink(f.dir); err == nil {
			// /sys/bus/pci/devices/<bdf> -> ../../../devices/pci0000:00/0000:00:01.0/<bdf>
			rel := path.Clean(path.Join(DevicesDir, filepath.ToSlash(target)))
			if path.IsAbs(target) || strings.HasPrefix(rel, "../") || rel == ".." {
				t.Problems = append(t.Problems, fmt.Sprintf("%s: sysfs link %s points outside the root, not read", name, target))
				continue
			}
			f.dir, f.sysPath = rel, "/"+rel
			if pa, err := ParseAddress(path.Base(path.Dir(rel))); err == nil {
				f.parent = &pa
			}
		} else if errors.Is(err, fs.ErrNotExist) {
			t.Problems = append(t.Problems, fmt.Sprintf("%s: vanished during scan", a))
			continue
		}
		misnamed = misnamed || path.Base(f.dir) != name
		fns = append(fns, f)
	}
	if !misnamed {
		return fns
	}
	dirOf := make(map[string]string, len(fns))
	for _, f := range fns {
		dirOf[f.name] = f.dir
	}
	kept := fns[:0]
	for _, f := range fns {
		base := path.Base(f.dir)
		switch {
		case base == f.name:
			kept = append(kept, f)
		case dirOf[base] == f.dir:
			t.Problems = append(t.Problems, fmt.Sprintf("%s: resolves to /%s, as %s does: one function, read as %s", f.name, f.dir, base, base))
		default:
			t.Problems = append(t.Problems, fmt.Sprintf("%s: sysfs link leads to /%s, a directory not named %s, not read", f.name, f.dir, f.name))
		}
	}
	return kept
}

// pendingVF is a function whose Vendor and Device ID registers read 0xffff, as an SR-IOV
// VF's do (SR-IOV 1.1 3.4.1.1), and the sysfs directory to read its IDs from.
type pendingVF struct {
	d   *Device
	dir string
}

// vfIDs names the VFs the way the kernel does when it creates them (pci_iov_add_virtfn:
// the PF's Vendor ID, and the VF Device ID from the PF's SR-IOV capability), for every
// VF whose routing ID one of the PFs' SR-IOV capabilities accounts for (First VF Offset,
// VF Stride, NumVFs). That is what the kernel's vendor and device files say, without two
// reads per VF; a VF no PF accounts for has its files read.
func (s scanner) vfIDs(devs []*Device, vfs []pendingVF) {
	if len(vfs) == 0 {
		return
	}
	type ids struct{ vendor, device uint16 }
	byRID := map[Address]ids{}
	for _, pf := range devs {
		if pf.VendorID == 0xffff {
			continue
		}
		for _, a := range pf.VFs() {
			byRID[a] = ids{pf.VendorID, pf.SRIOV.VFDeviceID}
		}
	}
	for _, p := range vfs {
		if id, ok := byRID[p.d.Addr]; ok {
			p.d.VendorID, p.d.DeviceID = id.vendor, id.device
			continue
		}
		s.readIDFiles(p.d, p.dir, "vendor", "device")
		if p.d.VendorID == 0xffff && p.d.DeviceID == 0xffff {
			p.d.problem("ID registers read 0xffff, no PF's SR-IOV capability accounts for it, and its vendor and device files are missing")
		}
	}
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

// maxNUMANodes bounds the NUMA node numbers a kernel can write: MAX_NUMNODES at the largest
// CONFIG_NODES_SHIFT (10).
const maxNUMANodes = 1 << 10

// readDevice reads one function. The error return is for a function that is not read: it
// is gone (its directory vanished between listing and reading), or its directory is not
// its own (it resolves outside the root, or is a link); everything else becomes a
// problem. vfDir is the function's directory when its ID registers read 0xffff (a VF):
// the scan names it once it has read the PFs.
func (s scanner) readDevice(f *listed) (d *Device, vfDir string, err error) {
	d = &Device{Addr: f.addr, SysPath: f.sysPath, NUMANode: -1, IOMMUGroup: -1}
	dir := f.dir
	cfg, err := s.readFile(dir+"/config", s.st.configSlot(), ExtendedSize, true)
	if err == nil {
		d.Config = cfg
		d.decodeConfig()
		if d.VendorID == 0xffff && d.DeviceID == 0xffff {
			vfDir = dir
		}
	} else {
		// Whether the function is there at all, and its directory its own, is asked
		// here only, where its first file failed: past a config read, neither <bdf>
		// nor anything above it was a link out.
		if derr := s.checkDir(dir); derr != nil {
			return nil, "", s.dirError(f, derr)
		}
		d.problem("config: %v", unwrapPath(err))
		s.readIDFiles(d, dir)
	}

	if v, ok := s.readText(d, dir, "numa_node"); ok {
		n, err := strconv.Atoi(v)
		switch {
		case err != nil:
			d.problem("numa_node: malformed %q", v)
		case n < -1 || n >= maxNUMANodes:
			d.problem("numa_node: %q is not a NUMA node (-1 or 0..%d), taken as none", v, maxNUMANodes-1)
		default:
			d.NUMANode = n
		}
	}
	// resource is where the kernel keeps the sizes it found when it sized each BAR;
	// config space holds addresses only. A kernel always writes it; a tree without it
	// (an older snapshot) has BARs without sizes.
	if b, err := s.readFile(dir+"/resource", s.st.buf[:0], pageSize, true); err == nil {
		d.setResources(string(b))
	} else if !errors.Is(err, fs.ErrNotExist) {
		d.problem("resource: %v", unwrapPath(err))
	}
	if v, ok := s.readLinkBase(d, dir, "driver"); ok {
		d.Driver = v
	}
	if v, ok := s.readText(d, dir, "driver_override"); ok && v != "(null)" {
		d.DriverOverride = v
	}
	if v, ok := s.readLinkBase(d, dir, "iommu_group"); ok {
		if n, ok := groupNumber(v); ok {
			d.IOMMUGroup = n
		} else {
			d.problem("iommu_group: malformed link %q (not a group number), taken as none", v)
		}
	}
	// Reading vpd makes the kernel talk to the device (and can be slow on some), so it is
	// read only where config space advertises a VPD capability.
	if Find(d.Caps, CapVPD) != 0 {
		if b, err := s.readFile(dir+"/vpd", s.st.buf[:0], vpdMaxBytes+1, false); err == nil {
			v, perr := ParseVPD(b)
			d.VPD = v
			if perr != nil {
				d.problem("%v", perr)
			}
		} else if !errors.Is(err, fs.ErrNotExist) {
			d.problem("vpd: %v", unwrapPath(err))
		}
	}
	return d, vfDir, nil
}

// groupNumber parses an IOMMU group's name as the kernel writes it (%d of a group ID,
// which is never negative): digits alone, without a sign or a leading zero.
func groupNumber(v string) (int, bool) {
	if v == "" || len(v) > 1 && v[0] == '0' {
		return 0, false
	}
	for i := 0; i < len(v); i++ {
		if v[i] < '0' || v[i] > '9' {
			return 0, false
		}
	}
	n, err := strconv.ParseInt(v, 10, 32)
	return int(n), err == nil
}

// dirError is the tree problem of a function whose directory checkDir refused.
func (s scanner) dirError(f *listed, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s: vanished during scan", f.addr)
	case errors.Is(err, errOutsideRoot):
		return fmt.Errorf("%s: /%s resolves outside the root, not read", f.name, f.dir)
	case errors.Is(err, unix.ELOOP):
		if t, lerr := s.readlink(f.dir); lerr == nil {
			if rel := path.Join(path.Dir(f.dir), filepath.ToSlash(t)); path.IsAbs(t) || strings.HasPrefix(rel, "../") || rel == ".." {
				return fmt.Errorf("%s: /%s is a link to %s, outside the root, not read", f.name, f.dir, t)
			}
			return fmt.Errorf("%s: /%s is a link to %s, not a directory of its own, not read", f.name, f.dir, t)
		}
		return fmt.Errorf("%s: /%s is a link, not a directory of its own, not read", f.name, f.dir)
	}
	return fmt.Errorf("%s: /%s: %v, not read", f.name, f.dir, unwrapPath(err))
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
	b, err := s.readFile(dir+"/"+name, s.st.buf[:0], pageSize, true)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			d.problem("%s: %v", name, unwrapPath(err))
		}
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}

func (s scanner) readLinkBase(d *Device, dir, name string) (string, bool) {
	t, err := s.readlink(dir + "/" + name)
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
