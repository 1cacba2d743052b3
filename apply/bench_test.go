package apply

import (
	"context"
	"testing"

	"github.com/passage-boot/passage/pci"
)

// BenchmarkACSB300 is one apply of the reference plan (32 ports, 8 of them written) through
// sysfs config files; the tree is restored between iterations, outside the timer.
func BenchmarkACSB300(b *testing.B) {
	tb := newB300(b, nil)
	plan := tb.plan(b)
	io := pci.SysfsConfig{Root: tb.node.Root}
	for b.Loop() {
		b.StopTimer()
		sharedB300(b)
		b.StartTimer()
		rep, err := ACS(context.Background(), plan, Options{IO: io})
		if err != nil || rep.Writes() != 8 {
			b.Fatalf("%v, %d writes", err, rep.Writes())
		}
	}
}

// BenchmarkACSB300Idempotent is the second run: reads only.
func BenchmarkACSB300Idempotent(b *testing.B) {
	tb := newB300(b, nil)
	plan := tb.plan(b)
	io := pci.SysfsConfig{Root: tb.node.Root}
	if _, err := ACS(context.Background(), plan, Options{IO: io}); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		rep, err := ACS(context.Background(), plan, Options{IO: io})
		if err != nil || rep.Writes() != 0 {
			b.Fatalf("%v, %d writes", err, rep.Writes())
		}
	}
}
