package pci

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ConfigIO reads and writes a function's config space. The sysfs implementation is the
// only one in production; tests put fault injectors around it.
type ConfigIO interface {
	ReadConfig(a Address, off int64, p []byte) error
	WriteConfig(a Address, off int64, p []byte) error
}

// SysfsConfig accesses <root>/sys/bus/pci/devices/<bdf>/config, the way setpci does.
// The path resolves beneath the root whatever its links say (see OpenAttr): a tree whose
// link leads elsewhere is refused, not written through.
type SysfsConfig struct{ Root string }

func (s SysfsConfig) open(a Address, flag int) (*os.File, error) {
	f, err := OpenAttr(s.Root, DevicesDir+"/"+a.String()+"/config", flag)
	if err != nil {
		return nil, unwrapPath(err)
	}
	return f, nil
}

func (s SysfsConfig) ReadConfig(a Address, off int64, p []byte) error {
	f, err := s.open(a, os.O_RDONLY)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := f.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil {
		err = errors.New("short read")
	}
	return fmt.Errorf("read %d bytes at 0x%03x: %w", len(p), off, unwrapPath(err))
}

func (s SysfsConfig) WriteConfig(a Address, off int64, p []byte) error {
	f, err := s.open(a, os.O_WRONLY)
	if err != nil {
		return err
	}
	n, err := f.WriteAt(p, off)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && n != len(p) {
		err = errors.New("short write")
	}
	if err != nil {
		return fmt.Errorf("write %d bytes at 0x%03x: %w", len(p), off, unwrapPath(err))
	}
	return nil
}

// OpenAttr opens the sysfs attribute name, slash-separated and relative to root ("" is
// "/"), for reading or writing (flag is os.O_RDONLY, os.O_WRONLY or os.O_RDWR; it never
// creates). The kernel resolves the path beneath root (openat2 RESOLVE_BENEATH): a link
// that is absolute or climbs out fails, so a link planted in a --root tree, even after
// it was scanned, cannot carry a read or a write anywhere else; on a node the root is
// "/" and everything is beneath it. The attribute itself must be a regular file, as
// every sysfs attribute is: it is opened without following a link and without blocking
// (a FIFO's open waits for a writer otherwise), and anything else is an error naming
// what it is ("not a regular file (fifo)").
func OpenAttr(root, name string, flag int) (*os.File, error) {
	if root == "" {
		root = "/"
	}
	full := filepath.Join(root, filepath.FromSlash(name))
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: root, Err: err}
	}
	defer unix.Close(rfd)
	fd, err := openAttr(rfd, name, flag&(os.O_RDONLY|os.O_WRONLY|os.O_RDWR), unix.RESOLVE_BENEATH)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: full, Err: err}
	}
	return os.NewFile(uintptr(fd), full), nil
}

// OpenStream opens name beneath root for reading as OpenAttr does, but takes a
// character device as well as a regular file (char says which): a kernel log such as
// /dev/kmsg, which the caller reads record by record until EAGAIN. The file is
// non-blocking, so reading it never waits.
func OpenStream(root, name string) (f *os.File, char bool, err error) {
	if root == "" {
		root = "/"
	}
	full := filepath.Join(root, filepath.FromSlash(name))
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, false, &fs.PathError{Op: "open", Path: root, Err: err}
	}
	defer unix.Close(rfd)
	fd, err := openat2(rfd, name, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_NOCTTY, unix.RESOLVE_BENEATH)
	if err != nil {
		return nil, false, &fs.PathError{Op: "open", Path: full, Err: explainOpen(rfd, name, err)}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, false, &fs.PathError{Op: "stat", Path: full, Err: err}
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG, unix.S_IFCHR:
		return os.NewFile(uintptr(fd), full), st.Mode&unix.S_IFMT == unix.S_IFCHR, nil
	}
	unix.Close(fd)
	return nil, false, &fs.PathError{Op: "open", Path: full, Err: &notRegularError{fileKind(st.Mode)}}
}

// errOutsideRoot is what a path that resolves outside the root gets (openat2's EXDEV
// under RESOLVE_BENEATH).
var errOutsideRoot = errors.New("resolves outside the root")

// notRegularError is an attribute that is not a regular file.
type notRegularError struct{ kind string }

func (e *notRegularError) Error() string { return "not a regular file (" + e.kind + ")" }

func fileKind(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "fifo"
	case unix.S_IFSOCK:
		return "socket"
	case unix.S_IFCHR:
		return "char device"
	case unix.S_IFBLK:
		return "block device"
	case unix.S_IFLNK:
		return "symlink"
	case unix.S_IFDIR:
		return "directory"
	}
	return fmt.Sprintf("mode %#o", mode&unix.S_IFMT)
}

// openat2 opens name relative to dirfd with resolve's restrictions, close-on-exec. It
// retries what the kernel asks to be retried (EAGAIN: a rename raced a ".." under
// RESOLVE_BENEATH) and reports an escape as errOutsideRoot.
func openat2(dirfd int, name string, flags int, resolve uint64) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Resolve: resolve}
	for tries := 0; ; tries++ {
		fd, err := unix.Openat2(dirfd, name, &how)
		switch {
		case err == unix.EINTR, err == unix.EAGAIN && tries < 64:
			continue
		case err == unix.EXDEV:
			return -1, errOutsideRoot
		}
		return fd, err
	}
}

// openAttr opens an attribute for acc (O_RDONLY, O_WRONLY, O_RDWR) relative to dirfd,
// with resolve's restrictions, and checks it is a regular file. O_NONBLOCK makes the open
// of a FIFO return at once (and a socket's fail) instead of waiting for the other end;
// O_NOFOLLOW refuses a link as the attribute; O_NOCTTY keeps a terminal from becoming
// the process's. A directory is EISDIR, as reading one would say.
func openAttr(dirfd int, name string, acc int, resolve uint64) (int, error) {
	fd, err := openat2(dirfd, name, acc|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_NOCTTY, resolve)
	if err != nil {
		return -1, explainOpen(dirfd, name, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		return fd, nil
	case unix.S_IFDIR:
		unix.Close(fd)
		return -1, unix.EISDIR
	}
	unix.Close(fd)
	return -1, &notRegularError{fileKind(st.Mode)}
}

// explainOpen turns the error of an attribute's open into what the attribute is, when it
// is not a regular file: a link (ELOOP under O_NOFOLLOW), a socket (ENXIO), a FIFO
// without a reader opened for writing (ENXIO), a device node on a nodev mount (EACCES).
// It costs a system call or two, on the error path only.
func explainOpen(dirfd int, name string, err error) error {
	if err == unix.ENOENT || err == errOutsideRoot {
		return err
	}
	fd, oerr := openat2(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW, unix.RESOLVE_BENEATH)
	if oerr != nil {
		return err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG, unix.S_IFDIR:
		return err
	}
	return &notRegularError{fileKind(st.Mode)}
}

// Write is the record of one register write: what was there, what was written, and what
// reads back.
type Write struct {
	Addr   Address `json:"bdf"`
	Offset int     `json:"offset"`
	Width  int     `json:"width"` // bytes: 1, 2 or 4
	Before uint32  `json:"before"`
	Value  uint32  `json:"value"`
	After  uint32  `json:"after"`
}

// ErrReadBack is returned when the register reads back a value other than the one written
// (read-only bits, or a device that ignored the write).
var ErrReadBack = errors.New("read-back differs from the value written")

// WriteRegister writes a 1, 2 or 4 byte register and reads it back. It is the one path
// by which passage changes config space. The returned Write holds whatever was learned
// even on error: Before is valid once the first read succeeded, After once the read-back
// did.
func WriteRegister(io ConfigIO, a Address, off, width int, val uint32) (Write, error) {
	w := Write{Addr: a, Offset: off, Width: width, Value: val}
	if width != 1 && width != 2 && width != 4 || off < 0 || off%width != 0 || off+width > ExtendedSize {
		return w, fmt.Errorf("%s: bad register 0x%03x width %d", a, off, width)
	}
	buf := make([]byte, width)
	if err := io.ReadConfig(a, int64(off), buf); err != nil {
		return w, fmt.Errorf("%s: read 0x%03x: %w", a, off, err)
	}
	w.Before = decodeLE(buf)
	encodeLE(buf, val)
	if err := io.WriteConfig(a, int64(off), buf); err != nil {
		return w, fmt.Errorf("%s: write 0x%03x: %w", a, off, err)
	}
	if err := io.ReadConfig(a, int64(off), buf); err != nil {
		return w, fmt.Errorf("%s: read back 0x%03x: %w", a, off, err)
	}
	w.After = decodeLE(buf)
	if w.After != val {
		return w, fmt.Errorf("%s: 0x%03x wrote %#0*x, reads %#0*x: %w", a, off, 2*width+2, val, 2*width+2, w.After, ErrReadBack)
	}
	return w, nil
}

// ReadRegister reads a 1, 2 or 4 byte register.
func ReadRegister(io ConfigIO, a Address, off, width int) (uint32, error) {
	if width != 1 && width != 2 && width != 4 || off < 0 || off+width > ExtendedSize {
		return 0, fmt.Errorf("%s: bad register 0x%03x width %d", a, off, width)
	}
	buf := make([]byte, width)
	if err := io.ReadConfig(a, int64(off), buf); err != nil {
		return 0, fmt.Errorf("%s: read 0x%03x: %w", a, off, err)
	}
	return decodeLE(buf), nil
}

func decodeLE(b []byte) uint32 {
	switch len(b) {
	case 1:
		return uint32(b[0])
	case 2:
		return uint32(binary.LittleEndian.Uint16(b))
	}
	return binary.LittleEndian.Uint32(b)
}

func encodeLE(b []byte, v uint32) {
	switch len(b) {
	case 1:
		b[0] = byte(v)
	case 2:
		binary.LittleEndian.PutUint16(b, uint16(v))
	default:
		binary.LittleEndian.PutUint32(b, v)
	}
}
