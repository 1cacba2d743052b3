// Package kmod loads Linux kernel modules in dependency order without kmod's
// modules.dep: Debian's kernel package ships plain .ko files and leaves depmod to the
// install step, which an initramfs built from the unpacked .deb never runs. Each
// module's own ELF .modinfo section carries its name= and depends= keys, which is all
// the ordering needs.
package kmod

import (
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

// Module is one loadable module file found under the module directory.
type Module struct {
	Name    string   // canonical name ('-' folded to '_') of the file, as depmod names it
	Path    string   // absolute path of the .ko, .ko.xz or .ko.zst file
	Depends []string // canonical names, from modules.dep or .modinfo depends=

	// known says Depends has been read: a module's .modinfo is read only when an Order
	// needs it (a compressed one must be decompressed whole for it).
	known bool
}

// Index is every module below one <root>/lib/modules/<release> directory.
type Index struct {
	dir     string
	mods    map[string]*Module
	builtin map[string]bool // from modules.builtin: satisfied without a file

	// load is finit_module (or its fallback for compressed files); tests replace it.
	load func(m *Module) error
}

// Result is what loading one module did.
type Result struct {
	Name          string
	Path          string // empty for a built-in module
	Duration      time.Duration
	Err           error
	AlreadyLoaded bool // the kernel answered EEXIST, or the module is built in
}

// Canonical folds the two spellings the kernel accepts for a module name
// ("vfio-pci" and "vfio_pci") into the one /sys/module uses.
func Canonical(name string) string {
	return strings.ReplaceAll(name, "-", "_")
}

// moduleExts are the file name endings a kernel's module tree uses, longest first so
// "x.ko.xz" is never taken for a module named "x.ko".
var moduleExts = []string{".ko.zst", ".ko.xz", ".ko.gz", ".ko"}

func moduleExt(name string) string {
	for _, e := range moduleExts {
		if strings.HasSuffix(name, e) && len(name) > len(e) {
			return e
		}
	}
	return ""
}

// DepFile is depmod's dependency list, which Open reads instead of every module's
// .modinfo when the directory has one (an installed system's, or the one
// image/modsel writes into the initramfs).
const DepFile = "modules.dep"

// Open indexes the modules below dir (a <root>/lib/modules/<release> directory), and
// reads modules.builtin when it is there. With a modules.dep the index is that file
// alone: reading a module's .modinfo means decompressing a whole .ko.xz, which takes
// seconds for a few modules in an emulated guest. Without one, modules are indexed by
// file name and each one's .modinfo is read when an Order first needs it. A file that
// cannot be read is an error naming it, from Open or from the Order that needed it: a
// half-read index would give a wrong load order.
func Open(dir string) (*Index, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("kmod %s: %w", dir, err)
	}
	st, err := os.Stat(abs)
	if err != nil {
		return nil, fmt.Errorf("kmod %s: %w", dir, err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("kmod %s: not a directory", dir)
	}
	ix := &Index{dir: abs, mods: map[string]*Module{}, builtin: map[string]bool{}}
	ix.load = ix.finit
	switch err := ix.readDep(); {
	case err == nil:
		return ix, ix.readBuiltin()
	case !errors.Is(err, fs.ErrNotExist):
		return nil, err
	}
	err = filepath.WalkDir(abs, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("kmod %s: %w", path, err)
		}
		if d.IsDir() || moduleExt(d.Name()) == "" {
			return nil
		}
		if !d.Type().IsRegular() && d.Type()&fs.ModeSymlink == 0 {
			return nil
		}
		base := filepath.Base(path)
		m := &Module{Name: Canonical(strings.TrimSuffix(base, moduleExt(base))), Path: path}
		if prev, ok := ix.mods[m.Name]; ok {
			return fmt.Errorf("kmod %s: module %s also in %s", path, m.Name, prev.Path)
		}
		ix.mods[m.Name] = m
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := ix.readBuiltin(); err != nil {
		return nil, err
	}
	return ix, nil
}

// maxDepFile bounds modules.dep: a distribution kernel's is about 1 MiB.
const maxDepFile = 16 << 20

// readDep reads modules.dep ("kernel/a/x.ko.xz: kernel/b/y.ko.xz kernel/c/z.ko.xz" a
// line, paths relative to the directory; depmod lists every module a module needs,
// directly or not, which orders the same). A module is named after its file, as
// depmod and modprobe name it. fs.ErrNotExist when there is none.
func (ix *Index) readDep() error {
	p := filepath.Join(ix.dir, DepFile)
	f, err := os.Open(p)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return fmt.Errorf("kmod %s: %w", p, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxDepFile+1))
	if err != nil {
		return fmt.Errorf("kmod %s: %w", p, err)
	}
	if len(b) > maxDepFile {
		return fmt.Errorf("kmod %s: larger than %d bytes", p, maxDepFile)
	}
	name := func(rel string) (string, error) {
		base := path.Base(rel)
		e := moduleExt(base)
		if e == "" || path.IsAbs(rel) || !fs.ValidPath(rel) {
			return "", fmt.Errorf("%q is not a module path inside the directory", rel)
		}
		return Canonical(strings.TrimSuffix(base, e)), nil
	}
	for n, line := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			continue
		}
		mod, deps, ok := strings.Cut(line, ":")
		if !ok {
			return fmt.Errorf("kmod %s:%d: no ':' after the module", p, n+1)
		}
		mod = strings.TrimSpace(mod)
		mn, err := name(mod)
		if err != nil {
			return fmt.Errorf("kmod %s:%d: %v", p, n+1, err)
		}
		m := &Module{Name: mn, Path: filepath.Join(ix.dir, filepath.FromSlash(mod)), known: true}
		for _, d := range strings.Fields(deps) {
			dn, err := name(d)
			if err != nil {
				return fmt.Errorf("kmod %s:%d: %v", p, n+1, err)
			}
			m.Depends = append(m.Depends, dn)
		}
		// Load order, as Order would compute it from each .modinfo.
		slices.Reverse(m.Depends)
		if prev, ok := ix.mods[mn]; ok {
			return fmt.Errorf("kmod %s:%d: module %s also at %s", p, n+1, mn, prev.Path)
		}
		ix.mods[mn] = m
	}
	return nil
}

// WriteDep writes modules.dep lines for the given canonical names, in the order given:
// each module's path (rel maps a module to it), then every module it needs, directly or
// not, as depmod lists them: the last to load first. Built-in modules have no line.
func (ix *Index) WriteDep(w io.Writer, names []string, rel func(m *Module) (string, error)) error {
	for _, n := range names {
		m := ix.mods[n]
		if m == nil {
			continue
		}
		mp, err := rel(m)
		if err != nil {
			return err
		}
		order, err := ix.Order(n)
		if err != nil {
			return err
		}
		var deps []string
		for _, d := range slices.Backward(order[:len(order)-1]) {
			if dm := ix.mods[d]; dm != nil {
				dp, err := rel(dm)
				if err != nil {
					return err
				}
				deps = append(deps, dp)
			}
		}
		if _, err := fmt.Fprintf(w, "%s:%s\n", mp, strings.Join(append([]string{""}, deps...), " ")); err != nil {
			return err
		}
	}
	return nil
}

// readBuiltin reads modules.builtin (one "kernel/<path>/<name>.ko" a line), which
// kbuild writes next to the modules: a dependency named there needs no file.
func (ix *Index) readBuiltin() error {
	p := filepath.Join(ix.dir, "modules.builtin")
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("kmod %s: %w", p, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		base := filepath.Base(line)
		if e := moduleExt(base); e != "" {
			ix.builtin[Canonical(strings.TrimSuffix(base, e))] = true
		}
	}
	return nil
}

// Dir is the module directory the index was read from.
func (ix *Index) Dir() string { return ix.dir }

// Module returns the module named name (either spelling), or nil. Its Depends are
// read if they can be (Order reports why they cannot).
func (ix *Index) Module(name string) *Module {
	m := ix.mods[Canonical(name)]
	if m != nil {
		_ = ix.known(m)
	}
	return m
}

// known reads the module's dependencies from its .modinfo, once.
func (ix *Index) known(m *Module) error {
	if m.known {
		return nil
	}
	mi, err := ReadModinfo(m.Path)
	if err != nil {
		return err
	}
	if n := mi.First("name"); n != "" && Canonical(n) != m.Name {
		// depmod, modprobe and this index name a module after its file.
		return fmt.Errorf("kmod %s: .modinfo names it %s", m.Path, n)
	}
	m.Depends, m.known = mi.Depends(), true
	return nil
}

// Names is every module file's canonical name, sorted.
func (ix *Index) Names() []string {
	out := make([]string, 0, len(ix.mods))
	for n := range ix.mods {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Builtin reports whether modules.builtin names the module.
func (ix *Index) Builtin(name string) bool { return ix.builtin[Canonical(name)] }

// Order returns the canonical names of the given modules and everything they depend
// on, dependencies first, each once. Among modules with no ordering between them the
// request order is kept, so a caller's "vfio stack first" survives. Built-in modules
// appear too (Load reports them as already loaded). An unknown name or a dependency
// cycle is an error naming the module.
func (ix *Index) Order(names ...string) ([]string, error) {
	const (
		unseen = iota
		visiting
		done
	)
	state := map[string]int{}
	var out []string
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		switch state[name] {
		case done:
			return nil
		case visiting:
			return fmt.Errorf("kmod %s: dependency cycle %s", name, strings.Join(append(chain, name), " -> "))
		}
		m, ok := ix.mods[name]
		if !ok {
			if ix.builtin[name] {
				state[name] = done
				out = append(out, name)
				return nil
			}
			if len(chain) > 0 {
				return fmt.Errorf("kmod %s: needed by %s: no such module in %s", name, chain[len(chain)-1], ix.dir)
			}
			return fmt.Errorf("kmod %s: no such module in %s", name, ix.dir)
		}
		if err := ix.known(m); err != nil {
			return err
		}
		state[name] = visiting
		for _, d := range m.Depends {
			if err := visit(d, append(chain, name)); err != nil {
				return err
			}
		}
		state[name] = done
		out = append(out, name)
		return nil
	}
	for _, n := range names {
		if err := visit(Canonical(n), nil); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Load loads the given modules and their dependencies in Order's order with
// finit_module. A module the kernel already has (EEXIST, or built in) counts as
// loaded. A failed module fails the modules that depend on it without trying them
// (the kernel would refuse them for unknown symbols); the others still load. The
// results cover every module in the order; the error joins the failures, or is the
// Order error when nothing could be tried.
func (ix *Index) Load(names ...string) ([]Result, error) {
	order, err := ix.Order(names...)
	if err != nil {
		return nil, err
	}
	failed := map[string]bool{}
	var errs []error
	results := make([]Result, 0, len(order))
	for _, name := range order {
		m := ix.mods[name]
		if m == nil { // built in
			results = append(results, Result{Name: name, AlreadyLoaded: true})
			continue
		}
		r := Result{Name: name, Path: m.Path}
		for _, d := range m.Depends {
			if failed[d] {
				r.Err = fmt.Errorf("kmod %s: dependency %s failed to load", name, d)
				break
			}
		}
		if r.Err == nil {
			start := time.Now()
			err := ix.load(m)
			r.Duration = time.Since(start)
			switch {
			case err == nil:
			case errors.Is(err, errExist):
				r.AlreadyLoaded = true
			default:
				r.Err = fmt.Errorf("kmod %s: load %s: %w", name, m.Path, err)
			}
		}
		if r.Err != nil {
			failed[name] = true
			errs = append(errs, r.Err)
		}
		results = append(results, r)
	}
	return results, errors.Join(errs...)
}

// ErrRelease is OpenRelease's refusal of a release that is not a plain name.
var ErrRelease = errors.New("not a plain release name")

// OpenRelease opens the module tree of kernel release rel beneath root
// (root/lib/modules/rel), refusing a release that is not a plain name: a tree's /proc
// may say "../../tmp".
func OpenRelease(root, rel string) (*Index, error) {
	if !PlainRelease(rel) {
		return nil, fmt.Errorf("kernel release %q: %w", rel, ErrRelease)
	}
	return Open(filepath.Join(root, "lib", "modules", rel))
}

// PlainRelease says whether s can name a directory of /lib/modules: a kernel release
// such as "6.1.0-57-amd64", never a path ("..", "/", empty).
func PlainRelease(s string) bool {
	if s == "" || s == "." || s == ".." || len(s) > 64 {
		return false
	}
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '-', r == '_', r == '+', r == '~':
		default:
			return false
		}
	}
	return true
}
