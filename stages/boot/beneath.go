package boot

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// Beneath makes the directory rel (a path from the command line or the tree, "/" being
// root) beneath root and returns its path, refusing one reached through a symbolic link:
// a tree given with --root cannot point the boot's writes (the manifest, the log, the
// passage.out mount) at a directory outside it. The directory is made through os.Root,
// which refuses a component that leaves root, and no component may be a link, so the
// path returned resolves to what was made. On a node root is "/".
func Beneath(root, rel string) (string, error) {
	clean := filepath.Clean("/" + rel)
	root, r, err := openRoot(root)
	if err != nil {
		return "", err
	}
	defer r.Close()
	name := strings.TrimPrefix(clean, "/")
	if name == "" {
		return root, nil
	}
	if err := r.MkdirAll(name, 0o755); err != nil {
		return "", fmt.Errorf("%s beneath %s: %w", clean, root, err)
	}
	if err := realDirs(r, name); err != nil {
		return "", fmt.Errorf("%s beneath %s: %w", clean, root, err)
	}
	return filepath.Join(root, name), nil
}

// realDirs refuses a path beneath r any of whose components is not a directory (a
// symbolic link above all). A component that does not exist is no link.
func realDirs(r *os.Root, name string) error {
	for p := name; p != "." && p != "/"; p = filepath.Dir(p) {
		fi, err := r.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		if fi.Mode()&fs.ModeSymlink != 0 || !fi.IsDir() {
			return fmt.Errorf("/%s is %s, not a directory: refused", p, kind(fi.Mode()))
		}
	}
	return nil
}

// ReadBeneath reads the regular file rel beneath root, at most max bytes: a link may
// lead elsewhere in the tree, never out of it (os.Root), and a FIFO is refused without
// blocking on it.
func ReadBeneath(root, rel string, max int64) ([]byte, error) {
	f, err := openBeneath(root, rel)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > max {
		return nil, fmt.Errorf("%s: over %d bytes", rel, max)
	}
	return data, nil
}

// openBeneath opens the regular file rel beneath root for reading without blocking on a
// FIFO: a link may lead elsewhere in the tree, never out of it (os.Root).
func openBeneath(root, rel string) (*os.File, error) {
	_, r, err := openRoot(root)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	f, err := r.OpenFile(strings.TrimPrefix(filepath.Clean("/"+rel), "/"), os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%s: %s, not a regular file", rel, kind(fi.Mode()))
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// deviceBeneath is the device node rel beneath root as a path mount(2) may be given: the
// links to it resolved, each within root, and the node itself a block device.
func deviceBeneath(root, rel string) (string, error) {
	root, r, err := openRoot(root)
	if err != nil {
		return "", err
	}
	defer r.Close()
	name := strings.TrimPrefix(filepath.Clean("/"+rel), "/")
	for range 40 { // the kernel's own bound on links in one lookup
		// The directories above the node must not be links.
		if err := realDirs(r, filepath.Dir(name)); err != nil {
			return "", fmt.Errorf("%s: %w", rel, err)
		}
		fi, err := r.Lstat(name)
		if errors.Is(err, fs.ErrNotExist) {
			// Not there (yet): mount says so, at a path beneath the root.
			return filepath.Join(root, name), nil
		}
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			if fi.Mode()&fs.ModeDevice == 0 || fi.Mode()&fs.ModeCharDevice != 0 {
				return "", fmt.Errorf("%s: %s, not a block device", rel, kind(fi.Mode()))
			}
			return filepath.Join(root, name), nil
		}
		t, err := r.Readlink(name)
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(t) {
			name = strings.TrimPrefix(filepath.Clean(t), "/")
		} else {
			name = filepath.Join(filepath.Dir(name), t)
		}
		if name == ".." || strings.HasPrefix(name, "../") {
			return "", fmt.Errorf("%s: link leads out of %s", rel, root)
		}
	}
	return "", errors.New(rel + ": too many links")
}

func kind(m fs.FileMode) string {
	switch {
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a FIFO"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m&fs.ModeSocket != 0:
		return "a socket"
	}
	return "a regular file"
}

// openRoot opens root ("" is "/") as an os.Root.
func openRoot(root string) (string, *os.Root, error) {
	if root == "" {
		root = "/"
	}
	r, err := os.OpenRoot(root)
	return root, r, err
}
