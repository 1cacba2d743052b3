//go:build qemu

package qemutest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/hypervisor/libvirttest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// TestRenderedGuestsStart starts what `passage render` (the command, built for this
// host) writes for a signed B300 manifest, for 4 units --numa and 2 units flat and --numa:
// the --format libvirt domain through libvirt's own command line (virsh
// domxml-to-native on a private libvirtd, as TestKubeVirtHookGuest reads it), each
// vfio-pci replaced by the largeBARStandIn of its function, booted under OVMF at the
// width libvirt hands QEMU, with no kernel: OVMF enumerates and assigns, and QMP
// query-pci reads back what it did. The --format qemu rendering of the same units must
// give QEMU the same machine (every device, bus, address, bus_nr and numa_node; only
// the ids, chassis, slot and port differ), so the one boot holds both renderings'
// checks. In the guest: the plan's tree exactly (no other bridge), one switch per unit
// (root port, upstream port, one downstream port per function, at the plan's addresses
// and bus numbers), every BAR of every stand-in assigned at its size, and the 64-bit
// space OVMF used within what the planner demands. A --domain-type qemu domain (TCG's
// CPU model) is booted too, for one unit.
func TestRenderedGuestsStart(t *testing.T) {
	// Beside the suite's other parallel test (TestLargeBARGuests): their guests share
	// the two cores, two at a time, the longest (4 units --numa) beside all the others.
	t.Parallel()
	dir := t.TempDir()
	passage := filepath.Join(dir, "passage")
	if out, err := exec.Command("go", "build", "-o", passage, "../cmd/passage").CombinedOutput(); err != nil {
		t.Fatalf("build passage: %v\n%s", err, out)
	}
	mdir, kdir, err := manifesttest.Fleet(dir, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	env, pub := filepath.Join(mdir, "node-0000.dsse.json"), filepath.Join(kdir, "node-key-0000.pub")
	src, err := hypervisor.Sources(manifesttest.B300(1))
	if err != nil {
		t.Fatal(err)
	}
	host := map[pci.Address]topology.HostFunction{}
	for _, s := range src {
		for _, f := range s.Functions {
			host[f.Addr] = f
		}
	}
	uri := libvirttest.Start(t)
	// Units on both host nodes (0-3 on node 0, 4-7 on node 1), so --numa makes two guest
	// nodes from 2 units on.
	units := map[int][]topology.UnitID{1: {0}, 2: {0, 4}, 4: {0, 1, 4, 5}}
	type renderCase struct {
		n    int
		numa bool
		typ  string
	}
	// Two boots at a time (each guest one host thread). Units on both host nodes, two on
	// each, with --numa (two guest nodes, two expanders each: the longest boot), the
	// fewest that make two guest nodes (2 units), those same two units flat, and one unit
	// in a --domain-type qemu domain. Each boot is minutes of TCG, and OVMF's time grows
	// faster than the tree: the whole node's 8 units --numa took 5 min of one core against
	// 4 units' 1.5 min (README.md), for the same checks on a bigger tree (TestLargeBARGuests
	// boots the hook's 8 units at B300's BAR sizes, and hypervisor's TestRenderWidths holds
	// the 8-unit width without a boot).
	cases := []renderCase{{4, true, "kvm"}, {2, true, "kvm"}, {2, false, "kvm"}, {1, false, "qemu"}}
	for _, c := range cases {
		name := fmt.Sprintf("%dunits-%s-%s", c.n, map[bool]string{false: "flat", true: "numa"}[c.numa], c.typ)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var ids []string
			for _, u := range units[c.n] {
				ids = append(ids, fmt.Sprint(int(u)))
			}
			args := []string{"render", "--pub", pub, "--unit", strings.Join(ids, ",")}
			if c.numa {
				args = append(args, "--numa")
			}
			qemuText := runPassage(t, passage, append(args, "--format", "qemu", env)...)
			domain := filepath.Join(t.TempDir(), name+".xml")
			if err := os.WriteFile(domain, []byte(runPassage(t, passage, append(args, "--format", "libvirt", "--domain-type", c.typ,
				"--name", "passage-"+name, "--vcpus", "2", "--memory", "2048", env)...)), 0o644); err != nil {
				t.Fatal(err)
			}
			// The plan the command rendered, from the same code: its text must be the
			// command's, so the checks below hold the command's guest to it.
			r, err := hypervisor.Render(hypervisor.Input{Sources: src, Units: units[c.n], NUMA: c.numa}, hypervisor.FormatQEMU, topology.DomainOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if string(r.Out) != qemuText {
				t.Fatalf("passage render --format qemu printed\n%s\nthe plan renders\n%s", qemuText, r.Out)
			}

			argv := libvirttest.Virsh(t, uri, "domxml-to-native", "--format", "qemu-argv", "--xml", hostless(t, domain))
			cpu := libvirtCPU.FindStringSubmatch(argv)
			if cpu == nil || cpu[2] != fmt.Sprint(r.PhysBits) {
				t.Fatalf("libvirt's -cpu %q, want phys-bits=%d (render's width)\n%s", cpu, r.PhysBits, argv)
			}
			var objects []string
			standIn := largeBARStandIn(t, t.TempDir(), &objects)
			devices, _ := libvirtDevices(t, argv, nil, func(a pci.Address, id, bus string) string {
				f, ok := host[a]
				if !ok {
					t.Fatalf("hostdev %s is no unit's function", a)
				}
				return standIn(topology.GuestFunction{Host: f, ID: id}, bus)
			})
			// One machine for both renderings.
			fromLibvirt, fromQEMU := machineOf(t, libvirtTree(t, argv)), machineOf(t, qemuTree(qemuText))
			if !slices.Equal(fromLibvirt, fromQEMU) {
				t.Fatalf("libvirt's command line gives QEMU\n%s\n--format qemu gives it\n%s", strings.Join(fromLibvirt, "\n"), strings.Join(fromQEMU, "\n"))
			}

			boot := append([]string{"-cpu", cpu[1]}, objects...)
			nodes := len(r.Guest.GuestNodes)
			if nodes == 0 {
				boot = append(boot, "-smp", "1", "-m", "1024")
			} else {
				// The domain's cells, one vCPU each (the devices' numa_node must name one).
				boot = append(boot, "-smp", fmt.Sprint(nodes), "-m", fmt.Sprint(512*nodes))
				for i := 0; i < nodes; i++ {
					boot = append(boot, "-object", fmt.Sprintf("memory-backend-ram,id=mem%d,size=512M", i),
						"-numa", fmt.Sprintf("node,nodeid=%d,cpus=%d,memdev=mem%d", i, i, i))
				}
			}
			start := time.Now()
			buses := firmwarePCITree(t, kvmHost(t).Accel(c.typ), append(boot, devices...))
			used := checkRenderedTree(t, r.Guest, buses, r.PhysBits)
			if used > r.MMIO.Prefetchable64 {
				t.Errorf("OVMF used %s of 64-bit space; the planner demands %s", topology.Bytes(used), topology.Bytes(r.MMIO.Prefetchable64))
			}
			t.Logf("%s: %d units at %d bits (-cpu %s): 64-bit space used %s, planned %s; OVMF %v",
				name, c.n, r.PhysBits, cpu[1], topology.Bytes(used), topology.Bytes(r.MMIO.Prefetchable64), time.Since(start).Round(time.Second))
		})
	}
}

// libvirtCPU is libvirt's -cpu argument and the width in it.
var libvirtCPU = regexp.MustCompile(`-cpu ([^ ]*phys-bits=([0-9]+)[^ ]*)`)

func runPassage(t *testing.T, passage string, args ...string) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(passage, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("passage %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String()
}

// pciDevice is one -device of a PCI tree: its driver and properties, id and bus among
// them.
type pciDevice map[string]string

// libvirtTree reads the PCI devices of libvirt's command line (its JSON -device form).
func libvirtTree(t *testing.T, argv string) []pciDevice {
	t.Helper()
	var out []pciDevice
	for _, mm := range jsonDevice.FindAllStringSubmatch(argv, -1) {
		var d map[string]any
		if err := json.Unmarshal([]byte(mm[1]), &d); err != nil {
			t.Fatalf("libvirt's -device %s: %v", mm[1], err)
		}
		p := pciDevice{}
		for k, v := range d {
			if f, ok := v.(float64); ok {
				v = int64(f)
			}
			p[k] = fmt.Sprint(v)
		}
		out = append(out, p)
	}
	return out
}

// qemuTree reads the -device lines of a --format qemu rendering.
func qemuTree(text string) []pciDevice {
	var out []pciDevice
	for _, line := range strings.Split(text, "\n") {
		v, ok := strings.CutPrefix(strings.TrimSuffix(strings.TrimSpace(line), " \\"), "-device ")
		if !ok {
			continue
		}
		parts := strings.Split(v, ",")
		p := pciDevice{"driver": parts[0]}
		for _, kv := range parts[1:] {
			k, val, _ := strings.Cut(kv, "=")
			p[k] = val
		}
		out = append(out, p)
	}
	return out
}

// machineOf is what QEMU builds from devs, one line per device, sorted: the driver and
// properties but for the names (id, and bus as the path of the parent's addresses) and
// the numbers that only tell ports apart (chassis, slot, port: PCIe Link and Slot
// Capabilities, nothing firmware enumerates or sizes by).
func machineOf(t *testing.T, devs []pciDevice) []string {
	t.Helper()
	byID := map[string]pciDevice{}
	for _, d := range devs {
		byID[d["id"]] = d
	}
	var path func(id string, depth int) string
	path = func(id string, depth int) string {
		if id == "pcie.0" {
			return "pcie.0"
		}
		d, ok := byID[id]
		if !ok || depth > 16 {
			t.Fatalf("bus %q is no device's", id)
		}
		return path(d["bus"], depth+1) + "/" + d["driver"] + "@" + d["addr"]
	}
	var out []string
	for _, d := range devs {
		if d["bus"] == "" {
			continue // not on a PCI bus (libvirt's CD-ROM, USB, ...): none expected
		}
		var keys []string
		for k := range d {
			switch k {
			case "id", "bus", "chassis", "slot", "port":
			default:
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		line := []string{path(d["bus"], 0)}
		for _, k := range keys {
			line = append(line, k+"="+d[k])
		}
		out = append(out, strings.Join(line, " "))
	}
	sort.Strings(out)
	return out
}

// qmpBus is one bus of QMP's query-pci answer (qapi/pci.json: PciInfo, PciDeviceInfo).
type qmpBus struct {
	Bus     int            `json:"bus"`
	Devices []qmpPCIDevice `json:"devices"`
}

type qmpPCIDevice struct {
	Bus      int `json:"bus"`
	Slot     int `json:"slot"`
	Function int `json:"function"`
	ID       struct {
		Vendor int `json:"vendor"`
		Device int `json:"device"`
	} `json:"id"`
	QdevID  string `json:"qdev_id"`
	Regions []struct {
		Bar       int    `json:"bar"`
		Type      string `json:"type"`
		Address   int64  `json:"address"` // -1: unmapped
		Size      uint64 `json:"size"`
		MemType64 bool   `json:"mem_type_64"`
	} `json:"regions"`
	Bridge *struct {
		Bus struct {
			Secondary   int `json:"secondary"`
			Subordinate int `json:"subordinate"`
			Prefetch    struct {
				Base  uint64 `json:"base"`
				Limit uint64 `json:"limit"`
			} `json:"prefetchable_range"`
		} `json:"bus"`
		Devices []qmpPCIDevice `json:"devices"`
	} `json:"pci_bridge"`
}

// unmapped is the address query-pci reports for a BAR that decodes nothing
// (PCI_BAR_UNMAPPED, as a signed number).
const unmapped = -1

// firmwarePCITree boots args (the machine's CPU, memory and devices) under OVMF with no
// kernel and no disk until OVMF's boot manager runs (it has enumerated the PCI tree and
// assigned every bridge window and BAR by then; with nothing to boot it starts its
// shell), then reads the tree back with QMP query-pci. accel is QEMU's accelerator for
// the domain's type on this host (libvirttest.Host.Accel: libvirt's `-cpu host` for a
// kvm domain needs KVM).
func firmwarePCITree(t *testing.T, accel string, args []string) []qmpBus {
	t.Helper()
	work := t.TempDir()
	vars := filepath.Join(work, "OVMF_VARS.fd")
	b, err := os.ReadFile(OVMFVarsNoKeys)
	if err == nil {
		err = os.WriteFile(vars, b, 0o600)
	}
	if err != nil {
		t.Fatal(err)
	}
	// A short path: a unix socket's name has room for 107 bytes.
	sockDir, err := os.MkdirTemp("", "qmp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	sock, console := filepath.Join(sockDir, "qmp"), filepath.Join(work, "console.log")
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	full := append([]string{"-machine", "q35", "-accel", accel, "-nographic", "-nodefaults",
		"-serial", "file:" + console, "-monitor", "none", "-no-reboot", "-qmp", "unix:" + sock + ",server=on,wait=off",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=" + OVMFCodeNoSecureBoot,
		"-drive", "if=pflash,format=raw,unit=1,file=" + vars}, args...)
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", full...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		cmd.Process.Kill()
		<-exited
	}()
	for {
		if c, _ := os.ReadFile(console); bytes.Contains(c, []byte("BdsDxe: ")) {
			break
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("QEMU exited before OVMF's boot manager: %v\n%s\nqemu-system-x86_64 %s", err, stderr.String(), strings.Join(full, " "))
		case <-ctx.Done():
			c, _ := os.ReadFile(console)
			t.Fatalf("no BdsDxe line from OVMF in time; console:\n%q", c)
		case <-time.After(time.Second):
		}
	}
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	in := bufio.NewReader(conn)
	call := func(command string) json.RawMessage {
		if _, err := fmt.Fprintf(conn, "{\"execute\":%q}\n", command); err != nil {
			t.Fatal(err)
		}
		for {
			line, err := in.ReadBytes('\n')
			if err != nil {
				t.Fatalf("qmp %s: %v", command, err)
			}
			var reply struct {
				Return json.RawMessage `json:"return"`
				Error  *struct {
					Desc string `json:"desc"`
				} `json:"error"`
			}
			if err := json.Unmarshal(line, &reply); err != nil {
				t.Fatalf("qmp %s: %v: %s", command, err, line)
			}
			if reply.Error != nil {
				t.Fatalf("qmp %s: %s", command, reply.Error.Desc)
			}
			if reply.Return != nil {
				return reply.Return
			}
		}
	}
	if _, err := in.ReadBytes('\n'); err != nil { // the greeting
		t.Fatal(err)
	}
	call("qmp_capabilities")
	var buses []qmpBus
	if err := json.Unmarshal(call("query-pci"), &buses); err != nil {
		t.Fatalf("query-pci: %v", err)
	}
	return buses
}

// checkRenderedTree holds the tree OVMF left (buses) to the plan g: every bridge one of
// the plan's ports, at its address with its secondary bus; below each unit's root port
// only its upstream port, below that one downstream port per function, each holding
// that function's stand-in alone; every stand-in's BAR0 and BAR2 assigned, BAR2 the
// size of the function's largest BAR; everything 64-bit inside the window at the top
// eighth of the width (OVMF's). It returns the 64-bit space used: from the window's
// base to the end of the highest 64-bit BAR or prefetchable bridge window.
func checkRenderedTree(t *testing.T, g *topology.Guest, buses []qmpBus, physBits int) uint64 {
	t.Helper()
	type port struct {
		model string
		sec   int
	}
	want := map[pci.Address]port{} // every bridge of the plan
	fn := map[pci.Address]topology.GuestFunction{}
	for _, u := range g.Units {
		want[u.RootPort.Addr] = port{"root", u.RootPort.Secondary}
		want[u.Upstream.Addr] = port{"upstream", u.Upstream.Secondary}
		for _, f := range u.Functions {
			want[f.Port.Addr] = port{"downstream", f.Port.Secondary}
			fn[f.Addr] = f
		}
	}
	top := uint64(1) << physBits
	base := top - top/8
	var end uint64
	seenBridge, seenFn := map[pci.Address]bool{}, map[pci.Address]bool{}
	var walk func(devs []qmpPCIDevice, parent string)
	walk = func(devs []qmpPCIDevice, parent string) {
		for _, d := range devs {
			a := pci.Address{Bus: uint8(d.Bus), Device: uint8(d.Slot), Function: uint8(d.Function)}
			for _, r := range d.Regions {
				if at := uint64(r.Address); r.Type == "memory" && r.MemType64 && r.Address != unmapped {
					if at < base || at+r.Size > top {
						t.Errorf("%s BAR%d at %#x+%s: outside OVMF's window %#x-%#x", a, r.Bar, at, topology.Bytes(r.Size), base, top)
					}
					end = max(end, at+r.Size)
				}
			}
			if d.Bridge != nil {
				if w := d.Bridge.Bus.Prefetch; w.Limit > w.Base && w.Base >= base {
					end = max(end, w.Limit+1)
				}
				p, ok := want[a]
				if !ok {
					t.Errorf("bridge %s (%04x:%04x, %s) is none of the plan's ports", a, d.ID.Vendor, d.ID.Device, d.QdevID)
				} else if d.Bridge.Bus.Secondary != p.sec {
					t.Errorf("%s port %s: secondary bus %#x, the plan's %#x", p.model, a, d.Bridge.Bus.Secondary, p.sec)
				}
				seenBridge[a] = true
				walk(d.Bridge.Devices, p.model)
				continue
			}
			f, ok := fn[a]
			if !ok {
				if d.Bus != 0 { // q35's own: host bridge, LPC, SATA, SMBus on bus 0
					t.Errorf("%s (%04x:%04x) below a %s port is none of the plan's functions", a, d.ID.Vendor, d.ID.Device, parent)
				}
				continue
			}
			seenFn[a] = true
			if parent != "downstream" || d.ID.Vendor != 0x1af4 || d.ID.Device != 0x1110 {
				t.Errorf("%s (%04x:%04x) below a %s port: want %s's ivshmem stand-in below a downstream port", a, d.ID.Vendor, d.ID.Device, parent, f.ID)
			}
			bars := map[int]uint64{}
			for _, r := range d.Regions {
				if r.Address == unmapped || r.Address == 0 {
					t.Errorf("%s (%s): BAR%d (%s) not assigned", a, f.ID, r.Bar, topology.Bytes(r.Size))
					continue
				}
				bars[r.Bar] = r.Size
			}
			if bars[0] != 256 || bars[2] != standInSize(f.Host) {
				t.Errorf("%s (%s): BARs %v assigned, want BAR0 256 bytes and BAR2 %s", a, f.ID, bars, topology.Bytes(standInSize(f.Host)))
			}
		}
	}
	for _, b := range buses {
		walk(b.Devices, "root complex")
	}
	for a, p := range want {
		if !seenBridge[a] {
			t.Errorf("the plan's %s port %s (secondary %#x) is not in the guest", p.model, a, p.sec)
		}
	}
	for a, f := range fn {
		if !seenFn[a] {
			t.Errorf("the plan's %s (%s) is not at %s in the guest", f.ID, f.Role, a)
		}
	}
	if end < base {
		t.Errorf("no 64-bit BAR in OVMF's window at %#x", base)
		return 0
	}
	return end - base
}
