package kmod

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

var errExist error = unix.EEXIST

// finit loads one module file. A compressed module goes to the kernel as it is with
// MODULE_INIT_COMPRESSED_FILE (Linux 6.4+, CONFIG_MODULE_DECOMPRESS); an older kernel
// refuses the flag with EINVAL (or the file with ENOEXEC), and then the module is
// decompressed here and handed over with init_module.
func (ix *Index) finit(m *Module) error {
	f, err := os.Open(m.Path)
	if err != nil {
		return err
	}
	defer f.Close()
	if moduleExt(filepath.Base(m.Path)) == ".ko" {
		return unix.FinitModule(int(f.Fd()), "", 0)
	}
	err = unix.FinitModule(int(f.Fd()), "", unix.MODULE_INIT_COMPRESSED_FILE)
	if err == nil || errors.Is(err, unix.EEXIST) {
		return err
	}
	if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOEXEC) && !errors.Is(err, unix.EOPNOTSUPP) {
		return err
	}
	if _, err := f.Seek(0, 0); err != nil {
		return err
	}
	b, derr := decompress(m.Path, f)
	if derr != nil {
		return fmt.Errorf("finit_module: %v; %w", err, derr)
	}
	return unix.InitModule(b, "")
}
