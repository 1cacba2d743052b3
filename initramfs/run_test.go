package initramfs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// fakeMounts models the two mounts SetUpRun makes on a tree: a tmpfs mount is recorded
// (the directory stays what it is), a move replaces the target by the source's tree and
// leaves the source an empty directory, as the mount point left behind is.
type fakeMounts struct {
	calls   []string
	mounted map[string]bool
	fail    map[string]error // by the call's first word: "tmpfs", "move", "unmount"
}

func (f *fakeMounts) ops() RunOps {
	return RunOps{
		IsMount: func(dir string) (bool, error) { return f.mounted[dir], nil },
		Mount: func(source, target, fstype string, flags uintptr, data string) error {
			if flags&unix.MS_MOVE != 0 {
				f.calls = append(f.calls, fmt.Sprintf("move %s %s", source, target))
				if err := f.fail["move"]; err != nil {
					return err
				}
				if err := os.RemoveAll(target); err != nil {
					return err
				}
				if err := os.Rename(source, target); err != nil {
					return err
				}
				f.mounted[target] = true
				return os.Mkdir(source, 0o755)
			}
			f.calls = append(f.calls, fmt.Sprintf("%s %s %s %#x %s", source, target, fstype, flags, data))
			if err := f.fail["tmpfs"]; err != nil {
				return err
			}
			f.mounted[target] = true
			return nil
		},
		Unmount: func(target string) error {
			f.calls = append(f.calls, "unmount "+target)
			delete(f.mounted, target)
			return f.fail["unmount"]
		},
	}
}

// imageRun is an initramfs root whose /run already holds files (an overlay's, a program's
// that ran before passage): a directory with a mode of its own, a file, a link.
func imageRun(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	for p, c := range map[string]string{"run/passage/preflight-plan.json": `{"units":2}`, "run/note": "x"} {
		os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(root, "run/passage"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("passage/preflight-plan.json", filepath.Join(root, "run/plan")); err != nil {
		t.Fatal(err)
	}
	return root
}

// TestSetUpRun: /run becomes a tmpfs mounted as systemd mounts it, on a staging directory
// first, holding a copy of what /run held (modes and links kept), moved onto /run in one
// call; the staging directory is gone.
func TestSetUpRun(t *testing.T) {
	root := imageRun(t)
	f := &fakeMounts{mounted: map[string]bool{}}
	what, err := SetUpRun(root, f.ops())
	if err != nil {
		t.Fatal(err)
	}
	stage, run := filepath.Join(root, runStaging), filepath.Join(root, "run")
	want := []string{
		fmt.Sprintf("tmpfs %s tmpfs %#x mode=0755,size=20%%,nr_inodes=800k", stage, unix.MS_NOSUID|unix.MS_NODEV|unix.MS_STRICTATIME),
		"move " + stage + " " + run,
	}
	if !reflect.DeepEqual(f.calls, want) {
		t.Errorf("calls\n%q\nwant\n%q", f.calls, want)
	}
	if !strings.Contains(what, "/run is a tmpfs") || !strings.Contains(what, "4 entries") || !strings.Contains(what, "switch_root") {
		t.Errorf("said %q", what)
	}
	if b, err := os.ReadFile(filepath.Join(run, "passage/preflight-plan.json")); err != nil || string(b) != `{"units":2}` {
		t.Errorf("preflight file: %q %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(run, "passage")); err != nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("run/passage: %v %v, want mode 0750 kept", fi, err)
	}
	if fi, err := os.Stat(filepath.Join(run, "note")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("run/note: %v %v, want mode 0600 kept", fi, err)
	}
	if l, err := os.Readlink(filepath.Join(run, "plan")); err != nil || l != "passage/preflight-plan.json" {
		t.Errorf("run/plan link %q %v", l, err)
	}
	if _, err := os.Stat(stage); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("staging %s left behind: %v", stage, err)
	}

	// Again, with /run now a mount point (a second boot run, a booted host): nothing.
	f.calls = nil
	what, err = SetUpRun(root, f.ops())
	if err != nil || len(f.calls) != 0 || !strings.Contains(what, "mount point already") {
		t.Errorf("/run mounted: %q %v, calls %q", what, err, f.calls)
	}
}

// TestSetUpRunNoRun: an image without /run gets one, an empty tmpfs.
func TestSetUpRunNoRun(t *testing.T) {
	root := t.TempDir()
	f := &fakeMounts{mounted: map[string]bool{}}
	what, err := SetUpRun(root, f.ops())
	if err != nil || len(f.calls) != 2 || !strings.Contains(what, "0 entries") {
		t.Fatalf("%q %v, calls %q", what, err, f.calls)
	}
	if fi, err := os.Stat(filepath.Join(root, "run")); err != nil || !fi.IsDir() {
		t.Errorf("run: %v %v", fi, err)
	}
}

// TestSetUpRunFailure: a mount that fails leaves /run as it was, nothing mounted and no
// staging directory, and the error names the step.
func TestSetUpRunFailure(t *testing.T) {
	for _, tc := range []struct {
		fail    string
		calls   int // calls made, the undoing unmount included
		unmount bool
		inErr   string
	}{
		{"tmpfs", 1, false, "mount tmpfs on"},
		{"move", 3, true, "move"},
	} {
		t.Run(tc.fail, func(t *testing.T) {
			root := imageRun(t)
			f := &fakeMounts{mounted: map[string]bool{}, fail: map[string]error{tc.fail: unix.EPERM}}
			_, err := SetUpRun(root, f.ops())
			if err == nil || !errors.Is(err, unix.EPERM) || !strings.Contains(err.Error(), tc.inErr) {
				t.Fatalf("err %v, want EPERM at %q", err, tc.inErr)
			}
			if len(f.calls) != tc.calls || strings.HasPrefix(f.calls[len(f.calls)-1], "unmount") != tc.unmount {
				t.Errorf("calls %q", f.calls)
			}
			for dir := range f.mounted {
				t.Errorf("%s left mounted", dir)
			}
			if _, err := os.Stat(filepath.Join(root, runStaging)); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("staging left behind: %v", err)
			}
			if b, err := os.ReadFile(filepath.Join(root, "run/passage/preflight-plan.json")); err != nil || string(b) != `{"units":2}` {
				t.Errorf("/run changed: %q %v", b, err)
			}
		})
	}
}

// TestSetUpRunRefusesDevice: a device node or a FIFO in the image's /run is not copied
// into the tmpfs behind the boot's back: the set-up is undone and the error names it.
func TestSetUpRunRefusesDevice(t *testing.T) {
	root := imageRun(t)
	if err := unix.Mkfifo(filepath.Join(root, "run/fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	f := &fakeMounts{mounted: map[string]bool{}}
	_, err := SetUpRun(root, f.ops())
	if err == nil || !strings.Contains(err.Error(), "run/fifo") {
		t.Fatalf("err %v, want the FIFO named", err)
	}
	if len(f.mounted) != 0 {
		t.Errorf("left mounted: %v", f.mounted)
	}
}
