package pci

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// A snapshot is a gzip'd tar of exactly the sysfs entries a Scan read, with the bytes and
// link targets it saw, under their paths relative to the root ("sys/bus/pci/devices/...",
// "sys/devices/pci0000:00/..."): the link structure survives, so scanning the unpacked
// snapshot reads the same things and builds the same tree.

// Limits on what a snapshot may unpack to. A B300 node is about 200 functions of under
// 40 KiB each; a 4096-function SR-IOV node stays under 64 MiB.
const (
	snapshotMaxFile    = 1 << 20
	snapshotMaxTotal   = 512 << 20
	snapshotMaxEntries = 1 << 20
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
// what WriteSnapshot writes: directories, regular files, and relative symlinks that stay
// inside dir, none of them below a symlink; anything else is an error naming the entry.
func ExtractSnapshot(r io.Reader, dir string) error {
	zr, err := gzip.NewReader(r)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	tr := tar.NewReader(zr)
	links := map[string]bool{}
	var total int64
	for n := 0; ; n++ {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("snapshot: %w", err)
		}
		if n >= snapshotMaxEntries {
			return fmt.Errorf("snapshot: more than %d entries", snapshotMaxEntries)
		}
		name := strings.TrimSuffix(h.Name, "/")
		if !filepath.IsLocal(name) || strings.Contains(name, `\`) {
			return fmt.Errorf("snapshot entry %q: path leaves the snapshot", h.Name)
		}
		// A symlink as a parent would let later entries land wherever it points.
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			if links[d] {
				return fmt.Errorf("snapshot entry %q: below symlink %s", h.Name, d)
			}
		}
		dst := filepath.Join(dir, filepath.FromSlash(name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return fmt.Errorf("snapshot entry %q: %w", h.Name, unwrapPath(err))
			}
		case tar.TypeSymlink:
			t := h.Linkname
			if path.IsAbs(t) || !filepath.IsLocal(path.Join(path.Dir(name), t)) {
				return fmt.Errorf("snapshot entry %q: link target %q leaves the snapshot", h.Name, t)
			}
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return fmt.Errorf("snapshot entry %q: %w", h.Name, unwrapPath(err))
			}
			if err := os.Symlink(t, dst); err != nil {
				return fmt.Errorf("snapshot entry %q: %w", h.Name, unwrapPath(err))
			}
			links[name] = true
		case tar.TypeReg:
			if h.Size > snapshotMaxFile {
				return fmt.Errorf("snapshot entry %q: %d bytes, more than %d", h.Name, h.Size, snapshotMaxFile)
			}
			if total += h.Size; total > snapshotMaxTotal {
				return fmt.Errorf("snapshot: more than %d bytes", snapshotMaxTotal)
			}
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return fmt.Errorf("snapshot entry %q: %w", h.Name, unwrapPath(err))
			}
			// O_EXCL: a second entry of the same name must not write through the first.
			f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
			if err != nil {
				return fmt.Errorf("snapshot entry %q: %w", h.Name, unwrapPath(err))
			}
			_, err = io.Copy(f, io.LimitReader(tr, h.Size))
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("snapshot entry %q: %w", h.Name, err)
			}
		default:
			return fmt.Errorf("snapshot entry %q: type %q not allowed", h.Name, h.Typeflag)
		}
	}
	return nil
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
