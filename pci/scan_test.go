package pci_test

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// devDir is the real sysfs directory of a named function in a built tree.
func devDir(t *testing.T, n *pcitest.Node, name string) string {
	t.Helper()
	d, err := filepath.EvalSymlinks(filepath.Join(n.Root, pci.DevicesDir, n.Addr(name).String()))
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func scan(t *testing.T, root string) *pci.Tree {
	t.Helper()
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	return tree
}

func lookup(t *testing.T, tree *pci.Tree, n *pcitest.Node, name string) *pci.Device {
	t.Helper()
	d := tree.Lookup(n.Addr(name))
	if d == nil {
		t.Fatalf("%s (%s) not in the tree", name, n.Addr(name))
	}
	return d
}

func TestScanB300Reference(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	tree := scan(t, n.Root)
	if err := tree.Err(); err != nil {
		t.Fatal(err)
	}
	count := map[string]int{}
	for _, d := range tree.Devices {
		count[d.IDs()]++
	}
	for ids, want := range map[string]int{"10de:3182": 8, "15b3:1023": 16, "15b3:197c": 48, "1000:02b2": 8, "144d:a80a": 8, "14e4:16d7": 2, "10de:22a3": 4} {
		if count[ids] != want {
			t.Errorf("%s: %d functions, want %d", ids, count[ids], want)
		}
	}
	// The GPU's parent chain, nearest first, exactly as B300.md's lspci -t shows it.
	gpu := lookup(t, tree, n, "gpu7")
	var chain []string
	for _, a := range gpu.Ancestors() {
		chain = append(chain, a.Addr.String())
	}
	want := []string{"0000:f1:00.0", "0000:f0:00.0", "0000:ee:02.0", "0000:ed:00.0", "0000:ec:00.0", "0000:eb:00.0", "0000:ea:02.0"}
	if strings.Join(chain, " ") != strings.Join(want, " ") {
		t.Errorf("gpu7 ancestors %v, want %v", chain, want)
	}
	if gpu.Addr.String() != "0000:f2:00.0" {
		t.Errorf("gpu7 at %s, want 0000:f2:00.0", gpu.Addr)
	}
	if e := gpu.Express; e == nil || e.Speed.String() != "64GT/s" || e.Width != 16 || e.Type != pci.PortEndpoint {
		t.Errorf("gpu7 link %+v, want Endpoint 64GT/s x16", e)
	}
	rp := lookup(t, tree, n, "rp7")
	if e := rp.Express; e == nil || e.Speed.String() != "32GT/s" || e.Type != pci.PortRootPort {
		t.Errorf("rp7 %+v, want Root Port at 32GT/s", e)
	}
	if rp.SecondaryBus != 0xeb || rp.SubordinateBus != 0xf4 {
		t.Errorf("rp7 bus range [%02x-%02x], want [eb-f4]", rp.SecondaryBus, rp.SubordinateBus)
	}
	if gpu.NUMANode != 1 || lookup(t, tree, n, "gpu0").NUMANode != 0 {
		t.Errorf("NUMA: gpu7 %d gpu0 %d, want 1 and 0", gpu.NUMANode, lookup(t, tree, n, "gpu0").NUMANode)
	}
	if gpu.Driver != "nvidia" || lookup(t, tree, n, "holder0").Driver != "" {
		t.Errorf("drivers: gpu7 %q holder0 %q", gpu.Driver, lookup(t, tree, n, "holder0").Driver)
	}
	pf0, pf1 := lookup(t, tree, n, "nic7.0"), lookup(t, tree, n, "nic7.1")
	for _, pf := range []*pci.Device{pf0, pf1} {
		if pf.VPD.PN() != "900-9X81E-00EX-ST0" || pf.VPD.SN() != "MT2450X01007" || pf.VPD.V3() != "c8a1b2c3d4e5f607" {
			t.Errorf("%s VPD %+v", pf.Addr, pf.VPD)
		}
		if pf.ATS == nil || pf.ATS.Enable {
			t.Errorf("%s ATS %+v, want present and not enabled", pf.Addr, pf.ATS)
		}
		if !pf.MultiFunction {
			t.Errorf("%s not multi-function", pf.Addr)
		}
	}
	dsp := lookup(t, tree, n, "cx-dsp-nic7")
	if dsp.ACS == nil || dsp.ACS.Cap&pci.ACSDT == 0 || dsp.ACS.Ctl != pci.ACSIsolation {
		t.Errorf("cx-dsp-nic7 ACS %+v, want DT advertised and ctl SV RR CR UF", dsp.ACS)
	}
	// ACS isolation everywhere: every endpoint but the two PFs of one adapter (one
	// multi-function device without ACS) has a group of its own.
	groups := tree.Groups()
	if g := groups[gpu.IOMMUGroup]; len(g) != 1 {
		t.Errorf("gpu7 shares IOMMU group %d with %v", gpu.IOMMUGroup, g)
	}
	if pf0.IOMMUGroup != pf1.IOMMUGroup || pf0.IOMMUGroup < 0 {
		t.Errorf("CX-8 PFs in groups %d and %d, want one shared group", pf0.IOMMUGroup, pf1.IOMMUGroup)
	}
	if len(tree.Roots) != 11 {
		t.Errorf("%d root-bus functions, want 11 (2 mgmt root ports, 8 GPU root ports, 1 NVSwitch root port)", len(tree.Roots))
	}
}

func TestScanB200Reference(t *testing.T) {
	n := pcitest.New(t, pcitest.B200())
	tree := scan(t, n.Root)
	if err := tree.Err(); err != nil {
		t.Fatal(err)
	}
	gpu := lookup(t, tree, n, "gpu5")
	if gpu.IDs() != "10de:2901" || gpu.Parent == nil || gpu.Parent.Parent == nil || gpu.Parent.Parent.Addr.String() != "0000:98:00.0" {
		t.Errorf("gpu5 %s %s, want 10de:2901 below switch 98:00.0", gpu.Addr, gpu.IDs())
	}
	if e := gpu.Express; e == nil || e.Speed.String() != "32GT/s" {
		t.Errorf("gpu5 link %+v, want 32GT/s", e)
	}
	if nic := lookup(t, tree, n, "nic5.0"); nic.IDs() != "15b3:1021" || nic.ATS == nil {
		t.Errorf("nic5.0 %s ATS %v", nic.IDs(), nic.ATS)
	}
}

// TestScanSRIOV4096 is the SR-IOV-heavy node: 4096 functions, nearly all VFs, whose
// config space reads Vendor/Device 0xffff so the IDs come from sysfs as lspci takes them.
func TestScanSRIOV4096(t *testing.T) {
	n := pcitest.New(t, pcitest.SRIOVNode(8, 255, 254))
	tree := scan(t, n.Root)
	if err := tree.Err(); err != nil {
		t.Fatal(err)
	}
	if len(tree.Devices) != 4096 {
		t.Fatalf("%d functions, want 4096", len(tree.Devices))
	}
	vfs := 0
	for _, d := range tree.Devices {
		if d.IDs() == "15b3:101e" {
			vfs++
			if d.Parent == nil || d.Parent.Express == nil || d.Parent.Express.Type != pci.PortRootPort {
				t.Fatalf("VF %s parent %v, want its root port", d.Addr, d.Parent)
			}
		}
	}
	if vfs != 8*(255+254) {
		t.Errorf("%d VFs with IDs 15b3:101e, want %d", vfs, 8*(255+254))
	}
	// Every VF sits where the PF's First VF Offset and Stride put it.
	for _, name := range []string{"nic0.0", "nic0.1", "nic7.1"} {
		pf := lookup(t, tree, n, name)
		sr := pf.SRIOV
		if sr == nil || !sr.VFEnable || sr.VFDeviceID != pcitest.DevCX8VF {
			t.Fatalf("%s SR-IOV %+v", name, sr)
		}
		rid := int(pf.Addr.Bus)<<8 | int(pf.Addr.Device)<<3 | int(pf.Addr.Function)
		for v := 0; v < sr.NumVFs; v++ {
			r := rid + sr.FirstVF + v*sr.VFStride
			a := pci.Address{Domain: pf.Addr.Domain, Bus: uint8(r >> 8), Device: uint8(r >> 3 & 31), Function: uint8(r & 7)}
			if d := tree.Lookup(a); d == nil || d.IDs() != "15b3:101e" {
				t.Fatalf("%s VF %d: nothing at %s", name, v, a)
			}
		}
	}
	// lspci agrees on every address and ID.
	out := runLspci(t, "-nD", "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath())
	re := regexp.MustCompile(`(?m)^([0-9a-f:.]+) [0-9a-f]{4}: ([0-9a-f]{4}:[0-9a-f]{4})`)
	ms := re.FindAllStringSubmatch(string(out), -1)
	if len(ms) != 4096 {
		t.Fatalf("lspci lists %d functions", len(ms))
	}
	for _, m := range ms {
		if d := tree.Lookup(pci.MustParseAddress(m[1])); d == nil || d.IDs() != m[2] {
			t.Errorf("%s: lspci %s, ours %v", m[1], m[2], d)
		}
	}
}

// small is a root port above one endpoint with VPD, ACS on the port, ATS on the
// endpoint: enough to break one file at a time.
func small() pcitest.Spec {
	return pcitest.Spec{Hosts: []pcitest.Host{{Bus: 0, NUMA: 1, Fns: []pcitest.Fn{{
		Name: "rp", Dev: 1, Vendor: pcitest.VendorIntel, Device: pcitest.DevRootPort, Class: pcitest.ClassBridge,
		Port: pci.PortRootPort, Link: pcitest.Link{Speed: 5, Width: 16}, Driver: "pcieport",
		ACS: &pcitest.ACS{Cap: pci.ACSIsolation, Ctl: pci.ACSIsolation},
		Below: []pcitest.Fn{{Name: "nic", Vendor: pcitest.VendorMellanox, Device: pcitest.DevCX8, Class: pcitest.ClassEthernet,
			Port: pci.PortEndpoint, Link: pcitest.Link{Speed: 6, Width: 16}, ATS: &pcitest.ATS{Enable: true}, Driver: "mlx5_core",
			VPD: &pci.VPD{Name: "x", Keywords: map[string]string{"PN": "p", "SN": "s", "V3": "v"}}}},
	}}}}}
}

func hasProblem(d *pci.Device, substr string) bool {
	for _, p := range d.Problems {
		if strings.Contains(p, substr) {
			return true
		}
	}
	return false
}

func rewriteConfig(t *testing.T, dir string, edit func(c []byte) []byte) {
	t.Helper()
	p := filepath.Join(dir, "config")
	c, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, edit(c), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestScanMalformed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		break_ func(t *testing.T, n *pcitest.Node)
		check  func(t *testing.T, tree *pci.Tree, n *pcitest.Node)
	}{
		{"config truncated to 64 bytes", func(t *testing.T, n *pcitest.Node) {
			rewriteConfig(t, devDir(t, n, "rp"), func(c []byte) []byte { return c[:64] })
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "rp")
			if len(d.Problems) != 1 || d.Problems[0] != "config space truncated to 64 bytes (not root?)" {
				t.Errorf("problems %q", d.Problems)
			}
			if d.IDs() != "8086:352a" || !d.IsBridge() || d.SecondaryBus != 1 {
				t.Errorf("header not decoded: %s bridge %v sec %d", d.IDs(), d.IsBridge(), d.SecondaryBus)
			}
			if d.ACS != nil || d.Express != nil {
				t.Errorf("capabilities decoded from a header: %v %v", d.ACS, d.Express)
			}
			if err := tree.Err(); err == nil || !strings.Contains(err.Error(), "0000:00:01.0: config space truncated to 64 bytes (not root?)") {
				t.Errorf("tree error %v", err)
			}
		}},
		{"config truncated to 20 bytes", func(t *testing.T, n *pcitest.Node) {
			rewriteConfig(t, devDir(t, n, "nic"), func(c []byte) []byte { return c[:20] })
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			if d := lookup(t, tree, n, "nic"); !hasProblem(d, "config space truncated to 20 bytes") || d.IDs() != "15b3:1023" {
				t.Errorf("%s problems %q", d.IDs(), d.Problems)
			}
		}},
		{"extended config truncated", func(t *testing.T, n *pcitest.Node) {
			rewriteConfig(t, devDir(t, n, "nic"), func(c []byte) []byte { return c[:0x180] })
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			if d := lookup(t, tree, n, "nic"); !hasProblem(d, "extended config space truncated to 384 bytes") {
				t.Errorf("problems %q", d.Problems)
			}
		}},
		{"standard capability loop", func(t *testing.T, n *pcitest.Node) {
			rewriteConfig(t, devDir(t, n, "nic"), func(c []byte) []byte { c[0x61] = 0x40; return c })
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if !hasProblem(d, "capability list: loop back to 0x40 at 0x061") {
				t.Errorf("problems %q", d.Problems)
			}
			if d.Express == nil {
				t.Error("capabilities before the loop were lost")
			}
		}},
		{"extended capability loop", func(t *testing.T, n *pcitest.Node) {
			// AER at 0x100 -> ATS at 0x150 -> back to 0x100.
			rewriteConfig(t, devDir(t, n, "nic"), func(c []byte) []byte {
				// Next pointer, bits 31:20 of the header at 0x150, := 0x100.
				c[0x152] &= 0x0f
				c[0x153] = 0x10
				return c
			})
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if !hasProblem(d, "extended capability list: loop back to 0x100 at 0x150") {
				t.Errorf("problems %q", d.Problems)
			}
			if d.ATS == nil {
				t.Error("ATS before the loop was lost")
			}
		}},
		{"pointer into the header", func(t *testing.T, n *pcitest.Node) {
			rewriteConfig(t, devDir(t, n, "nic"), func(c []byte) []byte { c[0x34] = 0x10; return c })
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			if d := lookup(t, tree, n, "nic"); !hasProblem(d, "capability list: pointer 0x10 into the header at 0x034") {
				t.Errorf("problems %q", d.Problems)
			}
		}},
		{"unaligned pointer", func(t *testing.T, n *pcitest.Node) {
			rewriteConfig(t, devDir(t, n, "nic"), func(c []byte) []byte { c[0x41] = 0x51; return c })
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			if d := lookup(t, tree, n, "nic"); !hasProblem(d, "unaligned pointer 0x51 at 0x041") {
				t.Errorf("problems %q", d.Problems)
			}
		}},
		{"extended pointer past the bytes read", func(t *testing.T, n *pcitest.Node) {
			// ATS at 0x150 points on to 0x400, past a 512-byte read.
			rewriteConfig(t, devDir(t, n, "nic"), func(c []byte) []byte { c[0x153] = 0x40; c[0x152] &= 0x0f; return c[:0x200] })
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if !hasProblem(d, "extended capability list: pointer 0x400 past the 512 bytes read at 0x150") {
				t.Errorf("problems %q", d.Problems)
			}
		}},
		{"config missing: ID files", func(t *testing.T, n *pcitest.Node) {
			if err := os.Remove(filepath.Join(devDir(t, n, "nic"), "config")); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if d.IDs() != "15b3:1023" || d.Class != pcitest.ClassEthernet || !hasProblem(d, "config: no such file or directory") {
				t.Errorf("%s class %06x problems %q", d.IDs(), d.Class, d.Problems)
			}
			if d.Parent == nil || d.Parent.Addr != n.Addr("rp") {
				t.Errorf("parent %v", d.Parent)
			}
		}},
		{"config unreadable", func(t *testing.T, n *pcitest.Node) {
			p := filepath.Join(devDir(t, n, "nic"), "config")
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(p, 0o755); err != nil { // reading a directory fails even as root
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if d.IDs() != "15b3:1023" || !hasProblem(d, "config: is a directory") {
				t.Errorf("%s problems %q", d.IDs(), d.Problems)
			}
		}},
		{"numa_node, driver and iommu_group missing", func(t *testing.T, n *pcitest.Node) {
			for _, f := range []string{"numa_node", "driver", "iommu_group", "driver_override"} {
				if err := os.Remove(filepath.Join(devDir(t, n, "nic"), f)); err != nil {
					t.Fatal(err)
				}
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if d.NUMANode != -1 || d.Driver != "" || d.IOMMUGroup != -1 || len(d.Problems) != 0 {
				t.Errorf("numa %d driver %q group %d problems %q", d.NUMANode, d.Driver, d.IOMMUGroup, d.Problems)
			}
		}},
		{"malformed numa_node and iommu_group", func(t *testing.T, n *pcitest.Node) {
			dir := devDir(t, n, "nic")
			if err := os.WriteFile(filepath.Join(dir, "numa_node"), []byte("zero\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			os.Remove(filepath.Join(dir, "iommu_group"))
			if err := os.Symlink("../../kernel/iommu_groups/x", filepath.Join(dir, "iommu_group")); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if !hasProblem(d, `numa_node: malformed "zero"`) || !hasProblem(d, `iommu_group: malformed link "x"`) || d.NUMANode != -1 {
				t.Errorf("problems %q", d.Problems)
			}
		}},
		{"driver_override set", func(t *testing.T, n *pcitest.Node) {
			if err := os.WriteFile(filepath.Join(devDir(t, n, "nic"), "driver_override"), []byte("vfio-pci\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			if d := lookup(t, tree, n, "nic"); d.DriverOverride != "vfio-pci" {
				t.Errorf("driver_override %q", d.DriverOverride)
			}
		}},
		{"function vanished mid-scan (dangling link)", func(t *testing.T, n *pcitest.Node) {
			if err := os.RemoveAll(devDir(t, n, "nic")); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			if tree.Lookup(n.Addr("nic")) != nil {
				t.Error("vanished function still in the tree")
			}
			if len(tree.Problems) != 1 || tree.Problems[0] != "0000:01:00.0: vanished during scan" {
				t.Errorf("tree problems %q", tree.Problems)
			}
			if len(tree.Devices) != 1 {
				t.Errorf("%d functions, want the root port alone", len(tree.Devices))
			}
		}},
		{"link outside the root", func(t *testing.T, n *pcitest.Node) {
			l := filepath.Join(n.Root, pci.DevicesDir, n.Addr("nic").String())
			os.Remove(l)
			if err := os.Symlink("../../../../../../../etc", l); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			// Not read at all: everything under a root resolves beneath it.
			nic := n.Addr("nic").String()
			if d := tree.Lookup(n.Addr("nic")); d != nil || !slices.ContainsFunc(tree.Problems, func(p string) bool {
				return strings.HasPrefix(p, nic+": ") && strings.Contains(p, "points outside the root")
			}) {
				t.Fatalf("nic %v, tree problems %q", d, tree.Problems)
			}
		}},
		{"not a PCI address", func(t *testing.T, n *pcitest.Node) {
			if err := os.Mkdir(filepath.Join(n.Root, pci.DevicesDir, "junk"), 0o755); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			if len(tree.Problems) != 1 || !strings.Contains(tree.Problems[0], "junk: not a PCI address") || len(tree.Devices) != 2 {
				t.Errorf("problems %q, %d functions", tree.Problems, len(tree.Devices))
			}
		}},
		{"VPD malformed", func(t *testing.T, n *pcitest.Node) {
			// Identifier string, then a VPD-R resource claiming 0x200 bytes.
			b := []byte{0x82, 2, 0, 'h', 'i', 0x90, 0x00, 0x02, 'P', 'N'}
			if err := os.WriteFile(filepath.Join(devDir(t, n, "nic"), "vpd"), b, 0o600); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if !hasProblem(d, "vpd: resource 0x90 at 5: length 512 runs past 10 bytes") || d.VPD == nil || d.VPD.Name != "hi" {
				t.Errorf("problems %q vpd %+v", d.Problems, d.VPD)
			}
		}},
		{"VPD missing", func(t *testing.T, n *pcitest.Node) {
			if err := os.Remove(filepath.Join(devDir(t, n, "nic"), "vpd")); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, tree *pci.Tree, n *pcitest.Node) {
			d := lookup(t, tree, n, "nic")
			if d.VPD != nil || len(d.Problems) != 0 {
				t.Errorf("problems %q vpd %+v", d.Problems, d.VPD)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, small())
			tc.break_(t, n)
			tree := scan(t, n.Root)
			tc.check(t, tree, n)
		})
	}
}

func TestScanMissingRoot(t *testing.T) {
	_, err := pci.Scan(t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "sys/bus/pci/devices") {
		t.Fatalf("err %v", err)
	}
}

// sriovSmall is one ConnectX-8 PF with three VFs below a root port.
func sriovSmall() pcitest.Spec {
	return pcitest.Spec{Hosts: []pcitest.Host{{Bus: 0, Fns: []pcitest.Fn{{
		Name: "rp", Dev: 1, Vendor: pcitest.VendorIntel, Device: pcitest.DevRootPort, Class: pcitest.ClassBridge,
		Port: pci.PortRootPort, Link: pcitest.Link{Speed: 5, Width: 16}, Driver: "pcieport",
		ACS: &pcitest.ACS{Cap: pci.ACSIsolation, Ctl: pci.ACSIsolation},
		Below: []pcitest.Fn{{Name: "pf", Vendor: pcitest.VendorMellanox, Device: pcitest.DevCX8, Class: pcitest.ClassEthernet,
			Port: pci.PortEndpoint, Link: pcitest.Link{Speed: 6, Width: 16}, Driver: "mlx5_core",
			SRIOV: &pcitest.SRIOV{Total: 3, Num: 3, VFDevice: pcitest.DevCX8VF, VFDriver: "mlx5_core"}}},
	}}}}}
}

// TestScanVFIDs: a VF's IDs come from its PF's SR-IOV capability as the kernel sets them,
// without its vendor and device files; a VF that no PF accounts for has them read, and
// one that has neither is a problem, not a guess.
func TestScanVFIDs(t *testing.T) {
	n := pcitest.New(t, sriovSmall())
	pf := lookup(t, scan(t, n.Root), n, "pf")
	var vfDirs []string
	for i := 1; i <= 3; i++ {
		a := pf.Addr
		a.Function += uint8(i) // First VF Offset and Stride put them right after the PF here
		d, err := filepath.EvalSymlinks(filepath.Join(n.Root, pci.DevicesDir, a.String()))
		if err != nil {
			t.Fatal(err)
		}
		vfDirs = append(vfDirs, d)
	}
	// VF 1's files go: the PF still names it. The PF is edited to account for only
	// VFs 1 and 2, and VF 2's device file is edited: VF 2 keeps the PF's word, VF 3
	// (unaccounted) is read from its files, and without files it is a problem.
	for _, f := range []string{"vendor", "device"} {
		if err := os.Remove(filepath.Join(vfDirs[0], f)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(vfDirs[1], "device"), []byte("0x1234\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(vfDirs[2], "device"), []byte("0x4321\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sriovOff := 0
	for _, c := range pf.ExtCaps {
		if c.ID == pci.ExtCapSRIOV {
			sriovOff = c.Offset
		}
	}
	rewriteConfig(t, devDir(t, n, "pf"), func(c []byte) []byte {
		c[sriovOff+pci.SRIOVNum] = 2
		return c
	})
	tree := scan(t, n.Root)
	want := []string{"15b3:101e", "15b3:101e", "15b3:4321"}
	for i, w := range want {
		a := pf.Addr
		a.Function += uint8(i + 1)
		d := tree.Lookup(a)
		if d == nil || d.IDs() != w || d.Err() != nil {
			t.Errorf("VF %d: %v IDs %s problems %v, want %s and none", i+1, d, d.IDs(), d.Err(), w)
		}
	}
	for _, f := range []string{"vendor", "device"} {
		if err := os.Remove(filepath.Join(vfDirs[2], f)); err != nil {
			t.Fatal(err)
		}
	}
	tree = scan(t, n.Root)
	a := pf.Addr
	a.Function += 3
	if d := tree.Lookup(a); d == nil || d.IDs() != "ffff:ffff" || !hasProblem(d, "no PF's SR-IOV capability accounts for it") {
		t.Errorf("unaccounted VF without files: %v %v", d, d.Problems)
	}
}

func TestVFs(t *testing.T) {
	pf := pci.Address{Domain: 1, Bus: 0xfe, Device: 31, Function: 0}
	for _, tc := range []struct {
		name string
		sr   *pci.SRIOV
		want []string
	}{
		{"no capability", nil, nil},
		{"VFs disabled", &pci.SRIOV{NumVFs: 2, FirstVF: 1, VFStride: 1}, nil},
		{"none enabled", &pci.SRIOV{VFEnable: true, FirstVF: 1, VFStride: 1}, nil},
		{"zero offset", &pci.SRIOV{VFEnable: true, NumVFs: 2, VFStride: 1}, nil},
		{"stride 2 across a bus", &pci.SRIOV{VFEnable: true, NumVFs: 3, FirstVF: 7, VFStride: 2},
			[]string{"0001:fe:1f.7", "0001:ff:00.1", "0001:ff:00.3"}},
		{"zero stride stops after one", &pci.SRIOV{VFEnable: true, NumVFs: 3, FirstVF: 1},
			[]string{"0001:fe:1f.1"}},
		{"past bus 255 stops", &pci.SRIOV{VFEnable: true, NumVFs: 300, FirstVF: 8, VFStride: 1}, nil},
	} {
		d := &pci.Device{Addr: pf, SRIOV: tc.sr}
		var got []string
		for _, a := range d.VFs() {
			got = append(got, a.String())
		}
		if tc.name == "past bus 255 stops" {
			// 0xfe:1f.0 + 8 is 0xff:00.0; 256 VFs fit on bus 0xff, the rest would not.
			if len(got) != 256 || got[255] != "0001:ff:1f.7" {
				t.Errorf("%s: %d VFs, last %v", tc.name, len(got), got[len(got)-1:])
			}
			continue
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
