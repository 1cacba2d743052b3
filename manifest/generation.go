package manifest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Counter hands out this node's next manifest generation. Each call returns a value
// greater than any it returned before, across reboots.
type Counter interface {
	Next() (uint64, error)
	Source() GenerationSource
}

// NextGeneration asks each counter in turn (TPM NV first, then a file on persistent
// storage, as the boot stage orders them) and returns the first answer. When none
// answers it returns 0 and GenerationNone, with every counter's error joined, so the
// manifest still gets written and says it cannot be ordered.
func NextGeneration(counters ...Counter) (uint64, GenerationSource, error) {
	var errs []error
	for _, c := range counters {
		if c == nil {
			continue
		}
		n, err := c.Next()
		if err == nil {
			return n, c.Source(), nil
		}
		errs = append(errs, fmt.Errorf("generation %s: %w", c.Source(), err))
	}
	return 0, GenerationNone, errors.Join(errs...)
}

// FileCounter keeps the generation as a decimal number in a file on persistent storage.
// It is monotonic only as long as nobody restores an older copy of the file: a TPM NV
// counter is preferred when there is one.
type FileCounter struct {
	Path string
}

// Source implements Counter.
func (FileCounter) Source() GenerationSource { return GenerationFile }

// Next reads the stored value (0 when the file does not exist yet), stores value+1
// atomically and returns it. The new value is on disk before it is used, so a crash
// can skip a generation but never reuse one.
func (c FileCounter) Next() (uint64, error) {
	var cur uint64
	b, err := os.ReadFile(c.Path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return 0, fmt.Errorf("counter %s: %w", c.Path, err)
	default:
		cur, err = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("counter %s: %w", c.Path, err)
		}
	}
	if cur == ^uint64(0) {
		return 0, fmt.Errorf("counter %s: exhausted", c.Path)
	}
	next := cur + 1
	if err := WriteAtomic(filepath.Dir(c.Path), filepath.Base(c.Path), []byte(strconv.FormatUint(next, 10)+"\n")); err != nil {
		return 0, fmt.Errorf("counter %s: %w", c.Path, err)
	}
	return next, nil
}
