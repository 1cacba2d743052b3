//go:build qemu

package qemutest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/hypervisor/libvirttest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// standInSize is the BAR2 largeBARStandIn gives a function: its largest BAR, 4 KiB at
// least.
func standInSize(f topology.HostFunction) uint64 {
	size := uint64(4096)
	for _, b := range f.BARs {
		size = max(size, b.Size)
	}
	return size
}

// largeBARStandIn is a QEMUDevice whose stand-in for each function has no I/O BAR (as
// GPUs and ConnectX PFs have none: an I/O BAR per function exhausts x86's 64 KiB I/O
// space past about four units, and OVMF then drops whole devices) and a 64-bit
// prefetchable BAR2 the size of the function's largest BAR: ivshmem-plain over a
// memory backend on a sparse file, which takes address space and no memory. objects
// collects the -object arguments the devices need.
func largeBARStandIn(t *testing.T, dir string, objects *[]string) topology.QEMUDevice {
	return func(f topology.GuestFunction, bus string) string {
		size := standInSize(f.Host)
		path := filepath.Join(dir, f.ID)
		fh, err := os.Create(path)
		if err == nil {
			err = fh.Truncate(int64(size))
			if cerr := fh.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		*objects = append(*objects, "-object", fmt.Sprintf("memory-backend-file,id=mem-%s,size=%d,mem-path=%s,share=on", f.ID, size, path))
		return fmt.Sprintf("ivshmem-plain,id=%s,bus=%s,addr=0x0,memdev=mem-%s", f.ID, bus, f.ID)
	}
}

// TestLargeBARGuests boots, under OVMF, the KubeVirt hook's whole final domains
// (largeBARHookGuest): 8 units at the width the hook demands for them beside KubeVirt's
// root ports, OVMF's widest, and 1 unit at one bit less than the width the hook demands
// for it; each with stand-ins of B300's BAR sizes (GPU 512 GiB) and no I/O BAR;
// checkLargeBARs holds each to the same checks. The hook's refusals are
// kube/kubevirthook's test (TestOnDefineDomainThreeCalls). What render writes is booted
// at B300's BAR sizes by TestRenderedGuestsStart (until 7 Dec this test booted render's
// own --format qemu guests of 1, 2, 4 and 8 units too), and render's widths and its
// refusals at one bit less are hypervisor's TestRenderWidths. It runs beside the
// suite's other parallel tests (TestRenderedGuestsStart), two guests at a time.
func TestLargeBARGuests(t *testing.T) {
	t.Parallel()
	// TCG runs each guest's one vCPU on one thread: two guests at a time take the two
	// cores. The 8-unit guest comes first: the longest boots start first.
	for _, c := range []struct {
		name    string
		domain  string
		bits    int // 0: the planner's width for the domain
		missing int // stand-ins left without BAR2, each a 512 GiB one
	}{
		// Eight units beside KubeVirt's seven root ports at OVMF's widest: the
		// ports' padding goes in the last unit's alignment gap.
		{"kubevirt-hook-8units", "8units", 0, 0},
		// One bit short of the width the hook demands for it.
		{"kubevirt-hook-1unit-42bits", "1unit", 42, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			largeBARHookGuest(t, c.domain, c.bits, c.missing)
		})
	}
}

// largeBARHookGuest boots the hook's final domain (kube/kubevirthook/testdata/<domain>.final.xml:
// what libvirt kept after virt-launcher's three calls for a VMI with host-passthrough)
// whole, as TestKubeVirtHookGuest boots its domains: libvirt's own command line, each
// hostdev replaced by the largeBARStandIn of its function's BARs at the same bus and
// address, and every root port kept, the hook's and KubeVirt's (for its devices, which
// are not booted, and 3 bare ones for hotplug). OVMF pads each of KubeVirt's from the
// units' 64-bit window (topology.MMIO). Under TCG the guest gets its width as phys-bits
// (on a node host-passthrough gives it the host's): bits, or (0) the one the planner
// demands for the units beside those ports, which is what the hook demands
// (TestOnDefineDomainThreeCalls accepts 1unit at 43 bits and refuses it at 42, and
// 8units at 46 and 45). missing is how many stand-ins OVMF leaves without
// their BAR2 at that width: OVMF rejects the largest consumer, a GPU's.
//
// KubeVirt's root ports get io-reserve=0: Debian 12's OVMF (edk2-stable202211) pads
// every hotplug port with a 4 KiB I/O window, and with KubeVirt's seven beside a
// unit's five its 40 KiB I/O aperture overflows and it assigns nothing at all
// (measured); edk2 stopped padding I/O in edk2-stable202308 (27727338b2c0), and the
// OVMF of KubeVirt v1.9.0's virt-launcher (CentOS Stream 9's edk2 20241117) pads none.
// libvirt gives the hook's ports no io-reserve either: one unit's, or 8 units' alone
// (before this test booted the whole domain), get every BAR.
func largeBARHookGuest(t *testing.T, domain string, bits, missing int) {
	src, err := hypervisor.Sources(manifesttest.B300(7))
	if err != nil {
		t.Fatal(err)
	}
	unitOf := map[pci.Address]int{}
	for i, s := range src {
		for _, f := range s.Functions {
			unitOf[f.Addr] = i
		}
	}
	uri := libvirttest.Start(t)
	argv := libvirttest.Virsh(t, uri, "domxml-to-native", "--format", "qemu-argv", "--xml",
		hostless(t, filepath.Join(hookTestdata, domain+".final.xml")))
	var objects []string
	standIn := largeBARStandIn(t, t.TempDir(), &objects)
	passed := map[int][]topology.HostFunction{} // unit index -> its functions in the domain
	var others []topology.OtherPort
	keep := func(d map[string]any) bool {
		if d["driver"] == "pcie-root-port" && !hookController(d) {
			if d["bus"] != "pcie.0" {
				t.Fatalf("KubeVirt's root port %v not on pcie.0", d)
			}
			d["io-reserve"] = float64(0)
			others = append(others, topology.OtherPort{Hotplug: true, Index: len(others)})
		}
		return true
	}
	devices, _ := libvirtDevices(t, argv, keep, func(host pci.Address, id, bus string) string {
		i, ok := unitOf[host]
		if !ok {
			t.Fatalf("hostdev %s is no unit's function", host)
		}
		f := src[i].Functions[slices.IndexFunc(src[i].Functions, func(f topology.HostFunction) bool { return f.Addr == host })]
		passed[i] = append(passed[i], f)
		return standIn(topology.GuestFunction{Host: f, ID: id}, bus)
	})
	var ids []topology.UnitID
	var units [][]topology.HostFunction
	for i, s := range src {
		if fns := passed[i]; len(fns) > 0 {
			if len(fns) != len(s.Functions) {
				t.Fatalf("unit %s: %d of its %d functions in the domain", s.ID, len(fns), len(s.Functions))
			}
			ids = append(ids, s.ID)
			units = append(units, fns)
		}
	}
	// The hook's layout without guest NUMA: the units' root ports on pcie.0 beside the
	// others (the functions of slot 1 and on, where the hook put them).
	var at []pci.Address
	for i := range ids {
		at = append(at, pci.Address{Device: uint8(1 + i/8), Function: uint8(i % 8)})
	}
	g, err := topology.PlanGuest(src, topology.GuestOptions{Units: ids, In: &topology.Placement{FirstIndex: 1, OtherPorts: others, RootPorts: at, RootBus: 1}})
	if err != nil {
		t.Fatal(err)
	}
	m := g.MMIO()
	if bits == 0 {
		bits = m.Width
	}
	t.Logf("%s: %d units beside %d other root ports need %s of 64-bit MMIO, %d bits; booted at %d",
		domain, len(units), len(others), topology.Bytes(m.Prefetchable64), m.Width, bits)
	if accepted := m.CheckWidth(bits, len(units)) == nil; accepted != (missing == 0) {
		t.Fatalf("at %d bits the planner accepts the domain: %v, but the test expects %d GPUs left out", bits, accepted, missing)
	}
	checkLargeBARs(t, "largebar-"+domain+"-"+strconv.Itoa(bits), append(objects, devices...), bits, units, missing)
}

// hookController says whether a PCI controller of libvirt's command line is one the
// hook added (its aliases, "ua-passage-...").
func hookController(d map[string]any) bool {
	return strings.HasPrefix(fmt.Sprint(d["id"]), "ua-passage-")
}

// checkLargeBARs boots devices, whose largeBARStandIn stand-ins are the functions of
// units, under OVMF at a guest width of physBits, and checks from inside the guest
// (fakeuinit's sysfs scan): one stand-in per function; each one's BAR0 (its registers)
// and BAR2 assigned (a start address in sysfs resource), at their sizes; each alone
// below a downstream port, under an upstream port under a root port; and the stand-ins
// below each root port one unit's functions, one switch per unit. missing stand-ins,
// each a 512 GiB one (a GPU's), are to be found without BAR2 instead, and their units
// are not held to the switch check.
func checkLargeBARs(t *testing.T, name string, devices []string, physBits int, units [][]topology.HostFunction, missing int) {
	t.Helper()
	run, _ := measureGuest(t, guestBoot{Name: name, Devices: devices, OVMF: true, PhysBits: physBits})
	var fns []fakeFunction
	if err := json.Unmarshal(run.Files["pci.json"], &fns); err != nil {
		t.Fatalf("pci.json: %v", err)
	}
	sizes := func(s []uint64) string {
		slices.Sort(s)
		var w []string
		for _, x := range s {
			w = append(w, topology.Bytes(x))
		}
		return strings.Join(w, " + ")
	}
	left := map[string]int{} // one unit's BAR2 sizes -> units with them not yet found
	total := 0
	for _, u := range units {
		var s []uint64
		for _, f := range u {
			s = append(s, standInSize(f))
		}
		left[sizes(s)]++
		total += len(u)
	}
	found, lost := 0, 0
	below := map[string][]uint64{} // root port > upstream port -> BAR2 sizes below it
	port := map[string]string{}    // downstream port -> its function
	for _, f := range fns {
		if f.Vendor != "1af4" || f.Device != "1110" { // ivshmem
			continue
		}
		found++
		lines := strings.Split(f.Resource, "\n")
		if missing > 0 && len(lines) > 2 {
			var start, end, flags uint64
			if _, err := fmt.Sscanf(lines[2], "0x%x 0x%x 0x%x", &start, &end, &flags); err == nil && start == 0 && end == 0 {
				// Unassigned (Linux resets the resource): which one is told by the
				// sizes of the others.
				lost++
				continue
			}
		}
		var bar2 uint64
		for _, bar := range []int{0, 2} {
			var start, end, flags uint64
			if bar >= len(lines) {
				t.Errorf("%s: resource %q has no BAR%d", f.BDF, f.Resource, bar)
				continue
			}
			if _, err := fmt.Sscanf(lines[bar], "0x%x 0x%x 0x%x", &start, &end, &flags); err != nil || start == 0 {
				t.Errorf("%s: BAR%d %q not assigned", f.BDF, bar, lines[bar])
				continue
			}
			if bar == 2 {
				bar2 = end - start + 1
			} else if end-start+1 != 256 {
				t.Errorf("%s: BAR0 %q, want ivshmem's 256-byte registers", f.BDF, lines[bar])
			}
		}
		if len(f.Parents) != 3 {
			t.Errorf("%s below %v: want a root port, an upstream port and a downstream port", f.BDF, f.Parents)
			continue
		}
		if other, ok := port[f.Parents[2]]; ok {
			t.Errorf("%s and %s below one downstream port %s", other, f.BDF, f.Parents[2])
		}
		port[f.Parents[2]] = f.BDF
		sw := f.Parents[0] + " > " + f.Parents[1]
		below[sw] = append(below[sw], bar2)
	}
	if found != total {
		t.Errorf("%d stand-ins in the guest, %d functions passed through", found, total)
	}
	if lost != missing {
		t.Errorf("%d stand-ins without BAR2, want %d", lost, missing)
	}
	var want, got []uint64 // every stand-in's BAR2 size but the missing GPUs'; the assigned ones'
	gpus := missing
	for _, u := range units {
		for _, f := range u {
			if sz := standInSize(f); sz == 512<<30 && gpus > 0 {
				gpus--
			} else {
				want = append(want, sz)
			}
		}
	}
	for _, s := range below {
		got = append(got, s...)
	}
	if w, g := sizes(want), sizes(got); missing > 0 && w != g {
		t.Errorf("BAR2s assigned: %s; want every one but %d GPUs': %s", g, missing, w)
	}
	for sw, s := range below {
		k := sizes(s)
		if left[k] == 0 {
			if missing == 0 {
				t.Errorf("below %s: BAR2s %s, not one unit's (%v)", sw, k, left)
			}
			continue
		}
		left[k]--
	}
	if missing == 0 && len(below) != len(units) {
		t.Errorf("%d units below %d switches", len(units), len(below))
	}
	t.Logf("%s: %d units, %d stand-ins checked at %d bits, %d without BAR2", name, len(units), found, physBits, lost)
}
