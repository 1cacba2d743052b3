package manifest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// WriteAtomic replaces dir/name with data so that a crash at any point leaves either the
// previous file or the new one, never a torn mix: the bytes go to a temporary file in the
// same directory (rename is only atomic within one file system), are fsynced, renamed over
// the target, and the directory is fsynced so the rename itself survives a power cut.
// A crash before the rename can leave a ".name.tmp*" file behind; it is never read, and
// the next successful write of the same name removes it (one writer per name assumed).
func WriteAtomic(dir, name string, data []byte) error {
	return writeAtomic(dir, name, data, 0o644)
}

// WriteAtomicPrivate is WriteAtomic for a secret (a private key): the file is mode 0600
// from its creation (os.CreateTemp's) to its rename, never readable by another user.
func WriteAtomicPrivate(dir, name string, data []byte) error {
	return writeAtomic(dir, name, data, 0o600)
}

func writeAtomic(dir, name string, data []byte, perm os.FileMode) (err error) {
	target := filepath.Join(dir, name)
	if name == "" || filepath.Base(name) != name {
		return fmt.Errorf("write %s: name must be a plain file name", target)
	}
	f, err := os.CreateTemp(dir, "."+name+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", target, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if err = f.Chmod(perm); err != nil {
		return fmt.Errorf("write %s: chmod temp: %w", target, err)
	}
	if _, err = f.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", target, err)
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("write %s: fsync temp: %w", target, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("write %s: close temp: %w", target, err)
	}
	if err = os.Rename(tmp, target); err != nil {
		return fmt.Errorf("write %s: rename: %w", target, err)
	}
	removeStale(dir, "."+name+".tmp")
	return syncDir(dir)
}

// removeStale deletes temp files earlier writers left when they were killed. Failure is
// harmless (the files are never read), so it is not reported.
func removeStale(dir, prefix string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.Type().IsRegular() && strings.HasPrefix(e.Name(), prefix) {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	return nil
}
