package manifest

import (
	"fmt"
	"io"
	"os"
	"syscall"
)

// MaxKeyFileSize bounds a public key or enrolment file: a PEM key is a few hundred
// bytes, an enrolment a few hundred more.
const MaxKeyFileSize = 64 << 10

// errTooLarge is wrapped by ReadRegular's size refusal.
type errTooLarge struct {
	path string
	size string
	max  int64
}

func (e *errTooLarge) Error() string {
	return fmt.Sprintf("%s: %s bytes, over the %d-byte limit", e.path, e.size, e.max)
}

// ReadRegular reads a regular file of at most max bytes. The open does not block (a FIFO
// named in its place would wait for a writer), anything but a regular file is refused
// before a byte is read, the size is checked on the open file and the read goes through
// a limit, so a file that grows meanwhile is caught too.
func ReadRegular(path string, max int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file (%s)", path, fi.Mode().Type())
	}
	if fi.Size() > max {
		return nil, &errTooLarge{path: path, size: fmt.Sprint(fi.Size()), max: max}
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, &errTooLarge{path: path, size: "more than " + fmt.Sprint(max), max: max}
	}
	return b, nil
}
