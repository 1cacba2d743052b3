// Command vfio-probe is the program of the node test's probe image (images.Node,
// "vfio-probe"): run in a pod, it says which VFIO device nodes the container was given.
// It lists /dev/vfio, one entry a line, sorted by name:
//
//	/dev/vfio: 2 entries
//	12 char 511:0
//	vfio char 10:196
//
// (NAME TYPE [MAJOR:MINOR], TYPE one of char, block, dir, symlink, file, other; the numbers
// only for devices), or "/dev/vfio: absent". The listing goes to stdout and to
// /dev/termination-log, the kubelet's default terminationMessagePath, so the test reads
// it from the pod's status (containerStatuses[].state.terminated.message) without logs.
// It exits 0 once both are written (after $PROBE_SLEEP, when set: Go duration or whole
// seconds), 1 if it could not list or write, 2 on a bad flag or PROBE_SLEEP.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

func main() { os.Exit(run(os.Args[1:], os.Getenv("PROBE_SLEEP"), os.Stdout, os.Stderr)) }

func run(args []string, sleep string, stdout, stderr io.Writer) int {
	fl := flag.NewFlagSet("vfio-probe", flag.ContinueOnError)
	fl.SetOutput(stderr)
	dir := fl.String("dir", "/dev/vfio", "the `DIR` listed")
	term := fl.String("termination-log", "/dev/termination-log", "the `FILE` the listing is also written to (the kubelet's terminationMessagePath)")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	var wait time.Duration
	if sleep != "" {
		var err error
		if wait, err = parseSleep(sleep); err != nil {
			fmt.Fprintf(stderr, "vfio-probe: PROBE_SLEEP=%q: %v\n", sleep, err)
			return 2
		}
	}
	listing, err := list(*dir)
	if err != nil {
		fmt.Fprintf(stderr, "vfio-probe: %v\n", err)
		return 1
	}
	fmt.Fprint(stdout, listing)
	if err := os.WriteFile(*term, []byte(listing), 0o644); err != nil {
		fmt.Fprintf(stderr, "vfio-probe: %v\n", err)
		return 1
	}
	time.Sleep(wait)
	return 0
}

// parseSleep takes a Go duration ("90s", "2m") or whole seconds ("90").
func parseSleep(s string) (time.Duration, error) {
	if n, err := strconv.ParseUint(s, 10, 32); err == nil {
		return time.Duration(n) * time.Second, nil
	}
	d, err := time.ParseDuration(s)
	if err == nil && d < 0 {
		err = errors.New("negative")
	}
	return d, err
}

// list is dir's listing as the package comment shows it. Entries are not followed or
// opened: a symbolic link is named as one, a device by its numbers (lstat's st_rdev).
func list(dir string) (string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return dir + ": absent\n", nil
	}
	if err != nil {
		return "", err
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d entries\n", dir, len(names))
	for _, n := range names {
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(dir, n), &st); err != nil {
			return "", fmt.Errorf("lstat %s: %w", filepath.Join(dir, n), err)
		}
		kind, dev := "other", false
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFCHR:
			kind, dev = "char", true
		case unix.S_IFBLK:
			kind, dev = "block", true
		case unix.S_IFDIR:
			kind = "dir"
		case unix.S_IFLNK:
			kind = "symlink"
		case unix.S_IFREG:
			kind = "file"
		}
		if dev {
			fmt.Fprintf(&b, "%s %s %d:%d\n", n, kind, unix.Major(st.Rdev), unix.Minor(st.Rdev))
		} else {
			fmt.Fprintf(&b, "%s %s\n", n, kind)
		}
	}
	return b.String(), nil
}
