package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestListing: a /dev/vfio as a container sees it (the container node, two groups' nodes,
// made with mknod in a temporary directory and never opened), a directory and a symbolic
// link: the listing on stdout and in the termination log, exit 0; PROBE_SLEEP holds the
// exit; a missing directory is said, an unwritable termination log is an error.
func TestListing(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatalf("mknod needs root (uid %d)", os.Geteuid())
	}
	dir := filepath.Join(t.TempDir(), "vfio")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, dev := range map[string][2]uint32{"vfio": {10, 196}, "12": {511, 0}, "300": {4095, 1048575}} {
		if err := unix.Mknod(filepath.Join(dir, name), unix.S_IFCHR|0o600, int(unix.Mkdev(dev[0], dev[1]))); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "devices"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/dev/null", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	want := dir + ": 5 entries\n12 char 511:0\n300 char 4095:1048575\ndevices dir\nlink symlink\nvfio char 10:196\n"
	term := filepath.Join(t.TempDir(), "termination-log")

	for _, c := range []struct {
		sleep string
		took  time.Duration
	}{{"", 0}, {"300ms", 300 * time.Millisecond}, {"1", time.Second}} {
		var stdout, stderr bytes.Buffer
		start := time.Now()
		code := run([]string{"-dir", dir, "-termination-log", term}, c.sleep, &stdout, &stderr)
		took := time.Since(start)
		if code != 0 || stdout.String() != want || stderr.Len() != 0 {
			t.Fatalf("PROBE_SLEEP=%q: exit %d, stdout:\n%s\nwant:\n%s\nstderr: %s", c.sleep, code, &stdout, want, &stderr)
		}
		if b, err := os.ReadFile(term); err != nil || string(b) != want {
			t.Errorf("termination log %q (%v)", b, err)
		}
		if took < c.took {
			t.Errorf("PROBE_SLEEP=%q: exited after %v", c.sleep, took)
		}
	}

	for _, c := range []struct {
		args         []string
		sleep        string
		code         int
		stdout, errs string
	}{
		{[]string{"-dir", filepath.Join(dir, "none"), "-termination-log", term}, "", 0, filepath.Join(dir, "none") + ": absent\n", ""},
		{[]string{"-dir", dir, "-termination-log", filepath.Join(dir, "none", "log")}, "", 1, want, "vfio-probe: open " + filepath.Join(dir, "none", "log")},
		{[]string{"-dir", dir, "-termination-log", term}, "soon", 2, "", `vfio-probe: PROBE_SLEEP="soon"`},
		{[]string{"-dir", dir, "-termination-log", term}, "-1s", 2, "", `vfio-probe: PROBE_SLEEP="-1s": negative`},
		{[]string{"-dir", term, "-termination-log", term}, "", 1, "", "vfio-probe: open " + term + ": not a directory"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(c.args, c.sleep, &stdout, &stderr)
		if code != c.code || stdout.String() != c.stdout || !strings.Contains(stderr.String(), c.errs) {
			t.Errorf("%q PROBE_SLEEP=%q: exit %d, want %d; stdout %q; stderr %q", c.args, c.sleep, code, c.code, &stdout, &stderr)
		}
	}
}
