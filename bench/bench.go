// Package bench measures passage against what an operator would otherwise run (lspci,
// setpci and a shell script over them) on the same synthetic sysfs trees, and holds the
// pieces cmd/benchtable and the baseline's correctness test share: tree building on
// tmpfs, the baseline script runner, and alternating median timing.
package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"syscall"
	"time"

	"github.com/passage-boot/passage/pci/pcitest"
)

// tmpfsMagic is TMPFS_MAGIC from linux/magic.h.
const tmpfsMagic = 0x01021994

// ScratchDir makes a directory for trees, on /dev/shm when it is tmpfs: a tree is
// thousands of small files, and both sides should read them from the page cache, not
// wait on a disk.
func ScratchDir(prefix string) (string, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs("/dev/shm", &st); err == nil && st.Type == tmpfsMagic {
		if d, err := os.MkdirTemp("/dev/shm", prefix); err == nil {
			return d, nil
		}
	}
	return os.MkdirTemp("", prefix)
}

// BuildTree writes spec into a new directory below parent.
func BuildTree(parent, name string, spec pcitest.Spec) (*pcitest.Node, error) {
	dir := filepath.Join(parent, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("tree %s: %w", name, err)
	}
	n, err := pcitest.Build(dir, spec)
	if err != nil {
		return nil, fmt.Errorf("tree %s: %w", name, err)
	}
	return n, nil
}

// B300Scaled is the reference B300 node cut to its first units GPU complexes (the
// management NICs and the NVSwitch complex stay), with perPF SR-IOV VFs on each
// ConnectX-8 PF: the shape a node takes when the NICs' virtual functions are on. It has
// 14 + 15*units + 2*units*perPF functions.
func B300Scaled(units, perPF int) pcitest.Spec {
	full := pcitest.B300()
	var s pcitest.Spec
	gpu := 0
	for _, h := range full.Hosts {
		if slices.Contains(pcitest.B300GPUBuses[:], h.Bus) {
			if gpu >= units {
				continue
			}
			gpu++
		}
		s.Hosts = append(s.Hosts, h)
	}
	var walk func(fns []pcitest.Fn)
	walk = func(fns []pcitest.Fn) {
		for i := range fns {
			f := &fns[i]
			if f.Vendor == pcitest.VendorMellanox && f.Device == pcitest.DevCX8 && perPF > 0 {
				f.SRIOV = &pcitest.SRIOV{Total: perPF, Num: perPF, VFDevice: pcitest.DevCX8VF, VFDriver: "mlx5_core"}
			}
			walk(f.Below)
		}
	}
	for h := range s.Hosts {
		walk(s.Hosts[h].Fns)
	}
	return s
}

// Side is one contender of a row: a name and one run of it. Prepare, when set, runs
// before each run outside the timer (a fresh tree for a side that writes).
type Side struct {
	Name    string
	Prepare func() error
	Run     func() error
}

// Sample is what Measure learned about one side.
type Sample struct {
	Name   string
	Times  []time.Duration
	Median time.Duration
	// Allocs and Bytes are heap allocations per run (median), for in-process sides; a
	// process side allocates in the child, which this process cannot see.
	Allocs, Bytes uint64
}

// Measure runs the sides round-robin, rounds times each, so drift on the machine (other
// engineers' builds on these two cores) lands on every side alike, and returns each
// side's median. One warm-up round runs first and is not counted.
func Measure(rounds int, sides ...Side) ([]Sample, error) {
	out := make([]Sample, len(sides))
	allocs := make([][]uint64, len(sides))
	bytes := make([][]uint64, len(sides))
	for i, s := range sides {
		out[i].Name = s.Name
	}
	var ms0, ms1 runtime.MemStats
	for r := -1; r < rounds; r++ {
		for i, s := range sides {
			if s.Prepare != nil {
				if err := s.Prepare(); err != nil {
					return nil, fmt.Errorf("%s: prepare: %w", s.Name, err)
				}
			}
			runtime.ReadMemStats(&ms0)
			t0 := time.Now()
			err := s.Run()
			d := time.Since(t0)
			runtime.ReadMemStats(&ms1)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", s.Name, err)
			}
			if r < 0 {
				continue
			}
			out[i].Times = append(out[i].Times, d)
			allocs[i] = append(allocs[i], ms1.Mallocs-ms0.Mallocs)
			bytes[i] = append(bytes[i], ms1.TotalAlloc-ms0.TotalAlloc)
		}
	}
	for i := range out {
		out[i].Median = Median(out[i].Times)
		out[i].Allocs = medianU(allocs[i])
		out[i].Bytes = medianU(bytes[i])
	}
	return out, nil
}

// Median of durations (the mean of the middle two for an even count).
func Median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func medianU(xs []uint64) uint64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func removeAll(tb interface{ Errorf(string, ...any) }, dir string) {
	if err := os.RemoveAll(dir); err != nil {
		tb.Errorf("bench: cleanup: %v", err)
	}
}
