package pci_test

import (
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// benchScan reports ns/op and allocs for a whole scan, and reads/fn: the sysfs files and
// links one function costs (config, numa_node, driver, driver_override, iommu_group, and
// vpd where the capability says so).
func benchScan(b *testing.B, spec pcitest.Spec) {
	n := pcitest.New(b, spec)
	tree, reads, err := pci.ScanCounting(n.Root)
	if err != nil {
		b.Fatal(err)
	}
	fns := len(tree.Devices)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := pci.Scan(n.Root); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(fns), "functions")
	b.ReportMetric(float64(reads)/float64(fns), "reads/fn")
}

func BenchmarkScanB300(b *testing.B)      { benchScan(b, pcitest.B300()) }
func BenchmarkScanSRIOV4096(b *testing.B) { benchScan(b, pcitest.SRIOVNode(8, 255, 254)) }
