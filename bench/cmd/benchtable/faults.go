package main

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/bench"
)

// usage is what a child process cost, run by run: CPU (user+sys) and the minor page
// faults the kernel counted for it (ru_minflt). On a virtual machine a fault can cost
// tens of times what it does on bare metal (row O4), so the fault count, which does not
// depend on the machine, says more than CPU time about a start-up.
type usage struct {
	cpu    []time.Duration
	faults []int64
}

// procUsage runs name and records its usage in u.
func procUsage(u *usage, name string, args ...string) func() error {
	return func() error {
		cmd := exec.Command(name, args...)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s %s: %w: %s", filepath.Base(name), strings.Join(args, " "), err, firstLine(stderr.String()))
		}
		ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage)
		if !ok {
			return fmt.Errorf("%s: no rusage", filepath.Base(name))
		}
		u.cpu = append(u.cpu, cmd.ProcessState.UserTime()+cmd.ProcessState.SystemTime())
		u.faults = append(u.faults, ru.Minflt)
		return nil
	}
}

// medians are u's medians, the first run (bench.Measure's warm-up) left out.
func (u *usage) medians() (time.Duration, int64) {
	f := make([]time.Duration, 0, len(u.faults))
	for _, n := range u.faults[1:] {
		f = append(f, time.Duration(n)) // bench.Median orders durations; a count is one too
	}
	return bench.Median(u.cpu[1:]), int64(bench.Median(f))
}

// faultCost is what a first touch of an anonymous page costs this machine: pages pages
// of a fresh private mapping, written once each, timed, and counted by the kernel
// (RUSAGE_THREAD, the goroutine locked to its thread); the best of rounds. It fails
// unless the kernel counted at least one fault per page, so the time is the faults'.
func faultCost(pages, rounds int) (per time.Duration, faults int64, err error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	size := pages * unix.Getpagesize()
	best := time.Duration(-1)
	for range rounds {
		m, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return 0, 0, fmt.Errorf("mmap %d pages: %w", pages, err)
		}
		// A page at a time, also where transparent huge pages are "always".
		if err := unix.Madvise(m, unix.MADV_NOHUGEPAGE); err != nil {
			unix.Munmap(m)
			return 0, 0, fmt.Errorf("madvise: %w", err)
		}
		var before, after unix.Rusage
		if err := unix.Getrusage(unix.RUSAGE_THREAD, &before); err != nil {
			unix.Munmap(m)
			return 0, 0, err
		}
		start := time.Now()
		for i := 0; i < size; i += unix.Getpagesize() {
			m[i] = 1
		}
		d := time.Since(start)
		err = unix.Getrusage(unix.RUSAGE_THREAD, &after)
		unix.Munmap(m)
		if err != nil {
			return 0, 0, err
		}
		n := after.Minflt - before.Minflt
		if n < int64(pages) {
			return 0, 0, fmt.Errorf("touching %d fresh pages counted %d faults", pages, n)
		}
		if best < 0 || d < best {
			best, faults = d, n
		}
	}
	return best / time.Duration(faults), faults, nil
}
