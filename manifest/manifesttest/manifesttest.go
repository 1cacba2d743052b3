// Package manifesttest builds manifests for tests and benchmarks: a whole B300 node's
// worth of units, functions and ACS changes, with fixed values so signatures are
// reproducible.
package manifesttest

import (
	"fmt"
	"time"

	"github.com/passage-boot/passage/buildinfo"
	"github.com/passage-boot/passage/manifest"
)

// BootID is the boot id of the manifests built here.
const BootID = "6f1c2a4e-8d3b-4c7a-9e15-2b7d0f4a9c31"

// KubeletKey is a node.kubelet_key of the right shape (the digest of no key anyone
// holds), for manifests whose kubelet key only has to be there.
const KubeletKey = "sha256:5d41402abc4b2a76b9719d911017c592f3c6a8e4b1d9e0f2a7c5b3d1e9f0a8c6"

// Build is the build the manifests built here name.
var Build = buildinfo.Info{Version: "v1.4.0", Revision: "3f2a9c1d5e7b8a604f1c2d3e4b5a69788c9d0e1f", GoVersion: "go1.26.0"}

// B300 is a manifest the size of a whole B300 node: 8 units, each a GPU, the two
// ConnectX-8 PFs and an NVMe, with the bridges' ACS changes and ATS findings.
func B300(gen uint64) *manifest.Manifest {
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion,
		Build:         &Build,
		Node: manifest.Node{Hostname: "b300-r07-n3", DMISerial: "S3R1AL-0042", DMIUUID: "4c4c4544-0042-3810-8057-b3c04f4b4d32",
			BoardName: "X14DBG-AP", Vendor: "Supermicro", Product: "SYS-A22GA-NBRT"},
		BootID:           BootID,
		Generation:       gen,
		GenerationSource: manifest.GenerationFile,
		Time:             time.Date(2026, 3, 14, 9, 26, 53, 589793238, time.UTC),
		KernelRelease:    "6.12.48",
		KernelCmdline:    "console=ttyS0 passage.tpm=on",
		Profile:          manifest.Profile{Name: "b300", Digest: "sha256:9f2b5c0d1e3a4b6c7d8e9f00112233445566778899aabbccddeeff0011223344"},
	}
	// Bus numbers follow B300.md's subtree: the GPU at f2, the CX-8 at ef, NVMe at f4.
	bases := []int{0x1b, 0x3b, 0x5b, 0x7b, 0x9b, 0xbb, 0xdb, 0xeb}
	labels := []string{}
	for i, b := range bases {
		// Each function sits alone in its IOMMU group, as with ACS redirect on every port.
		group := 40 + 4*i
		fn := func(bus, fnum int, vendor, device, subDevice, class, role, speed string, width int) manifest.Function {
			group++
			return manifest.Function{
				BDF: fmt.Sprintf("0000:%02x:00.%d", bus, fnum), Vendor: vendor, Device: device,
				SubsystemVendor: vendor, SubsystemDevice: subDevice, Class: class, Role: role,
				IOMMUGroup: group, NUMANode: i / 4, DriverBefore: "", DriverAfter: "vfio-pci",
				Link: manifest.Link{Speed: speed, Width: width, MaxSpeed: speed, MaxWidth: width},
				BARs: ExampleBARs[role],
			}
		}
		u := manifest.Unit{
			ID:       fmt.Sprintf("gpu%d", i),
			Status:   manifest.StatusReady,
			NUMANode: i / 4,
			Functions: []manifest.Function{
				fn(b+7, 0, "0x10de", "0x3182", "0x20e6", "0x030200", "gpu", "64GT/s", 16),
				fn(b+4, 0, "0x15b3", "0x1023", "0x0071", "0x020700", "gpu-nic", "64GT/s", 16),
				fn(b+4, 1, "0x15b3", "0x1023", "0x0071", "0x020700", "gpu-nic", "64GT/s", 16),
				fn(b+9, 0, "0x144d", "0xa80a", "0xa801", "0x010802", "gpu-nvme", "16GT/s", 4),
			},
		}
		// DESIGN.md's policy: DirectTrans only on the downstream port above the CX-8 NIC;
		// the ports above it keep the isolation default.
		const iso = "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-"
		const dt = "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+"
		for _, port := range []int{b + 1, b + 2} {
			u.ACSChanges = append(u.ACSChanges, manifest.ACSChange{
				Port: fmt.Sprintf("0000:%02x:00.0", port), Before: iso, Target: iso, After: iso, Result: "unchanged",
			})
		}
		u.ACSChanges = append(u.ACSChanges, manifest.ACSChange{
			Port: fmt.Sprintf("0000:%02x:00.0", b+3), Before: iso, Target: dt, After: dt, Result: "applied",
		})
		u.ATSFindings = []manifest.Finding{{Object: u.Functions[1].BDF, Severity: "info", Message: "ATS capability present (ATSCap: Invalidate Queue Depth: 00)"}}
		m.Units = append(m.Units, u)
		labels = append(labels, "GPU"+fmt.Sprint(i))
	}
	host := make([][]string, len(labels))
	guest := make([][]string, len(labels))
	for i := range labels {
		host[i] = make([]string, len(labels))
		guest[i] = make([]string, len(labels))
		for j := range labels {
			host[i][j], guest[i][j] = "NV18", "NV18"
			if i == j {
				host[i][j], guest[i][j] = "X", "X"
			}
		}
	}
	m.GuestPlan = &manifest.GuestPlan{
		Plan:          []byte(`{"switches": 8, "pxb_per_numa": true}`),
		MatrixLabels:  labels,
		HostMatrix:    host,
		ExpectedGuest: guest,
	}
	for _, s := range []string{"modules", "scan", "label", "firmware", "acs", "vfio", "host", "manifest"} {
		m.Stages = append(m.Stages, manifest.StageResult{Name: s, Status: "ok", Duration: 1234567 * time.Nanosecond})
	}
	return m
}

// ExampleBARs are the BARs the example gives each role: pcitest's reference B300 sizes
// (GPU BAR1 512 GiB; see pci/pcitest).
var ExampleBARs = map[string][]manifest.BAR{
	"gpu": {{Index: 0, Size: 64 << 20}, {Index: 1, Size: 512 << 30, Is64: true, Prefetchable: true},
		{Index: 3, Size: 32 << 20, Is64: true, Prefetchable: true}},
	"gpu-nic":  {{Index: 0, Size: 32 << 20, Is64: true, Prefetchable: true}},
	"gpu-nvme": {{Index: 0, Size: 32 << 10, Is64: true}},
}

// TestModules is a made-up Module ID wiring for B300's units, gpu0 to gpu7, out of PCI
// order as strapping numbers modules. It is a test wiring: no public table maps a B300
// node's GPUs to Module IDs.
var TestModules = []int{5, 6, 7, 8, 1, 2, 3, 4}

// HGXPartitions is the NVLink partition layout of HGX B200/B300 as sets of Module IDs
// (NVIDIA Fabric Manager User Guide; topology's built-in b300 profile).
var HGXPartitions = [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 2}, {3, 4}, {5, 6}, {7, 8},
	{1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}

// B300Fabric is B300 with every unit's Module ID declared (TestModules, keyed by the
// GPU's address) and the HGX partition layout, as a boot under a profile with modules and
// nvlink_partitions signs it. B300 itself signs every Module ID as 0, unknown, and no
// layout.
func B300Fabric(gen uint64) *manifest.Manifest {
	m := B300(gen)
	for i := range m.Units {
		u := &m.Units[i]
		u.ModuleID = TestModules[i]
		u.ModuleSource = fmt.Sprintf("profile %s: modules[%s]", m.Profile.Name, u.Functions[0].BDF)
	}
	nv := &manifest.NVLink{Source: "profile " + m.Profile.Name + ": nvlink_partitions"}
	for _, set := range HGXPartitions {
		nv.Partitions = append(nv.Partitions, append([]int(nil), set...))
	}
	m.NVLink = nv
	return m
}
