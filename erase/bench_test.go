package erase_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// Simulated controller latency: each admin command takes commandLatency, a sanitize
// stays in progress for sanitizeTime (polled every pollInterval).
const (
	commandLatency = 2 * time.Millisecond
	sanitizeTime   = 40 * time.Millisecond
	pollInterval   = 5 * time.Millisecond
)

// BenchmarkEraseStage erases the eight NVMe of a B300 node (each unit's NVMe moved to
// nvme, sanitized, read back, parked; every function reset) through the simulated
// kernel and controllers: all units in parallel, as the boot does, against one unit
// after another.
func BenchmarkEraseStage(b *testing.B) {
	for _, mode := range []string{"parallel", "serial"} {
		b.Run(mode+"/8-nvme", func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				lab, k, open := benchNode(b)
				o := erase.RunOptions{Erase: erase.Options{PollInterval: pollInterval, Samples: 64}}
				b.StartTimer()
				var reps []*erase.Report
				if mode == "parallel" {
					reps = append(reps, erase.Run(context.Background(), k, lab, lab.Units, open, o))
				} else {
					for _, u := range lab.Units {
						reps = append(reps, erase.Run(context.Background(), k, lab, []*topology.Unit{u}, open, o))
					}
				}
				b.StopTimer()
				for _, r := range reps {
					for _, u := range r.Units {
						if p := u.Problems(); len(p) > 0 {
							b.Fatalf("unit %s: %v", u.ID, p)
						}
					}
				}
				b.StartTimer()
			}
		})
	}
}

func benchNode(b *testing.B) (*topology.Labels, *vfiotest.Kernel, erase.Opener) {
	root := pcitest.New(b, pcitest.B300()).Root
	tree, err := pci.Scan(root)
	if err != nil {
		b.Fatal(err)
	}
	k, err := vfiotest.New(root)
	if err != nil {
		b.Fatal(err)
	}
	if err := k.Load("vfio-pci"); err != nil {
		b.Fatal(err)
	}
	ctrls := map[pci.Address]*erasetest.Controller{}
	for _, d := range tree.Devices {
		dir := filepath.Join(root, pci.DevicesDir, d.Addr.String())
		if err := os.WriteFile(filepath.Join(dir, "reset_method"), []byte("flr\n"), 0o644); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "reset"), nil, 0o200); err != nil {
			b.Fatal(err)
		}
		if d.Class == pcitest.ClassNVMe {
			c := erasetest.New("S", erase.SANICAPCES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 30})
			c.Faults.Latency, c.Faults.SanitizeTime = commandLatency, sanitizeTime
			ctrls[d.Addr] = c
		}
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		b.Fatal(err)
	}
	lab, err := topology.Label(tree, p)
	if err != nil {
		b.Fatal(err)
	}
	return lab, k, func(_ context.Context, a pci.Address) (erase.Controller, string, error) { return ctrls[a], "nvme", nil }
}
