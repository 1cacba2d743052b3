// Package pciids names PCI vendors and devices from a pci.ids database, as lspci does:
// the same file (/usr/share/misc/pci.ids on Debian), the same lookup (vendor, then
// vendor+device; subsystems name only lspci's Subsystem line, which passage does not
// print). Parsing is github.com/jaypipes/pcidb's; this package bounds the input, turns
// a malformed file into an error, and writes the subset an initramfs carries.
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
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/jaypipes/pcidb"
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
	vendors map[uint16]string
	devices map[uint32]string
	// order keeps the file's order for Subset.
	order []uint16
	byVen map[uint16][]uint16
}

// Open reads the database at path. A file that is not there is fs.ErrNotExist (wrapped);
// one too large, not a regular file, or not in pci.ids format is an error naming it.
func Open(path string) (*DB, error) {
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
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("pci.ids %s: %w", path, err)
	}
	if err := check(raw); err != nil {
		return nil, fmt.Errorf("pci.ids %s: %w", path, err)
	}
	// pcidb reads the file itself (WithPath); it was checked above, so its parser, which
	// indexes lines without bounds checks, sees only well-formed lines. The recover is
	// for a file changed between the two reads.
	var db *pcidb.DB
	func() {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("malformed (%v)", r)
			}
		}()
		net := false
		db, err = pcidb.New(&pcidb.WithOption{Path: &path, EnableNetworkFetch: &net})
	}()
	if err != nil {
		return nil, fmt.Errorf("pci.ids %s: %w", path, err)
	}
	out := &DB{path: path, vendors: map[uint16]string{}, devices: map[uint32]string{}, byVen: map[uint16][]uint16{}}
	for id, v := range db.Vendors {
		vid, err := strconv.ParseUint(id, 16, 16)
		if err != nil {
			return nil, fmt.Errorf("pci.ids %s: vendor %q: not a 16-bit hex ID", path, id)
		}
		out.vendors[uint16(vid)] = v.Name
	}
	// Products, not Vendor.Products: pcidb fills a vendor's Products when the next vendor
	// starts, so the file's last vendor has none.
	for _, p := range db.Products {
		vid, verr := strconv.ParseUint(p.VendorID, 16, 16)
		did, derr := strconv.ParseUint(p.ID, 16, 16)
		if verr != nil || derr != nil {
			return nil, fmt.Errorf("pci.ids %s: device %s:%s: not 16-bit hex IDs", path, p.VendorID, p.ID)
		}
		out.devices[uint32(vid)<<16|uint32(did)] = p.Name
		out.byVen[uint16(vid)] = append(out.byVen[uint16(vid)], uint16(did))
	}
	for _, ds := range out.byVen {
		slices.Sort(ds)
	}
	for _, l := range bytes.Split(raw, []byte("\n")) {
		if len(l) > 4 && isHex(l[:4]) {
			if v, err := strconv.ParseUint(string(l[:4]), 16, 16); err == nil {
				out.order = append(out.order, uint16(v))
			}
		}
	}
	return out, nil
}

// OpenDefault opens path, or DefaultPath when path is "". A default database that is
// not there is no error: the result is nil and names nothing (IDs only, as lspci -n).
// A path given explicitly must exist.
func OpenDefault(path string) (*DB, error) {
	if path != "" {
		return Open(path)
	}
	db, err := Open(DefaultPath)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return db, err
}

// Path is the file the database was read from ("" for nil).
func (db *DB) Path() string {
	if db == nil {
		return ""
	}
	return db.path
}

// Names returns the vendor's and the device's names; "" where the database has none.
func (db *DB) Names(vendor, device uint16) (vendorName, deviceName string) {
	if db == nil {
		return "", ""
	}
	vendorName, ok := db.vendors[vendor]
	if !ok {
		return "", ""
	}
	return vendorName, db.devices[uint32(vendor)<<16|uint32(device)]
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

// check accepts what pci.ids holds: comments, blank lines, class blocks ("C 02  ..."),
// vendor lines ("15b3  Name"), device lines ("\t1023  Name") and subsystem or prog-if
// lines ("\t\t15b3 0001  Name", "\t\t00  Name"), each at least as long as the parser
// slices it.
func check(raw []byte) error {
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(nil, 64<<10)
	inClass, vendor := false, false
	n := 0
	for sc.Scan() {
		n++
		l := sc.Text()
		// pcidb slices runes, not bytes.
		runes := utf8.RuneCountInString(l)
		bad := func(what string) error { return fmt.Errorf("line %d: %s: %q", n, what, trim(l)) }
		switch {
		case l == "" || l[0] == '#':
		case l[0] == 'C':
			if runes < 6 || l[1] != ' ' || !isHex([]byte(l[2:4])) {
				return bad("not a class line")
			}
			inClass = true
		case l[0] != '\t':
			if runes < 6 || !isHex([]byte(l[:4])) || l[4] != ' ' {
				return bad("not a vendor line")
			}
			inClass, vendor = false, true
		case len(l) > 1 && l[1] != '\t':
			if inClass {
				if runes < 5 || !isHex([]byte(l[1:3])) {
					return bad("not a subclass line")
				}
			} else if !vendor || runes < 7 || !isHex([]byte(l[1:5])) {
				return bad("not a device line")
			}
		default:
			if inClass {
				if runes < 6 {
					return bad("not a programming interface line")
				}
			} else if runes < 13 {
				return bad("not a subsystem line")
			}
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("line %d: %w", n+1, err)
	}
	return nil
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
