package main

import (
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMain lets the test binary be the child procUsage measures: with
// BENCHTABLE_TOUCH=N it writes N fresh pages and exits.
func TestMain(m *testing.M) {
	if v := os.Getenv("BENCHTABLE_TOUCH"); v != "" {
		n, _ := strconv.Atoi(v)
		b, err := unix.Mmap(-1, 0, n*os.Getpagesize()+1, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			os.Exit(3)
		}
		unix.Madvise(b, unix.MADV_NOHUGEPAGE)
		for i := 0; i < len(b); i += os.Getpagesize() {
			b[i] = 1
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestProcUsage: the faults procUsage records are the child's own. A child writing 3000
// more fresh pages than another is counted about 3000 faults more (a start-up's own
// count varies by some tens from run to run, more under -race), and its CPU time is
// recorded.
func TestProcUsage(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var u usage
	for _, pages := range []int{1, 3001} {
		t.Setenv("BENCHTABLE_TOUCH", strconv.Itoa(pages))
		if err := procUsage(&u, self)(); err != nil {
			t.Fatal(err)
		}
	}
	if len(u.faults) != 2 || len(u.cpu) != 2 {
		t.Fatalf("recorded %d faults and %d CPU times for 2 runs", len(u.faults), len(u.cpu))
	}
	if d := u.faults[1] - u.faults[0]; d < 2900 || d > 3500 {
		t.Errorf("3000 more pages written, %d more faults counted (%v)", d, u.faults)
	}
	if u.cpu[1] <= 0 {
		t.Errorf("CPU %v", u.cpu[1])
	}
	if err := procUsage(&u, "/nonexistent/benchtable-child")(); err == nil {
		t.Error("a child that cannot start was measured")
	}
}

// TestFaultCost: row O4 counts a fault for every page it times, and a positive cost.
func TestFaultCost(t *testing.T) {
	per, n, err := faultCost(256, 2)
	if err != nil {
		t.Fatal(err)
	}
	if n < 256 || per <= 0 {
		t.Errorf("256 pages: %d faults counted, %v each", n, per)
	}
}
