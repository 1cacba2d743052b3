package pciids

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"sort"
	"strings"
	"syscall"
)

// HwdbPaths are where libudev looks for the compiled hardware database, in its order
// (systemd 252's sd-hwdb.c, hwdb_bin_paths, with Debian's split-/usr entries): the first
// that exists is the one libpci, and so lspci, reads.
var HwdbPaths = []string{
	"/etc/systemd/hwdb/hwdb.bin",
	"/etc/udev/hwdb.bin",
	"/usr/lib/systemd/hwdb/hwdb.bin",
	"/lib/systemd/hwdb/hwdb.bin",
	"/lib/udev/hwdb.bin",
}

// DefaultHwdb is the hardware database libudev would open: the first of HwdbPaths that
// exists, "" when none does (an initramfs, a host without udev).
func DefaultHwdb() string {
	for _, p := range HwdbPaths {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// The on-disk trie, as systemd's src/libsystemd/sd-hwdb/hwdb-internal.h lays it out. All
// integers are little-endian; offsets are from the start of the file.
const (
	hwdbSig        = "KSLPHHRH"
	hwdbHeaderSize = 80 // trie_header_f: signature, then nine le64 fields
	minNodeSize    = 24 // trie_node_f: prefix_off, children_count + 7 padding, values_count
	minChildSize   = 16 // trie_child_entry_f: c + 7 padding, child_off
	minValueSize   = 16 // trie_value_entry_f: key_off, value_off
	value2Size     = 32 // trie_value_entry2_f adds filename_off, line_number, file_priority
	// maxHwdbSize bounds the file: Debian 12's is 13 MB.
	maxHwdbSize = 256 << 20
	// maxKey bounds a key the search rebuilds below a glob, as sd-hwdb's LINE_MAX buffer does.
	maxKey = 2048
	// maxVisits bounds the nodes one lookup reads: a trie whose offsets loop is an error,
	// not a hang.
	maxVisits = 1 << 16
	// maxString bounds a string read from the string table.
	maxString = 64 << 10
)

// Hwdb is an opened hwdb.bin, mapped read-only as sd-hwdb maps it: a command asks for a
// few IDs of a 13 MB trie, and a lookup touches only the pages of the nodes it walks (a
// glob's subtree can be a thousand nodes: reading each with its own system call cost 50
// ms for the B300 tree's IDs). systemd-hwdb replaces the file by rename, never in place;
// a mapping cut short anyway faults, and that fault is an error of the lookup
// (debug.SetPanicOnFault), not a crash.
type Hwdb struct {
	path                           string
	data                           []byte
	size                           int64
	nodeSize, childSize, valueSize uint64
	root                           uint64
}

// OpenHwdb opens the hardware database at path and checks its header. A file that is not
// there is fs.ErrNotExist (wrapped); one too large, not a regular file, or not in the trie
// format is an error naming it.
func OpenHwdb(path string) (*Hwdb, error) {
	fail := func(format string, a ...any) (*Hwdb, error) {
		return nil, fmt.Errorf("hwdb %s: "+format, append([]any{path}, a...)...)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fail("%w", err)
	}
	fi, err := f.Stat()
	switch {
	case err != nil:
		f.Close()
		return fail("%w", err)
	case !fi.Mode().IsRegular():
		f.Close()
		return fail("not a regular file")
	case fi.Size() > maxHwdbSize:
		f.Close()
		return fail("%d bytes, more than the %d a hwdb.bin can be", fi.Size(), maxHwdbSize)
	}
	defer f.Close()
	if fi.Size() < hwdbHeaderSize {
		return fail("header: %d bytes, shorter than a hwdb.bin's %d", fi.Size(), hwdbHeaderSize)
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(fi.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return fail("mmap: %w", err)
	}
	h := &Hwdb{path: path, data: data, size: fi.Size()}
	hdr := data[:hwdbHeaderSize]
	le := binary.LittleEndian
	field := func(i int) uint64 { return le.Uint64(hdr[8+8*i:]) }
	fileSize, headerSize := field(1), field(2)
	h.nodeSize, h.childSize, h.valueSize, h.root = field(3), field(4), field(5), field(6)
	switch {
	case string(hdr[:8]) != hwdbSig:
		err = errors.New("not a hwdb.bin (no KSLPHHRH signature)")
	case fileSize != uint64(h.size):
		err = fmt.Errorf("header says %d bytes, the file has %d", fileSize, h.size)
	case headerSize < hwdbHeaderSize || headerSize > uint64(h.size):
		err = fmt.Errorf("header size %d", headerSize)
	case h.nodeSize < minNodeSize || h.nodeSize > 1024, h.childSize < minChildSize || h.childSize > 1024,
		h.valueSize < minValueSize || h.valueSize > 1024:
		err = fmt.Errorf("entry sizes %d/%d/%d", h.nodeSize, h.childSize, h.valueSize)
	case h.root < headerSize || h.root >= uint64(h.size):
		err = fmt.Errorf("root node at %d, outside the file", h.root)
	}
	if err != nil {
		h.Close()
		return fail("%v", err)
	}
	return h, nil
}

// Close releases the mapping.
func (h *Hwdb) Close() error {
	if h.data == nil {
		return nil
	}
	err := syscall.Munmap(h.data)
	h.data = nil
	return err
}

// Path is the file the database was opened from.
func (h *Hwdb) Path() string { return h.path }

// node is one trie_node_f with its child and value entries.
type node struct {
	prefix   uint64 // string offset; 0: none
	children []child
	values   []value
}

type child struct {
	c   byte
	off uint64
}

type value struct {
	key, val, file uint64
	line           uint32
	priority       uint16
}

// read returns the n bytes at off, which must lie inside the file.
func (h *Hwdb) read(off, n uint64) ([]byte, error) {
	if off > uint64(h.size) || n > uint64(h.size)-off {
		return nil, fmt.Errorf("%d bytes at %d: outside the file", n, off)
	}
	return h.data[off : off+n], nil
}

func (h *Hwdb) node(off uint64) (*node, error) {
	le := binary.LittleEndian
	b, err := h.read(off, h.nodeSize)
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	nc, nv := uint64(b[8]), le.Uint64(b[16:])
	if nv > uint64(h.size)/h.valueSize {
		return nil, fmt.Errorf("node at %d: %d values", off, nv)
	}
	rest, err := h.read(off+h.nodeSize, nc*h.childSize+nv*h.valueSize)
	if err != nil {
		return nil, fmt.Errorf("node at %d: entries: %w", off, err)
	}
	n := &node{prefix: le.Uint64(b)}
	for i := range nc {
		e := rest[i*h.childSize:]
		n.children = append(n.children, child{c: e[0], off: le.Uint64(e[8:])})
	}
	rest = rest[nc*h.childSize:]
	for i := range nv {
		e := rest[i*h.valueSize:]
		v := value{key: le.Uint64(e), val: le.Uint64(e[8:])}
		if h.valueSize >= value2Size {
			v.file, v.line, v.priority = le.Uint64(e[16:]), le.Uint32(e[24:]), le.Uint16(e[28:])
		}
		n.values = append(n.values, v)
	}
	return n, nil
}

// str reads the NUL-terminated string at off; offset 0 is the empty string.
func (h *Hwdb) str(off uint64) (string, error) {
	if off == 0 {
		return "", nil
	}
	if off >= uint64(h.size) {
		return "", fmt.Errorf("string at %d: outside the file", off)
	}
	b := h.data[off:min(uint64(h.size), off+maxString)]
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return "", fmt.Errorf("string at %d: no end within %d bytes", off, len(b))
	}
	return string(b[:i]), nil
}

// lookup is one search's state: the properties found so far and the nodes read.
type lookup struct {
	h      *Hwdb
	search string
	props  map[string]value
	visits int
}

// Properties returns the properties hwdb gives modalias, as sd_hwdb_get does: every
// entry whose key (a glob) matches modalias, a later entry of the same property replacing
// an earlier one unless it comes from a file of lower priority or an earlier line.
func (h *Hwdb) Properties(modalias string) (props map[string]string, err error) {
	if h.data == nil {
		return nil, fmt.Errorf("hwdb %s: closed", h.path)
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if p := recover(); p != nil {
			props, err = nil, fmt.Errorf("hwdb %s: %q: the mapped file faulted (changed in place?): %v", h.path, modalias, p)
		}
	}()
	l := &lookup{h: h, search: modalias, props: map[string]value{}}
	if err := l.searchTrie(); err != nil {
		return nil, fmt.Errorf("hwdb %s: %q: %w", h.path, modalias, err)
	}
	out := make(map[string]string, len(l.props))
	for k, v := range l.props {
		s, err := h.str(v.val)
		if err != nil {
			return nil, fmt.Errorf("hwdb %s: %q: %s: %w", h.path, modalias, k, err)
		}
		out[k] = s
	}
	return out, nil
}

func (l *lookup) visit(off uint64) (*node, error) {
	if l.visits++; l.visits > maxVisits {
		return nil, fmt.Errorf("more than %d nodes read: the trie loops", maxVisits)
	}
	return l.h.node(off)
}

// searchTrie walks the trie along the search string, as sd-hwdb's trie_search_f: at every
// node a '*', '?' or '[' child starts a glob whose subtree is matched whole (globFrom);
// otherwise the next character of the search picks the child, and the node the search
// ends on gives its values.
func (l *lookup) searchTrie() error {
	off, i := l.h.root, 0
	for {
		n, err := l.visit(off)
		if err != nil {
			return err
		}
		prefix, err := l.h.str(n.prefix)
		if err != nil {
			return err
		}
		for p := 0; p < len(prefix); p++ {
			c := prefix[p]
			if c == '*' || c == '?' || c == '[' {
				return l.globFrom(n, nil, prefix[p:], l.search[i+p:])
			}
			if i+p >= len(l.search) || c != l.search[i+p] {
				return nil
			}
		}
		i += len(prefix)
		for _, g := range []byte("*?[") {
			if c, ok := n.child(g); ok {
				if err := l.globChild(c.off, []byte{g}, l.search[i:]); err != nil {
					return err
				}
			}
		}
		if i == len(l.search) {
			return l.add(n)
		}
		c, ok := n.child(l.search[i])
		if !ok {
			return nil
		}
		off = c.off
		i++
	}
}

func (n *node) child(c byte) (child, bool) {
	j := sort.Search(len(n.children), func(j int) bool { return n.children[j].c >= c })
	if j < len(n.children) && n.children[j].c == c {
		return n.children[j], true
	}
	return child{}, false
}

// globChild is globFrom on the node at off, whose key from the glob is key.
func (l *lookup) globChild(off uint64, key []byte, rest string) error {
	n, err := l.visit(off)
	if err != nil {
		return err
	}
	prefix, err := l.h.str(n.prefix)
	if err != nil {
		return err
	}
	return l.globFrom(n, key, prefix, rest)
}

// globFrom matches the subtree of n against rest, the search from where the glob starts
// (sd-hwdb's trie_fnmatch_f): key is the key from the glob down to n, tail n's own prefix
// still to add. The part of a key before its glob equals the search already.
func (l *lookup) globFrom(n *node, key []byte, tail, rest string) error {
	key = append(key, tail...)
	if len(key) > maxKey {
		return fmt.Errorf("a key longer than %d bytes", maxKey)
	}
	for _, c := range n.children {
		if err := l.globChild(c.off, append(key, c.c), rest); err != nil {
			return err
		}
	}
	if len(n.values) > 0 && fnmatch(string(key), rest) {
		return l.add(n)
	}
	return nil
}

// add takes n's values as sd-hwdb's hwdb_add_property: only keys that start with a space
// are properties; of two entries for one property the one from the file of higher
// priority, then the later line, wins (format v3; v2 files carry no priority and order by
// the file name's offset instead).
func (l *lookup) add(n *node) error {
	for _, v := range n.values {
		k, err := l.h.str(v.key)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(k, " ") {
			continue
		}
		k = k[1:]
		if old, ok := l.props[k]; ok && l.h.valueSize >= value2Size {
			var lower bool
			if v.priority == 0 {
				lower = v.file < old.file || v.file == old.file && v.line < old.line
			} else {
				lower = v.priority < old.priority || v.priority == old.priority && v.line < old.line
			}
			if lower {
				continue
			}
		}
		l.props[k] = v
	}
	return nil
}

// fnmatch is fnmatch(3) with no flags, for the globs hwdb keys use: '*', '?', bracket
// expressions with '!' or '^' and ranges, and '\' quoting the next character.
func fnmatch(pattern, s string) bool {
	for len(pattern) > 0 {
		switch c := pattern[0]; c {
		case '*':
			for len(pattern) > 0 && pattern[0] == '*' {
				pattern = pattern[1:]
			}
			if pattern == "" {
				return true
			}
			for i := 0; i <= len(s); i++ {
				if fnmatch(pattern, s[i:]) {
					return true
				}
			}
			return false
		case '?':
			if s == "" {
				return false
			}
			pattern, s = pattern[1:], s[1:]
		case '[':
			if s == "" {
				return false
			}
			ok, n := bracket(pattern, s[0])
			if n == 0 { // no closing ']': the '[' is itself
				if s[0] != '[' {
					return false
				}
				n = 1
			} else if !ok {
				return false
			}
			pattern, s = pattern[n:], s[1:]
		default:
			if c == '\\' && len(pattern) > 1 {
				pattern = pattern[1:]
				c = pattern[0]
			}
			if s == "" || s[0] != c {
				return false
			}
			pattern, s = pattern[1:], s[1:]
		}
	}
	return s == ""
}

// bracket matches c against the bracket expression at the start of pattern; n is the
// expression's length, 0 when it is not closed.
func bracket(pattern string, c byte) (ok bool, n int) {
	i := 1
	negate := i < len(pattern) && (pattern[i] == '!' || pattern[i] == '^')
	if negate {
		i++
	}
	for first := true; i < len(pattern); first = false {
		if pattern[i] == ']' && !first {
			return ok != negate, i + 1
		}
		lo := pattern[i]
		if lo == '\\' && i+1 < len(pattern) {
			i++
			lo = pattern[i]
		}
		hi := lo
		if i+2 < len(pattern) && pattern[i+1] == '-' && pattern[i+2] != ']' {
			hi = pattern[i+2]
			i += 2
		}
		if lo <= c && c <= hi {
			ok = true
		}
		i++
	}
	return false, 0
}

// hwdbNames looks up, in h, the names pci.ids did not give db for ids: a vendor's name
// (ID_VENDOR_FROM_DATABASE of "pci:v%08X*") and a device's (ID_MODEL_FROM_DATABASE of
// "pci:v%08Xd%08X*"), the modaliases libpci's names-hwdb.c asks for.
func (db *DB) hwdbNames(h *Hwdb, ids []ID) error {
	// A tree lists each ID once per function: ask hwdb once per ID, found or not.
	asked, vendorAsked := map[ID]bool{}, map[uint16]bool{}
	for _, id := range ids {
		if asked[id] {
			continue
		}
		asked[id] = true
		if _, ok := db.vendors[id.Vendor]; !ok && !vendorAsked[id.Vendor] {
			vendorAsked[id.Vendor] = true
			p, err := h.Properties(fmt.Sprintf("pci:v%08X*", id.Vendor))
			if err != nil {
				return err
			}
			if v, ok := p["ID_VENDOR_FROM_DATABASE"]; ok {
				db.vendors[id.Vendor] = v
			}
		}
		key := uint32(id.Vendor)<<16 | uint32(id.Device)
		if _, ok := db.devices[key]; !ok {
			p, err := h.Properties(fmt.Sprintf("pci:v%08Xd%08X*", id.Vendor, id.Device))
			if err != nil {
				return err
			}
			if d, ok := p["ID_MODEL_FROM_DATABASE"]; ok {
				db.devices[key] = d
			}
		}
	}
	return nil
}
