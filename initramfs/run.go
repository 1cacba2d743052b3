package initramfs

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// RunMount is how /run is mounted: as systemd mounts it (src/shared/mount-setup.c:
// tmpfs, nosuid, nodev, strictatime, mode=0755, size=20%, nr_inodes=800k) and as
// dracut's initramfs does. systemd, started by switch_root on the real root, keeps a /run
// that is already a mount point instead of mounting its own, so the OS runs on this one,
// with /run/passage in it.
var RunMount = struct {
	FSType string
	Flags  uintptr
	Data   string
}{"tmpfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_STRICTATIME, "mode=0755,size=20%,nr_inodes=800k"}

// RunOps are the calls SetUpRun makes; LinuxRunOps are the kernel's, tests put a model of
// mounts here.
type RunOps struct {
	// IsMount says whether dir is a mount point.
	IsMount func(dir string) (bool, error)
	// Mount is mount(2).
	Mount func(source, target, fstype string, flags uintptr, data string) error
	// Unmount is umount(2), for undoing a set-up that failed half-way.
	Unmount func(target string) error
}

// LinuxRunOps are the kernel's mount calls. A mount point is a directory on another
// device than its parent (what u-root's mount.SameFilesystem, and so switch_root's
// choice of what to move, looks at).
func LinuxRunOps() RunOps {
	return RunOps{
		IsMount: func(dir string) (bool, error) {
			var d, p unix.Stat_t
			if err := unix.Stat(dir, &d); err != nil {
				return false, err
			}
			if err := unix.Stat(filepath.Dir(filepath.Clean(dir)), &p); err != nil {
				return false, err
			}
			return d.Dev != p.Dev, nil
		},
		Mount:   unix.Mount,
		Unmount: func(target string) error { return unix.Unmount(target, 0) },
	}
}

// runStaging is where the tmpfs is mounted and filled before it is moved onto /run.
const runStaging = "/.passage-run"

// SetUpRun makes root/run a tmpfs holding what root/run held, unless it is a mount
// point already, and says what it did.
//
// Why: the initramfs's /run is a directory of the rootfs, and switch_root (u-root's
// mount.SwitchRoot, as util-linux's) moves only mount points (/dev, /proc, /sys, /run)
// into the real root before it deletes the old root's files: without a mount, the
// manifest, its event log and everything else in /run/passage would be deleted, and the
// real root's /run would not have them (the DRA plugin's DaemonSet mounts /run/passage as
// a hostPath that must exist). u-root's init mounts /dev, /proc, /sys, /tmp and more,
// but not /run (pkg/libinit); passage does, whether it is the uinit or PID 1 (rdinit=),
// before anything writes /run/passage.
//
// The tmpfs is mounted on a staging directory, filled with a copy of /run (what an
// overlay or a program before passage put there: the QEMU tests' preflight writes
// /run/passage/preflight-*), then moved onto /run in one mount(MS_MOVE): /run is never
// seen empty. The copies in the rootfs beneath it are deleted by switch_root with the
// rest of the old root. On an error nothing is left mounted and /run is as it was: the
// boot goes on, and the console says the handoff will lose /run.
func SetUpRun(root string, ops RunOps) (string, error) {
	run := filepath.Join(root, "run")
	if err := os.MkdirAll(run, 0o755); err != nil {
		return "", fmt.Errorf("/run: %w", err)
	}
	mounted, err := ops.IsMount(run)
	if err != nil {
		return "", fmt.Errorf("/run: %w", err)
	}
	if mounted {
		return "/run is a mount point already: kept", nil
	}
	stage := filepath.Join(root, runStaging)
	if err := os.MkdirAll(stage, 0o755); err != nil {
		return "", fmt.Errorf("/run: staging %s: %w", stage, err)
	}
	m := RunMount
	if err := ops.Mount(m.FSType, stage, m.FSType, m.Flags, m.Data); err != nil {
		os.Remove(stage)
		return "", fmt.Errorf("/run: mount %s on %s: %w", m.FSType, stage, err)
	}
	undo := func(err error) (string, error) {
		if uerr := ops.Unmount(stage); uerr != nil {
			return "", errors.Join(err, fmt.Errorf("/run: unmount %s: %w", stage, uerr))
		}
		// Unmounted, it is the rootfs's empty directory again (what a copy left in it
		// went with the tmpfs).
		os.RemoveAll(stage)
		return "", err
	}
	n, err := copyTree(run, stage)
	if err != nil {
		return undo(fmt.Errorf("/run: copy into the tmpfs: %w", err))
	}
	if err := ops.Mount(stage, run, "", unix.MS_MOVE, ""); err != nil {
		return undo(fmt.Errorf("/run: move %s onto %s: %w", stage, run, err))
	}
	if err := os.Remove(stage); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("/run: mounted, but staging %s stays: %w", stage, err)
	}
	return fmt.Sprintf("/run is a %s (%s), %d entries of the image's /run kept: switch_root moves it into the real root", m.FSType, m.Data, n), nil
}

// copyTree copies directories, regular files and symbolic links of src into dst (which
// exists), with their modes and owners; it returns how many it copied. Anything else (a
// device node, a socket, a FIFO) is an error: nothing in an initramfs's /run should be
// one before the boot has run.
func copyTree(src, dst string) (int, error) {
	n := 0
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil || rel == "." {
			return err
		}
		to := filepath.Join(dst, rel)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			err = os.Mkdir(to, fi.Mode().Perm())
		case d.Type()&fs.ModeSymlink != 0:
			var target string
			if target, err = os.Readlink(p); err == nil {
				err = os.Symlink(target, to)
			}
		case d.Type().IsRegular():
			err = copyFile(p, to, fi.Mode().Perm())
		default:
			return fmt.Errorf("%s: %v, not a file, directory or link", p, fi.Mode().Type())
		}
		if err != nil {
			return err
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			if err := os.Lchown(to, int(st.Uid), int(st.Gid)); err != nil {
				return err
			}
		}
		if d.Type()&fs.ModeSymlink == 0 {
			// Mkdir and create apply the umask; the copy keeps the mode.
			if err := os.Chmod(to, fi.Mode()&(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)); err != nil {
				return err
			}
		}
		n++
		return nil
	})
	return n, err
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
