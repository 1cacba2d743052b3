// Package pciids names PCI vendors and devices as lspci does: from the same pci.ids file
// (/usr/share/misc/pci.ids on Debian), with the same lookup (vendor, then vendor+device;
// subsystems name only lspci's Subsystem line, which passage does not print), and, for
// what pci.ids does not list, from the same second source, udev's hardware database
// (hwdb.bin, systemd's trie), which libpci consults after pci.ids. A command names the functions of one tree, a few dozen IDs out of the file's
// tens of thousands, so OpenFor reads the file once, front to back, keeps only the names
// asked for and stops as soon as the vendors asked for are behind it; Open reads every
// name, for WriteSubset, which writes the subset an initramfs carries.
package pciids

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// DefaultPath is where Debian's pciutils (and hwdata's symlink) keep the database, and
// where the initramfs puts its subset.
const DefaultPath = "/usr/share/misc/pci.ids"

// maxSize bounds the file read: Debian's pci.ids is about 1.4 MB.
const maxSize = 16 << 20

// DB is a loaded database. The zero of *DB (nil) names nothing: every lookup gives
// empty names, and callers print IDs only.
type DB struct {
	path    string
	hwdb    string
	vendors map[uint16]string
	devices map[uint32]string
	// order keeps the file's order for Subset.
	order []uint16
	byVen map[uint16][]uint16
}

// ID is a function's vendor and device, what OpenFor is asked to name.
type ID struct{ Vendor, Device uint16 }

// Open reads every name of the database at path. A file that is not there is
// fs.ErrNotExist (wrapped); one too large, not a regular file, or not in pci.ids format
// is an error naming it.
func Open(path string) (*DB, error) { return load(path, nil) }

// OpenFor reads the names of ids only: the lookups a command makes for one tree. It
// stops reading at the end of the last block of a vendor in ids (pci.ids lists each
// vendor once, with its devices below it), or at the class section that follows the
// vendors. A malformed line it reads is an error as with Open; lines past where it
// stopped are not read.
func OpenFor(path string, ids []ID) (*DB, error) {
	w := &wanted{devices: map[uint32]bool{}}
	for _, id := range ids {
		if !slices.Contains(w.vendors, id.Vendor) {
			w.vendors = append(w.vendors, id.Vendor)
		}
		w.devices[uint32(id.Vendor)<<16|uint32(id.Device)] = true
	}
	return load(path, w)
}

// wanted is what OpenFor was asked for: a tree's few vendors, searched as a list (a
// lookup per vendor line of the file), and their devices.
type wanted struct {
	vendors []uint16
	devices map[uint32]bool
}

// load reads path; want nil keeps every name, else only the vendors and devices it
// holds.
func load(path string, want *wanted) (*DB, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("pci.ids %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("pci.ids %s: not a regular file", path)
	}
	if fi.Size() > maxSize {
		return nil, fmt.Errorf("pci.ids %s: %d bytes, more than the %d a pci.ids can be", path, fi.Size(), maxSize)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("pci.ids %s: %w", path, err)
	}
	defer f.Close()
	db, err := parse(io.LimitReader(f, maxSize), want)
	if err != nil {
		return nil, fmt.Errorf("pci.ids %s: %w", path, err)
	}
	db.path = path
	return db, nil
}

// maxLine bounds a line, as bufio.Scanner's buffer did.
const maxLine = 64 << 10

// parse reads pci.ids lines from r through one 64 KiB buffer, checking each line it
// interprets as lspci's parser would accept it; with want, the device and subsystem lines
// of vendors not asked for are passed over unread, and reading stops once the vendors
// asked for are behind. The first entry of a vendor or device wins, as in lspci.
func parse(r io.Reader, want *wanted) (*DB, error) {
	db := &DB{vendors: map[uint16]string{}, devices: map[uint32]string{}, byVen: map[uint16][]uint16{}}
	pending := 0 // vendors asked for whose block is not behind us yet
	if want != nil {
		pending = len(want.vendors)
	}
	br := bufio.NewReaderSize(r, maxLine)
	var c checker
	var vendor uint16
	keep := false // the current vendor block is one to keep
	for n := 1; ; n++ {
		l, err := br.ReadSlice('\n')
		switch {
		case err == bufio.ErrBufferFull:
			return nil, fmt.Errorf("line %d: longer than %d bytes", n, maxLine)
		case err == io.EOF && len(l) == 0:
			return db.sorted(), nil
		case err != nil && err != io.EOF:
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		if want != nil && !keep && (l[0] == '\t' || l[0] == '#') {
			continue // a line of a block not asked for
		}
		l = bytes.TrimSuffix(bytes.TrimSuffix(l, []byte("\n")), []byte("\r"))
		kind, lerr := c.line(l)
		if lerr != nil {
			return nil, fmt.Errorf("line %d: %w", n, lerr)
		}
		switch kind {
		case lineVendor, lineClass:
			if keep && want != nil {
				pending--
			}
			if want != nil && (kind == lineClass || pending == 0) {
				// What was asked for is behind us: classes follow the vendors, and their
				// names are not asked for.
				return db.sorted(), nil
			}
			if kind == lineClass {
				keep = false
				continue
			}
			vendor = hex16(l[:4])
			keep = want == nil || slices.Contains(want.vendors, vendor)
			if keep {
				_, seen := db.vendors[vendor]
				keep = !seen
			}
			if keep {
				db.vendors[vendor] = string(bytes.TrimSpace(l[4:]))
				db.order = append(db.order, vendor)
			}
		case lineDevice:
			if !keep {
				continue
			}
			id := hex16(l[1:5])
			key := uint32(vendor)<<16 | uint32(id)
			if want != nil && !want.devices[key] {
				continue
			}
			if _, seen := db.devices[key]; seen {
				continue
			}
			db.devices[key] = string(bytes.TrimSpace(l[5:]))
			db.byVen[vendor] = append(db.byVen[vendor], id)
		}
		if err == io.EOF {
			return db.sorted(), nil
		}
	}
}

// hex16 is four hex digits the checker accepted.
func hex16(b []byte) uint16 {
	var v uint16
	for _, c := range b[:4] {
		switch {
		case c >= 'a':
			c -= 'a' - 10
		case c >= 'A':
			c -= 'A' - 10
		default:
			c -= '0'
		}
		v = v<<4 | uint16(c)
	}
	return v
}

func (db *DB) sorted() *DB {
	for _, ds := range db.byVen {
		slices.Sort(ds)
	}
	return db
}

// NoHwdb, as OpenDefaultFor's hwdb, reads pci.ids alone (lspci -O hwdb.disable=1).
const NoHwdb = "none"

// OpenDefaultFor reads the names of ids as lspci looks them up (libpci's names.c,
// id_lookup): pci.ids first, then, for a vendor or a device it does not list, udev's
// hardware database (hwdb.bin). path "" is DefaultPath; hwdb "" is the one libudev would
// open (DefaultHwdb), NoHwdb none. A default that is not there is no error: a node with
// neither gives nil, which names nothing (IDs only, as lspci -n). A file given explicitly
// must exist.
func OpenDefaultFor(path, hwdb string, ids []ID) (*DB, error) {
	explicit := path != ""
	if !explicit {
		path = DefaultPath
	}
	db, err := OpenFor(path, ids)
	if errors.Is(err, fs.ErrNotExist) && !explicit {
		db, err = nil, nil
	}
	if err != nil {
		return nil, err
	}
	switch hwdb {
	case NoHwdb:
		return db, nil
	case "":
		if hwdb = DefaultHwdb(); hwdb == "" {
			return db, nil
		}
	}
	h, err := OpenHwdb(hwdb)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	if db == nil {
		db = &DB{vendors: map[uint16]string{}, devices: map[uint32]string{}, byVen: map[uint16][]uint16{}}
	}
	if err := db.hwdbNames(h, ids); err != nil {
		return nil, err
	}
	db.hwdb = hwdb
	return db, nil
}

// Hwdb is the hardware database the names were completed from ("" for none).
func (db *DB) Hwdb() string {
	if db == nil {
		return ""
	}
	return db.hwdb
}

// Path is the file the database was read from ("" for nil).
func (db *DB) Path() string {
	if db == nil {
		return ""
	}
	return db.path
}

// Names returns the vendor's and the device's names; "" where the database has none.
// Each is looked up on its own, as lspci -mm's columns are: hwdb can name a device whose
// vendor pci.ids lists without it.
func (db *DB) Names(vendor, device uint16) (vendorName, deviceName string) {
	if db == nil {
		return "", ""
	}
	return db.vendors[vendor], db.devices[uint32(vendor)<<16|uint32(device)]
}

// Label is a function's name as lspci -nn prints it after the class:
// "Mellanox Technologies CX8 Family [ConnectX-8] [15b3:1023]", with lspci's
// "Device 1023" for a device its vendor's entry does not list, and the IDs alone
// ("[15b3:1023]") without a database or without the vendor.
func (db *DB) Label(vendor, device uint16) string {
	ids := fmt.Sprintf("[%04x:%04x]", vendor, device)
	v, d := db.Names(vendor, device)
	if v == "" {
		return ids
	}
	if d == "" {
		d = fmt.Sprintf("Device %04x", device)
	}
	return v + " " + d + " " + ids
}

// Wanted is what a subset keeps: a vendor's name, and either the devices listed or,
// with AllDevices, every device of that vendor.
type Wanted struct {
	Devices    map[uint16]bool
	AllDevices bool
}

// WriteSubset writes, in pci.ids format, the entries of the vendors and devices in want:
// the names an image needs for the devices its profiles know, not the whole database.
// Subsystem and class entries are left out: passage names neither.
func (db *DB) WriteSubset(w io.Writer, want map[uint16]*Wanted) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "# pci.ids subset from %s: the vendors and devices of passage's profiles\n", filepath.Base(db.path))
	for _, vid := range db.order {
		wv, ok := want[vid]
		if !ok {
			continue
		}
		fmt.Fprintf(bw, "%04x  %s\n", vid, db.vendors[vid])
		for _, did := range db.byVen[vid] {
			if wv.AllDevices || wv.Devices[did] {
				fmt.Fprintf(bw, "\t%04x  %s\n", did, db.devices[uint32(vid)<<16|uint32(did)])
			}
		}
	}
	return bw.Flush()
}

// Kinds of pci.ids line.
const (
	lineOther  = iota // comment, blank, subsystem, class's subclass and prog-if
	lineVendor        // "15b3  Name"
	lineDevice        // "\t1023  Name" below a vendor
	lineClass         // "C 02  Name"
)

// checker accepts what pci.ids holds: comments, blank lines, class blocks ("C 02  ..."),
// vendor lines ("15b3  Name"), device lines ("\t1023  Name") and subsystem or prog-if
// lines ("\t\t15b3 0001  Name", "\t\t00  Name"), each at least as long as its fields.
type checker struct{ inClass, vendor bool }

func (c *checker) line(l []byte) (kind int, err error) {
	bad := func(what string) error { return fmt.Errorf("%s: %q", what, trim(string(l))) }
	switch {
	case len(l) == 0 || l[0] == '#':
	case l[0] == 'C':
		if len(l) < 6 || l[1] != ' ' || !isHex(l[2:4]) {
			return 0, bad("not a class line")
		}
		c.inClass = true
		return lineClass, nil
	case l[0] != '\t':
		if len(l) < 6 || !isHex(l[:4]) || l[4] != ' ' {
			return 0, bad("not a vendor line")
		}
		c.inClass, c.vendor = false, true
		return lineVendor, nil
	case len(l) > 1 && l[1] != '\t':
		if c.inClass {
			if len(l) < 5 || !isHex(l[1:3]) {
				return 0, bad("not a subclass line")
			}
			return lineOther, nil
		}
		if !c.vendor || len(l) < 7 || !isHex(l[1:5]) {
			return 0, bad("not a device line")
		}
		return lineDevice, nil
	default:
		if c.inClass {
			if len(l) < 6 {
				return 0, bad("not a programming interface line")
			}
		} else if len(l) < 13 {
			return 0, bad("not a subsystem line")
		}
	}
	return lineOther, nil
}

func isHex(b []byte) bool {
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

func trim(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return strings.TrimSpace(s)
}
