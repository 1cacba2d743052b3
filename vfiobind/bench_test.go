package vfiobind

import (
	"context"
	"fmt"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

func benchNode(b *testing.B) (*pcitest.Node, *pci.Tree, *vfiotest.Kernel) {
	n := pcitest.New(b, pcitest.B300())
	tree, err := pci.Scan(n.Root)
	if err != nil {
		b.Fatal(err)
	}
	k, err := vfiotest.New(n.Root)
	if err != nil {
		b.Fatal(err)
	}
	if err := k.Load(Modules...); err != nil {
		b.Fatal(err)
	}
	return n, tree, k
}

// BenchmarkBindSequence times the per-BDF sequence (driver link read, driver_override,
// unbind of the host driver, drivers_probe, verification of the driver link and
// /dev/vfio/<group>) against the simulated kernel on a synthetic tree; the host driver
// is restored outside the timer. It measures passage's own cost per device; a real
// kernel adds the drivers' remove and probe times.
func BenchmarkBindSequence(b *testing.B) {
	n, tree, k := benchNode(b)
	opts := Options{}.withDefaults()
	ctx := context.Background()
	for _, name := range []string{"gpu0", "nic0.0", "nvme0"} {
		b.Run(name, func(b *testing.B) {
			d := tree.Lookup(n.Addr(name))
			for b.Loop() {
				st := &fnState{dev: d}
				if _, err := bindFunction(ctx, k, st, opts); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				var fr FunctionReport
				if _, err := restore(ctx, k, st, &fr); err != nil {
					b.Fatal(err)
				}
				k.ResetWrites()
				b.StartTimer()
			}
		})
	}
}

// BenchmarkBindB300 binds the whole reference node (8 units, 32 functions; the audit
// is the caller's, not timed here) and reports the cost per function.
func BenchmarkBindB300(b *testing.B) {
	n, tree, k := benchNode(b)
	mk := func() []*topology.Unit {
		var us []*topology.Unit
		for i := 0; i < 8; i++ {
			l := func(f string) *pci.Device { return tree.Lookup(n.Addr(fmt.Sprintf(f, i))) }
			us = append(us, &topology.Unit{ID: topology.UnitID(i), GPU: l("gpu%d"), NICs: []*pci.Device{l("nic%d.0"), l("nic%d.1")}, NVMe: []*pci.Device{l("nvme%d")}})
		}
		return us
	}
	fns := 0
	for b.Loop() {
		units := mk()
		rep, err := Bind(context.Background(), k, tree, units, Options{Modules: k})
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		var all []*pci.Device
		for _, u := range units {
			if ur := rep.Unit(u.ID); ur == nil || !ur.Bound() {
				b.Fatalf("unit %d: report %+v, want bound", u.ID, ur)
			}
			all = append(all, u.Functions()...)
		}
		fns = len(all)
		if _, err := Release(context.Background(), k, all, Options{}); err != nil {
			b.Fatal(err)
		}
		k.ResetWrites()
		b.StartTimer()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*fns), "ns/function")
}
