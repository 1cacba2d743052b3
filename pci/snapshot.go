package pci

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"
)

// A snapshot is a gzip'd tar of exactly the sysfs entries a Scan read, with the bytes and
// link targets it saw, under their paths relative to the root ("sys/bus/pci/devices/...",
// "sys/devices/pci0000:00/..."): the link structure survives, so scanning the unpacked
// snapshot reads the same things and builds the same tree.

// Limits on what a snapshot may unpack to. A snapshot comes from someone else's machine,
// so it is read as hostile. WriteSnapshot of a 9896-function SR-IOV node
// (pcitest.SRIOVNode(8, 617, 617)), more functions than any machine passage boots, is
// 69278 entries (29688 files, 9902 directories, 29688 symlinks), 40.6 MB of files, none
// over 4 KiB (the largest file a scan reads is 32 KiB of VPD), and an 86 MB tar stream
// (0.9 MB gzipped). The limits leave six to eight times that, and 32 times the VPD.
const (
	snapshotMaxFile     = 1 << 20   // bytes in one regular file
	snapshotMaxTotal    = 256 << 20 // bytes in all regular files
	snapshotMaxEntries  = 1 << 19   // entries
	snapshotMaxUnpacked = 512 << 20 // bytes of tar stream out of gzip (a gzip bomb's)
	snapshotMaxPath     = 4095      // bytes in an entry's name or a link's target (PATH_MAX)
	snapshotMaxDepth    = 64        // elements in an entry's name (a B300's deepest: 12)
	snapshotMaxHops     = 40        // links nested resolving one link, as Linux's MAXSYMLINKS
)

// snapshotTime is every entry's mtime: a snapshot's bytes depend only on what was read.
var snapshotTime = time.Unix(0, 0).UTC()

// WriteSnapshot scans root and writes the snapshot of that scan to w. It returns the
// tree the snapshot describes.
func WriteSnapshot(w io.Writer, root string) (*Tree, error) {
	type entry struct {
		kind readKind
		data []byte
	}
	entries := map[string]entry{}
	s := scanner{root: root, seen: func(rel string, kind readKind, data []byte) {
		entries[rel] = entry{kind, data}
	}}
	t, err := s.scan()
	if err != nil {
		return nil, err
	}
	// Every parent directory gets its own entry so the unpacked tree has the same shape.
	for rel := range entries {
		for d := path.Dir(rel); d != "." && d != "/"; d = path.Dir(d) {
			if _, ok := entries[d]; ok {
				break
			}
			entries[d] = entry{kind: readDir}
		}
	}
	names := make([]string, 0, len(entries))
	for n := range entries {
		names = append(names, n)
	}
	sort.Strings(names)

	zw := gzip.NewWriter(w)
	tw := tar.NewWriter(zw)
	for _, n := range names {
		e := entries[n]
		h := &tar.Header{Name: n, ModTime: snapshotTime, Format: tar.FormatPAX}
		switch e.kind {
		case readDir:
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, n+"/", 0o755
		case readLink:
			h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, string(e.data), 0o777
		case readFile:
			h.Typeflag, h.Size, h.Mode = tar.TypeReg, int64(len(e.data)), 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("snapshot %s: %w", n, err)
		}
		if e.kind == readFile {
			if _, err := tw.Write(e.data); err != nil {
				return nil, fmt.Errorf("snapshot %s: %w", n, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	if err := zw.Close(); err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	return t, nil
}

// ExtractSnapshot unpacks a snapshot into dir, which should be empty. It accepts only
// what WriteSnapshot writes: directories, regular files, and symlinks, under clean
// relative names, none below a symlink, within the snapshotMax* limits. Every entry is
// created through an os.Root, so the kernel keeps it beneath dir. Symlinks may point
// anywhere inside dir (sysfs is full of ../../../devices/... links), but once everything
// is unpacked each one is resolved, following every link on the way as the kernel would,
// and one that leads out of dir (a link to ../.. and another through it, say), or loops,
// rejects the archive. A rejected archive is an error naming the entry, and what was
// unpacked is removed again.
func ExtractSnapshot(r io.Reader, dir string) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	defer root.Close()
	x := &extraction{root: root, tops: map[string]bool{}, dirs: map[string]bool{}, links: map[string]bool{}}
	err = x.unpack(r)
	x.hold("")
	if err != nil {
		x.undo()
	}
	return err
}

// extraction is one ExtractSnapshot under way.
type extraction struct {
	root  *os.Root
	tops  map[string]bool // first path elements seen: true when the extraction created them
	dirs  map[string]bool // directories known to exist, not symlinks
	links map[string]bool // symlinks created
	order []string        // the same, in archive order
	total int64           // bytes of regular files
	buf   []byte          // a file's bytes

	// The directory of the last entry, held open: a snapshot lists siblings together, and
	// creating an entry in it is then one system call, not one per path element.
	held    *os.Root
	heldDir string

	// The unpacked tree, read once everything is unpacked, for checkLink.
	tree *linkTree
}

// errUnpacked is the gzip bomb's error.
var errUnpacked = fmt.Errorf("snapshot: more than %d bytes unpacked", snapshotMaxUnpacked)

// cappedReader fails once more than the unpacked limit has come out of r.
type cappedReader struct {
	r    io.Reader
	left int64 // the limit plus one, minus what was read
}

func (c *cappedReader) Read(p []byte) (int, error) {
	if c.left <= 0 {
		return 0, errUnpacked
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	if c.left -= int64(n); c.left <= 0 {
		return n, errUnpacked
	}
	return n, err
}

func (x *extraction) unpack(r io.Reader) error {
	zr, err := gzip.NewReader(r)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	in := &cappedReader{r: zr, left: snapshotMaxUnpacked + 1}
	tr := tar.NewReader(in)
	for n := 0; ; n++ {
		h, err := tr.Next()
		if in.left <= 0 {
			return errUnpacked
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("snapshot: %w", err)
		}
		if n >= snapshotMaxEntries {
			return fmt.Errorf("snapshot: more than %d entries", snapshotMaxEntries)
		}
		if err := x.entry(h, tr); err != nil {
			if in.left <= 0 {
				return errUnpacked
			}
			return err
		}
	}
	x.hold("")
	x.tree = &linkTree{root: x.root, nodes: []tnode{{parent: -1, kind: fs.ModeDir}}, kids: map[kidKey]int{}}
	for _, l := range x.order {
		if err := x.checkLink(l); err != nil {
			return err
		}
	}
	return nil
}

// typeNames names the tar entry types a snapshot may not hold.
var typeNames = map[byte]string{
	tar.TypeLink:          "hard link",
	tar.TypeChar:          "character device",
	tar.TypeBlock:         "block device",
	tar.TypeFifo:          "FIFO",
	tar.TypeCont:          "contiguous file",
	tar.TypeGNUSparse:     "sparse file",
	tar.TypeXGlobalHeader: "global extended header",
}

// entry unpacks one entry; tr is at its data.
func (x *extraction) entry(h *tar.Header, tr io.Reader) error {
	name := h.Name
	if h.Typeflag == tar.TypeDir {
		name = strings.TrimSuffix(name, "/")
	}
	if name == "" {
		return fmt.Errorf("snapshot entry %q: empty path", h.Name)
	}
	if len(name) > snapshotMaxPath {
		return fmt.Errorf("snapshot entry %.64q...: path longer than %d bytes", h.Name, snapshotMaxPath)
	}
	if strings.Count(name, "/") >= snapshotMaxDepth {
		return fmt.Errorf("snapshot entry %q: path deeper than %d elements", h.Name, snapshotMaxDepth)
	}
	if !filepath.IsLocal(name) || strings.Contains(name, `\`) {
		return fmt.Errorf("snapshot entry %q: path leaves the snapshot", h.Name)
	}
	// Only one spelling per path: a doubled slash or a . element would dodge the
	// below-a-symlink check, which compares names.
	if name == "." || path.Clean(name) != name {
		return fmt.Errorf("snapshot entry %q: path not in clean form (a doubled slash, . or .. element)", h.Name)
	}
	// A symlink as a parent would let later entries land wherever it points.
	for d := path.Dir(name); d != "."; d = path.Dir(d) {
		if x.links[d] {
			return fmt.Errorf("snapshot entry %q: below symlink %s", h.Name, d)
		}
	}
	fail := func(err error) error {
		if le := (*os.LinkError)(nil); errors.As(err, &le) {
			err = le.Err
		}
		return fmt.Errorf("snapshot entry %q: %w", h.Name, unwrapPath(err))
	}
	base := path.Base(name)
	switch h.Typeflag {
	case tar.TypeDir:
		d, err := x.parent(name)
		if err != nil {
			return fail(err)
		}
		if err := d.Mkdir(base, 0o755); err != nil {
			// Listed twice, or made as the parent of an earlier entry: fine if it is a
			// directory, not a symlink or file.
			if fi, lerr := d.Lstat(base); !errors.Is(err, fs.ErrExist) || lerr != nil || !fi.IsDir() {
				return fail(err)
			}
		}
		x.dirs[name] = true
	case tar.TypeSymlink:
		t := h.Linkname
		if t == "" {
			return fmt.Errorf("snapshot entry %q: empty link target", h.Name)
		}
		if len(t) > snapshotMaxPath {
			return fmt.Errorf("snapshot entry %q: link target longer than %d bytes", h.Name, snapshotMaxPath)
		}
		// What the scan sees when it joins a link's target to the link's directory.
		// It is not enough: checkLink follows the links on the way as the kernel does.
		if path.IsAbs(t) || !filepath.IsLocal(path.Join(path.Dir(name), t)) {
			return fmt.Errorf("snapshot entry %q: link target %q leaves the snapshot", h.Name, t)
		}
		d, err := x.parent(name)
		if err != nil {
			return fail(err)
		}
		if err := d.Symlink(t, base); err != nil {
			return fail(err)
		}
		x.links[name] = true
		x.order = append(x.order, name)
	case tar.TypeReg:
		for k := range h.PAXRecords {
			if strings.HasPrefix(k, "GNU.sparse.") {
				return fmt.Errorf("snapshot entry %q: sparse file not allowed", h.Name)
			}
		}
		if h.Size < 0 || h.Size > snapshotMaxFile {
			return fmt.Errorf("snapshot entry %q: %d bytes, more than %d", h.Name, h.Size, snapshotMaxFile)
		}
		if x.total += h.Size; x.total > snapshotMaxTotal {
			return fmt.Errorf("snapshot: more than %d bytes of files", snapshotMaxTotal)
		}
		d, err := x.parent(name)
		if err != nil {
			return fail(err)
		}
		if int64(cap(x.buf)) < h.Size {
			x.buf = make([]byte, h.Size)
		}
		b := x.buf[:h.Size]
		if _, err := io.ReadFull(tr, b); err != nil {
			return fail(err)
		}
		// O_EXCL: a second entry of the same name must not write through the first.
		f, err := d.OpenFile(base, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return fail(err)
		}
		_, err = f.Write(b)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fail(err)
		}
	default:
		what := typeNames[h.Typeflag]
		if what == "" {
			what = "unknown type"
		}
		return fmt.Errorf("snapshot entry %q: type %q not allowed (%s): a snapshot holds only directories, regular files and symlinks", h.Name, h.Typeflag, what)
	}
	return nil
}

// parent makes the directories above name and returns the one name goes in, held open.
// It notes the first element of name first, so that undo removes it if this extraction
// made it.
func (x *extraction) parent(name string) (*os.Root, error) {
	top, _, _ := strings.Cut(name, "/")
	if _, ok := x.tops[top]; !ok {
		_, err := x.root.Lstat(top)
		x.tops[top] = errors.Is(err, fs.ErrNotExist)
	}
	d := path.Dir(name)
	if d == "." {
		return x.root, nil
	}
	if !x.dirs[d] {
		if err := x.root.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
		for e := d; e != "." && !x.dirs[e]; e = path.Dir(e) {
			x.dirs[e] = true
		}
	}
	return x.hold(d)
}

// hold opens the directory d beneath the root, closing the one held before; "" closes it.
func (x *extraction) hold(d string) (*os.Root, error) {
	if x.held != nil && x.heldDir == d {
		return x.held, nil
	}
	if x.held != nil {
		x.held.Close()
		x.held, x.heldDir = nil, ""
	}
	if d == "" {
		return nil, nil
	}
	r, err := x.root.OpenRoot(d)
	if err != nil {
		return nil, err
	}
	x.held, x.heldDir = r, d
	return r, nil
}

// undo removes what the extraction made.
func (x *extraction) undo() {
	for top, made := range x.tops {
		if made {
			x.root.RemoveAll(top)
		}
	}
}

// checkLink resolves the symlink name the way the kernel resolves a path through it:
// element by element, each symlink met replaced by its target (relative to the link's
// directory), each .. going to the real parent of where the walk is, not the lexical
// parent (which a link to ../.. and a second link through it tell apart). It fails if
// the walk leaves the root, naming the link whose target climbed out, or if links loop
// or nest more than snapshotMaxHops deep. A walk that reaches something missing, or a
// file with more to go, stops there: the kernel's would too.
func (x *extraction) checkLink(name string) error {
	t := x.tree
	dir, err := t.walk(0, path.Dir(name), -1, 0)
	if err != nil {
		return err
	}
	id := -1
	if dir >= 0 {
		if id, err = t.child(dir, path.Base(name)); err != nil {
			return fmt.Errorf("snapshot entry %q: %w", name, unwrapPath(err))
		}
	}
	if id < 0 || t.nodes[id].kind != fs.ModeSymlink {
		return fmt.Errorf("snapshot entry %q: symlink gone after unpacking", name)
	}
	if _, err := t.link(id, 1); err != nil {
		var le *linkError
		if errors.As(err, &le) && le.link != name {
			return fmt.Errorf("%w (reached from link %s)", err, name)
		}
		return err
	}
	return nil
}

// linkError is a link that leaves the snapshot or loops.
type linkError struct {
	link, target, what string
}

func (e *linkError) Error() string {
	return fmt.Sprintf("snapshot entry %q: link target %q %s", e.link, e.target, e.what)
}

// A linkTree is the unpacked snapshot as the file system has it, each directory read as
// a walk first reaches it. Directories are numbered, so a walk is a map look-up an
// element, and each symlink is resolved once (links through it reuse where it led): the
// work is linear in the snapshot, however its links are stacked.
type linkTree struct {
	root  *os.Root
	nodes []tnode // 0 is the root
	kids  map[kidKey]int
}

type tnode struct {
	name   string
	parent int         // the directory holding it; -1 for the root
	kind   fs.FileMode // fs.ModeDir, fs.ModeSymlink, or 0 for anything else
	target string      // a symlink's
	listed bool        // a directory's entries are in kids
	state  uint8       // a symlink's resolution: resolveNot, resolving or resolved
	to     int         // where a resolved symlink led: a directory, or -1 for nowhere
}

const (
	resolveNot = iota
	resolving
	resolved
)

type kidKey struct {
	dir  int
	name string
}

// path is node id's path from the root.
func (t *linkTree) path(id int) string {
	var elems []string
	for ; id > 0; id = t.nodes[id].parent {
		elems = append(elems, t.nodes[id].name)
	}
	if len(elems) == 0 {
		return "."
	}
	slices.Reverse(elems)
	return strings.Join(elems, "/")
}

// child is the entry name in directory dir, or -1 if there is none.
func (t *linkTree) child(dir int, name string) (int, error) {
	if !t.nodes[dir].listed {
		if err := t.list(dir); err != nil {
			return -1, err
		}
	}
	if id, ok := t.kids[kidKey{dir, name}]; ok {
		return id, nil
	}
	return -1, nil
}

// list reads directory dir, with its symlinks' targets.
func (t *linkTree) list(dir int) error {
	r, err := t.root.OpenRoot(t.path(dir))
	if err != nil {
		return err
	}
	defer r.Close()
	f, err := r.Open(".")
	if err != nil {
		return err
	}
	ents, err := f.ReadDir(-1)
	f.Close()
	if err != nil {
		return err
	}
	for _, e := range ents {
		n := tnode{name: e.Name(), parent: dir, kind: e.Type() & (fs.ModeDir | fs.ModeSymlink), to: -1}
		if n.kind == fs.ModeSymlink {
			if n.target, err = r.Readlink(n.name); err != nil {
				return err
			}
		}
		t.kids[kidKey{dir, n.name}] = len(t.nodes)
		t.nodes = append(t.nodes, n)
	}
	t.nodes[dir].listed = true
	return nil
}

// link resolves symlink id, the depth'th link nested in the resolution under way: it
// returns the directory the link leads to, or -1 if it leads nowhere (something missing,
// a file).
func (t *linkTree) link(id, depth int) (int, error) {
	n := &t.nodes[id]
	switch n.state {
	case resolved:
		return n.to, nil
	case resolving:
		return -1, &linkError{t.path(id), n.target, "loops: too many levels of symbolic links"}
	}
	if depth > snapshotMaxHops {
		return -1, &linkError{t.path(id), n.target, fmt.Sprintf("nests more than %d links: too many levels of symbolic links", snapshotMaxHops)}
	}
	n.state = resolving
	to, err := t.walk(n.parent, n.target, id, depth)
	n = &t.nodes[id] // walk may have grown nodes
	n.state, n.to = resolved, to
	return to, err
}

// walk follows p from directory dir, where p is the target of symlink from (or, when
// from is -1, a clean name from the root), and returns the directory it leads to, or -1
// if it leads nowhere.
func (t *linkTree) walk(dir int, p string, from, depth int) (int, error) {
	leaves := func() error {
		if from < 0 {
			return fmt.Errorf("snapshot: path %q leaves the snapshot", p)
		}
		return &linkError{t.path(from), t.nodes[from].target, "resolves outside the snapshot"}
	}
	if path.IsAbs(p) {
		return -1, leaves()
	}
	for rest := p; rest != ""; {
		var elem string
		elem, rest, _ = strings.Cut(rest, "/")
		switch elem {
		case "", ".":
			continue
		case "..":
			if dir == 0 {
				return -1, leaves()
			}
			dir = t.nodes[dir].parent
			continue
		}
		id, err := t.child(dir, elem)
		if err != nil {
			return -1, fmt.Errorf("snapshot: reading %s: %w", t.path(dir), err)
		}
		if id < 0 {
			return -1, nil
		}
		switch t.nodes[id].kind {
		case fs.ModeDir:
			dir = id
		case fs.ModeSymlink:
			if dir, err = t.link(id, depth+1); err != nil || dir < 0 {
				return -1, err
			}
		default:
			return -1, nil
		}
	}
	return dir, nil
}

// ScanSnapshot unpacks a snapshot into a temporary directory, scans it and removes it.
// The tree equals the scan the snapshot was written from, except that Root is "".
func ScanSnapshot(r io.Reader) (*Tree, error) {
	dir, err := os.MkdirTemp("", "passage-snapshot-")
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	defer os.RemoveAll(dir)
	if err := ExtractSnapshot(r, dir); err != nil {
		return nil, err
	}
	t, err := Scan(dir)
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	t.Root = ""
	return t, nil
}

// ReadSnapshot is ScanSnapshot on a file.
func ReadSnapshot(name string) (*Tree, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	defer f.Close()
	t, err := ScanSnapshot(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return t, nil
}
