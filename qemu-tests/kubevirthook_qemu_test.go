//go:build qemu

package qemutest

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/hypervisor/libvirttest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// hookTestdata holds what the KubeVirt hook's test (kube/kubevirthook, its own module) holds the
// hook to: for each case, the final domain libvirt kept after virt-launcher's three
// calls (<case>.final.xml) and the NCCL topology file of the last call.
const hookTestdata = "../kube/kubevirthook/testdata"

// jsonDevice is a -device in libvirt's JSON form, as libvirt 9 writes it.
var jsonDevice = regexp.MustCompile(`-device '(\{[^']*\})'`)

// TestKubeVirtHookGuest boots the guest of the hook's final domain, the way scenario 6
// boots a rendered plan: libvirt's own command line for the domain (virsh
// domxml-to-native on a private libvirtd), its PCI controllers as libvirt wrote them,
// each vfio-pci hostdev replaced by the emulated stand-in of its role at the same bus
// and address (topology.EmulatedDevice). Inside, `passage plan` with the qemu-guest
// profile shows each unit's GPU and NICs under one switch (PIX between them), on the
// unit's guest NUMA node, and the NCCL file's bus IDs are the ones the guest enumerates.
func TestKubeVirtHookGuest(t *testing.T) {
	m := manifesttest.B300(7)
	role := map[pci.Address]topology.Role{}
	unitOf := map[pci.Address]string{}
	for _, u := range m.Units {
		for _, f := range u.Functions {
			a, err := pci.ParseAddress(f.BDF)
			if err != nil {
				t.Fatal(err)
			}
			role[a], unitOf[a] = topology.Role(f.Role), u.ID
		}
	}
	uri := libvirttest.Start(t)
	for _, c := range []struct {
		name string
		// guest NUMA node of each unit's functions (-1: no guest NUMA), from the
		// hook test's VMI: gpu0 on host node 0, gpu4 on host node 1 (B300.md).
		nodes map[string]int
	}{
		{"2units", map[string]int{"gpu0": -1, "gpu1": -1}},
		{"2units-2numa", map[string]int{"gpu0": 0, "gpu4": 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			domFile := hostless(t, filepath.Join(hookTestdata, c.name+".final.xml"))
			nccl, err := os.ReadFile(filepath.Join(hookTestdata, c.name+".nccl-topo.xml"))
			if err != nil {
				t.Fatal(err)
			}
			argv := libvirttest.Virsh(t, uri, "domxml-to-native", "--format", "qemu-argv", "--xml", domFile)
			kept := 0
			devices, cdrom := libvirtDevices(t, argv, nil, func(host pci.Address, id, bus string) string {
				r, ok := role[host]
				if !ok {
					t.Fatalf("hostdev %s is no unit's function", host)
				}
				kept++
				return topology.EmulatedDevice(topology.GuestFunction{Role: r, ID: id}, bus)
			})
			if kept != 4*len(c.nodes) {
				t.Fatalf("%d hostdevs in libvirt's command line, want %d:\n%s", kept, 4*len(c.nodes), argv)
			}
			numa := c.nodes["gpu0"] >= 0
			if numa {
				// The domain's two cells, as scenario 6 defines guest nodes.
				for n := 0; n < 2; n++ {
					devices = append([]string{"-object", fmt.Sprintf("memory-backend-ram,id=mem%d,size=1024M", n),
						"-numa", fmt.Sprintf("node,nodeid=%d,cpus=%d,memdev=mem%d", n, n, n)}, devices...)
				}
			}
			t.Logf("devices from libvirt's command line: %s", strings.Join(devices, " "))
			img, err := os.ReadFile(filepath.Join(hookTestdata, c.name+".nccl-topo.img"))
			if err != nil {
				t.Fatal(err)
			}
			if cdrom == nil || cdrom["serial"] != "passage-nccl" {
				t.Fatalf("libvirt's command line has no ide-cd with serial passage-nccl (the hook's NCCL disk): %v\n%s", cdrom, argv)
			}
			got, read := bootHookGuest(t, devices, cdrom, c.name, img)
			// The hook's NCCL disk image, read whole from the guest's SATA CD-ROM
			// (/dev/sr0: the ide-cd libvirt attaches on q35's built-in AHCI, its bus and
			// serial as libvirt wrote them), is the NCCL file.
			if !bytes.Equal(read, img) || !bytes.Equal(bytes.TrimRight(read, "\n"), bytes.TrimRight(nccl, "\n")) {
				t.Errorf("the NCCL CD-ROM read in the guest (%d bytes) is not the hook's image (%d bytes) of the NCCL file", len(read), len(img))
			}

			// Each unit's functions in the guest, by the guest's own labelling.
			var buses []string
			for _, u := range got.Units {
				buses = append(buses, u.GPU)
				buses = append(buses, u.NICs...)
				if len(u.NICs) != 2 || len(u.NVMe) != 1 {
					t.Errorf("guest unit %s: %d NICs, %d NVMe, want 2 and 1", u.ID, len(u.NICs), len(u.NVMe))
				}
				for _, n := range u.NICs {
					for _, x := range []string{u.GPU, n} {
						if d := got.Host.at(x, n); x != n && d != topology.PIX {
							t.Errorf("guest unit %s: %s - %s = %q, want PIX", u.ID, x, n, d)
						}
					}
				}
			}
			if len(got.Units) != len(c.nodes) {
				t.Fatalf("guest has %d units, the domain %d: %+v", len(got.Units), len(c.nodes), got.Units)
			}
			// The guest NUMA node of each unit (guest units in bus order, the hook's
			// units in unit order: both follow the expanders' busNr, highest first).
			var want []int
			var ids []string
			for id := range c.nodes {
				ids = append(ids, id)
			}
			sort.Strings(ids)
			for _, id := range ids {
				want = append(want, c.nodes[id])
			}
			var gotNodes []int
			for _, u := range got.Units {
				gotNodes = append(gotNodes, u.NUMANode)
			}
			sort.Sort(sort.Reverse(sort.IntSlice(gotNodes)))
			sort.Sort(sort.Reverse(sort.IntSlice(want)))
			if fmt.Sprint(gotNodes) != fmt.Sprint(want) {
				t.Errorf("guest units' NUMA nodes %v, the units' guest nodes %v", gotNodes, want)
			}

			// The NCCL file names exactly the GPUs and NICs the guest enumerates.
			ncclBuses := ncclLeaves(t, nccl)
			sort.Strings(buses)
			if strings.Join(ncclBuses, " ") != strings.Join(buses, " ") {
				t.Errorf("NCCL file bus IDs %v, the guest's GPUs and NICs %v\n%s", ncclBuses, buses, nccl)
			}
			t.Logf("guest matrix:\n%s", textOf(got.Host))
		})
	}
}

// libvirtDevices reads libvirt's command line for a domain: its PCI controllers as
// libvirt wrote them (those keep says yes to; nil: all), each vfio-pci hostdev (device
// 0 of its port) as standIn gives it for its host function, libvirt's device id and
// its bus; and the SATA CD-ROM's ide-cd (nil: none), as libvirt attaches it.
func libvirtDevices(t *testing.T, argv string, keep func(map[string]any) bool, standIn func(host pci.Address, id, bus string) string) (devices []string, cdrom map[string]any) {
	t.Helper()
	for _, mm := range jsonDevice.FindAllStringSubmatch(argv, -1) {
		var d map[string]any
		if err := json.Unmarshal([]byte(mm[1]), &d); err != nil {
			t.Fatalf("libvirt's -device %s: %v", mm[1], err)
		}
		switch d["driver"] {
		case "pxb-pcie", "pcie-root-port", "x3130-upstream", "xio3130-downstream":
			if keep == nil || keep(d) {
				devices = append(devices, "-device", keyval(d))
			}
		case "ide-cd":
			cdrom = d
		case "vfio-pci":
			host, err := pci.ParseAddress(fmt.Sprint(d["host"]))
			if err != nil {
				t.Fatalf("hostdev %v: %v", d, err)
			}
			if d["addr"] != "0x0" {
				t.Fatalf("hostdev %s at %v, want device 0 of its port", host, d["addr"])
			}
			devices = append(devices, "-device", standIn(host, fmt.Sprint(d["id"]), fmt.Sprint(d["bus"])))
		}
	}
	return devices, cdrom
}

// keyval writes libvirt's JSON -device in QEMU's key=value form: QEMU 7.2 creates the
// JSON-form devices after the key=value ones, so a stand-in (key=value) would find no
// port to plug into.
func keyval(d map[string]any) string {
	var keys []string
	for k := range d {
		if k != "driver" {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	out := []string{fmt.Sprint(d["driver"])}
	for _, k := range keys {
		v := d[k]
		switch x := v.(type) {
		case bool:
			v = map[bool]string{true: "on", false: "off"}[x]
		case float64:
			v = fmt.Sprintf("%d", int64(x))
		}
		out = append(out, fmt.Sprintf("%s=%v", k, v))
	}
	return strings.Join(out, ",")
}

// hostless is the domain with what this machine cannot give libvirt's command line
// taken out, nothing of the guest's PCI tree (libvirttest.ForCommandLine: the host NUMA
// binding, KVM, the hostdevs' backend probing; each hostdev's stand-in then replaces
// it).
func hostless(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(string(b)); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	kvmHost(t).ForCommandLine(&d)
	s, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), filepath.Base(path))
	if err := os.WriteFile(out, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	return out
}

// ncclLeaves are the bus IDs of the NCCL file's devices (the <pci> without children).
func ncclLeaves(t *testing.T, nccl []byte) []string {
	t.Helper()
	type node struct {
		BusID string `xml:"busid,attr"`
		PCIs  []node `xml:"pci"`
	}
	var sys struct {
		CPUs []struct {
			PCIs []node `xml:"pci"`
		} `xml:"cpu"`
	}
	if err := xml.Unmarshal(nccl, &sys); err != nil {
		t.Fatal(err)
	}
	var out []string
	var walk func(n node)
	walk = func(n node) {
		if len(n.PCIs) == 0 {
			out = append(out, n.BusID)
		}
		for _, c := range n.PCIs {
			walk(c)
		}
	}
	for _, c := range sys.CPUs {
		for _, p := range c.PCIs {
			walk(p)
		}
	}
	sort.Strings(out)
	return out
}

// bootHookGuest boots the image with devices and the hook's CD-ROM (cdrom, libvirt's
// ide-cd, holding disk) and runs `passage plan --json` inside with the qemu-guest
// profile, as scenario 6 does; then it reads the CD-ROM whole. The production image has
// no AHCI or CD-ROM drivers (a node needs none): the test adds them, the kernel
// package's own, as modsel selects them for the image (with their closure and a
// modules.dep), under /lib/modules-extra.
func bootHookGuest(t *testing.T, devices []string, cdrom map[string]any, name string, disk []byte) (measuredPlan, []byte) {
	t.Helper()
	img := filepath.Join(t.TempDir(), "nccl.img")
	if err := os.WriteFile(img, disk, 0o444); err != nil {
		t.Fatal(err)
	}
	devices = append(append([]string{}, devices...),
		"-drive", fmt.Sprintf("file=%s,if=none,id=ncclcd,format=raw,readonly=on,media=cdrom", img),
		"-device", fmt.Sprintf("ide-cd,bus=%v,drive=ncclcd,serial=%v", cdrom["bus"], cdrom["serial"]))
	run, got := measureGuest(t, guestBoot{Name: "kubevirt-hook-" + name, Devices: devices, Then: []string{"cat /dev/sr0"},
		Overlay: extraModules(t, "ahci", "sr_mod"),
		// fakeuinit's modules, then the CD-ROM's.
		Append: []string{"fake.modules=vfio,vfio_iommu_type1,vfio-pci,nvme,virtio_pci,virtio_net,e1000e", "fake.extra-modules=ahci,sr_mod"}})
	return got, run.Files["run-2.out"]
}

// extraModules are the suite kernel's modules names (and their dependency closure), as
// image/modsel stages them for the image, as overlay files under lib/modules-extra.
func extraModules(t *testing.T, names ...string) []OverlayFile {
	t.Helper()
	stage := t.TempDir()
	cmd := exec.Command("go", append([]string{"run", "./image/modsel", "-kernel", filepath.Join(buildDir(t), "kernel"), "-out", stage}, names...)...)
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("modsel %v: %v\n%s", names, err, out)
	}
	var files []OverlayFile
	root := filepath.Join(stage, "lib", "modules")
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		files = append(files, OverlayFile{Name: filepath.ToSlash(filepath.Join("lib", "modules-extra", rel)), Data: b})
		return nil
	})
	if err != nil || len(files) == 0 {
		t.Fatalf("modsel %v staged %d files: %v", names, len(files), err)
	}
	return files
}
