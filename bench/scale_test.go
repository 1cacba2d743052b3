package bench

import (
	"path/filepath"
	"testing"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"golang.org/x/sys/unix"
)

// benchScanPlan is scan+decide (what `passage plan` computes: decision.Decide) on a B300 node with perPF
// SR-IOV VFs per ConnectX-8 PF, per function; cmd/benchtable's row 4 reports the same at
// 100, 1 000 and 10 000 functions. Run with -cpu 1 for the one-core target.
func benchScanPlan(b *testing.B, units, perPF int, planToo bool) {
	dir, err := ScratchDir("bench-scale-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { removeAll(b, dir) })
	n, err := pcitest.Build(dir, B300Scaled(units, perPF))
	if err != nil {
		b.Fatal(err)
	}
	prof, err := topology.Builtin("b300")
	if err != nil {
		b.Fatal(err)
	}
	fns := 0
	b.ReportAllocs()
	for b.Loop() {
		tree, err := pci.Scan(n.Root)
		if err != nil {
			b.Fatal(err)
		}
		fns = len(tree.Devices)
		if !planToo {
			continue
		}
		d, err := decision.Decide(decision.Input{Tree: tree, Profile: prof})
		if err != nil {
			b.Fatal(err)
		}
		if d.LabelErr != nil {
			b.Fatal(d.LabelErr)
		}
		if len(d.Units()) != units || len(d.ACS) == 0 {
			b.Fatalf("decision: %d units, %d ACS ports", len(d.Units()), len(d.ACS))
		}
		// With VFs enabled on every PF the audit fails every unit (releasing a PF would
		// remove its VFs), so there is no guest to plan: that is the decision's answer,
		// not the benchmark's failure. Without VFs the guest plan must succeed.
		if d.GuestErr != nil && perPF == 0 {
			b.Fatal(d.GuestErr)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*fns), "ns/fn")
}

func BenchmarkScanPlan1000(b *testing.B)  { benchScanPlan(b, 8, 54, true) }
func BenchmarkScanPlan10000(b *testing.B) { benchScanPlan(b, 8, 617, true) }
func BenchmarkScan10000(b *testing.B)     { benchScanPlan(b, 8, 617, false) }

// BenchmarkSyscallFloor10000 is SyscallFloor on the 10 000-function tree: the system calls
// alone, for comparison with BenchmarkScan10000.
func BenchmarkSyscallFloor10000(b *testing.B) {
	dir, err := ScratchDir("bench-floor-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { removeAll(b, dir) })
	n, err := pcitest.Build(dir, B300Scaled(8, 617))
	if err != nil {
		b.Fatal(err)
	}
	fns := 0
	for b.Loop() {
		if fns, err = SyscallFloor(n.Root); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*fns), "ns/fn")
}

// BenchmarkSysfsCall is the price of one file of a function on this machine, on the
// B300 tree: openat+read+close of its config and of numa_node, readlinkat of its
// iommu_group, each relative to the function's parent directory as the scan opens them.
// SyscallFloor is about a dozen of these per function.
func BenchmarkSysfsCall(b *testing.B) {
	n := pcitest.New(b, pcitest.B300())
	link := filepath.Join(n.Root, pci.DevicesDir, n.Addr("gpu0").String())
	dir, err := filepath.EvalSymlinks(link)
	if err != nil {
		b.Fatal(err)
	}
	pfd, err := unix.Open(filepath.Dir(dir), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(pfd)
	base := filepath.Base(dir)
	buf := make([]byte, 2*pci.ExtendedSize)
	for _, f := range []string{"config", "numa_node"} {
		b.Run("openat+read+close "+f, func(b *testing.B) {
			for b.Loop() {
				fd, err := unix.Openat(pfd, base+"/"+f, unix.O_RDONLY|unix.O_CLOEXEC, 0)
				if err != nil {
					b.Fatal(err)
				}
				unix.Read(fd, buf)
				unix.Close(fd)
			}
		})
	}
	b.Run("readlinkat iommu_group", func(b *testing.B) {
		for b.Loop() {
			if _, err := unix.Readlinkat(pfd, base+"/iommu_group", buf); err != nil {
				b.Fatal(err)
			}
		}
	})
}
