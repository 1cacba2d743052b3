//go:build linux

// Command fakeuinit is a test double for `passage boot` that speaks the console
// protocol (file blocks, PASSAGE-T markers, PASSAGE-DONE, power-off). The harness's own
// test boots it as an initramfs overlay to check the harness, initramfs/kmod on the real
// kernel, and to record the PCI layout the guest sees (qemu-tests/README.md).
package main

import (
	"github.com/passage-boot/passage/initramfs/emit"

	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/initramfs/kmod"
)

func marker(ev string) { emit.Mark(os.Stdout, "/", ev) }

type modResult struct {
	Name          string
	Path          string
	DurationMs    float64
	Err           string `json:",omitempty"`
	AlreadyLoaded bool
	Sysfs         bool // /sys/module/<name> exists afterwards
}

// Function is one PCI function as sysfs and its config space show it.
type Function struct {
	BDF          string
	Vendor       string
	Device       string
	Class        string
	Driver       string `json:",omitempty"`
	IOMMUGroup   string `json:",omitempty"`
	Parents      []string
	PortType     string `json:",omitempty"` // PCIe capability device/port type
	ACSCap       string `json:",omitempty"`
	ACSCtl       string `json:",omitempty"`
	ATS          bool
	ATSEnabled   bool
	SecondaryBus string `json:",omitempty"`
	// Resource is sysfs resource as the kernel prints it: per BAR start, end and flags,
	// start 0 when the BAR is not assigned.
	Resource string `json:",omitempty"`
}

func readTrim(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

var portTypes = map[int]string{0: "Endpoint", 1: "LegacyEndpoint", 4: "RootPort", 5: "UpstreamPort",
	6: "DownstreamPort", 7: "PCIe-PCI-bridge", 8: "PCI-PCIe-bridge", 9: "RCiEP", 10: "RCEC"}

func decodeConfig(f *Function, cfg []byte) {
	le := binary.LittleEndian
	if len(cfg) >= 0x1a && cfg[0x0e]&0x7f == 1 {
		f.SecondaryBus = fmt.Sprintf("%02x", cfg[0x19])
	}
	if len(cfg) >= 0x40 && le.Uint16(cfg[6:])&0x10 != 0 {
		off := int(cfg[0x34]) &^ 3
		for n := 0; off >= 0x40 && off+2 < len(cfg) && n < 48; n++ {
			if cfg[off] == 0x10 && off+4 <= len(cfg) { // PCI Express
				pt := int(le.Uint16(cfg[off+2:])>>4) & 0xf
				f.PortType = portTypes[pt]
				if f.PortType == "" {
					f.PortType = fmt.Sprint(pt)
				}
			}
			off = int(cfg[off+1]) &^ 3
		}
	}
	off := 0x100
	for n := 0; off >= 0x100 && off+4 <= len(cfg) && n < 512; n++ {
		h := le.Uint32(cfg[off:])
		if h == 0 || h == 0xffffffff {
			break
		}
		switch h & 0xffff {
		case 0x0d: // ACS
			if off+8 <= len(cfg) {
				f.ACSCap = fmt.Sprintf("%04x", le.Uint16(cfg[off+4:]))
				f.ACSCtl = fmt.Sprintf("%04x", le.Uint16(cfg[off+6:]))
			}
		case 0x0f: // ATS
			f.ATS = true
			if off+8 <= len(cfg) {
				f.ATSEnabled = le.Uint16(cfg[off+6:])&0x8000 != 0
			}
		}
		off = int(h >> 20)
	}
}

func scanPCI() ([]Function, string) {
	ents, _ := os.ReadDir("/sys/bus/pci/devices")
	var fns []Function
	for _, e := range ents {
		d := filepath.Join("/sys/bus/pci/devices", e.Name())
		real, _ := filepath.EvalSymlinks(d)
		f := Function{
			BDF:    e.Name(),
			Vendor: strings.TrimPrefix(readTrim(d+"/vendor"), "0x"),
			Device: strings.TrimPrefix(readTrim(d+"/device"), "0x"),
			Class:  strings.TrimPrefix(readTrim(d+"/class"), "0x"),
		}
		if l, err := os.Readlink(d + "/driver"); err == nil {
			f.Driver = filepath.Base(l)
		}
		if l, err := os.Readlink(d + "/iommu_group"); err == nil {
			f.IOMMUGroup = filepath.Base(l)
		}
		for _, p := range strings.Split(real, "/") {
			if strings.Count(p, ":") == 2 && p != e.Name() {
				f.Parents = append(f.Parents, p)
			}
		}
		if cfg, err := os.ReadFile(d + "/config"); err == nil {
			decodeConfig(&f, cfg)
		}
		f.Resource = readTrim(d + "/resource")
		fns = append(fns, f)
	}
	sort.Slice(fns, func(i, j int) bool { return fns[i].BDF < fns[j].BDF })
	var b strings.Builder
	fmt.Fprintf(&b, "%-13s %-9s %-6s %-15s %-5s %-9s %-13s %-5s %s\n", "BDF", "ID", "class", "type", "group", "ACSCap/Ctl", "driver", "ATS", "parents")
	for _, f := range fns {
		acs := "-"
		if f.ACSCap != "" {
			acs = f.ACSCap + "/" + f.ACSCtl
		}
		ats := "-"
		if f.ATS {
			ats = "cap"
			if f.ATSEnabled {
				ats = "en"
			}
		}
		fmt.Fprintf(&b, "%-13s %s:%s %-6s %-15s %-5s %-10s %-13s %-5s %s\n", f.BDF, f.Vendor, f.Device, f.Class[:min(6, len(f.Class))],
			f.PortType, f.IOMMUGroup, acs, f.Driver, ats, strings.Join(f.Parents, " > "))
	}
	return fns, b.String()
}

// dhcp leases an address on the management NIC from QEMU's user network, showing the
// harness gives the guest a DHCP server even with restrict=on.
func dhcp() string {
	var iface string
	links, err := netlink.LinkList()
	if err != nil {
		return "links: " + err.Error()
	}
	for _, l := range links {
		if dev, err := os.Readlink("/sys/class/net/" + l.Attrs().Name + "/device/driver"); err == nil && filepath.Base(dev) == "e1000e" {
			iface = l.Attrs().Name
		}
	}
	if iface == "" {
		return "no e1000e interface"
	}
	link, _ := netlink.LinkByName(iface)
	if err := netlink.LinkSetUp(link); err != nil {
		return iface + ": up: " + err.Error()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		if l, err := netlink.LinkByName(iface); err == nil && l.Attrs().OperState == netlink.OperUp {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	c, err := nclient4.New(iface, nclient4.WithTimeout(2*time.Second), nclient4.WithRetry(3))
	if err != nil {
		return iface + ": " + err.Error()
	}
	defer c.Close()
	lease, err := c.Request(ctx)
	if err != nil {
		return iface + ": request: " + err.Error()
	}
	return fmt.Sprintf("%s: lease %s router %v", iface, lease.ACK.YourIPAddr, lease.ACK.Router())
}

func main() {
	// Write to the console TTY itself, not the pipe u-root's init copies from: what is
	// still in that pipe at power-off is lost (the same reason passage boot does this).
	if ttys := emit.OpenConsoles("/"); len(ttys) > 0 {
		os.Stdout = ttys[0]
	}
	marker("uinit-start")
	out := map[string][]byte{}
	summary := "ok"

	var un unix.Utsname
	unix.Uname(&un)
	release := string(bytes.TrimRight(un.Release[:], "\x00"))
	out["uname"] = []byte(release + "\n")

	want := strings.Fields("vfio vfio_iommu_type1 vfio-pci nvme virtio_pci virtio_net e1000e")
	var extra []string
	if b, err := os.ReadFile("/proc/cmdline"); err == nil {
		out["cmdline"] = b
		for _, a := range strings.Fields(string(b)) {
			if v, ok := strings.CutPrefix(a, "fake.modules="); ok {
				want = strings.Split(v, ",")
			}
			// Modules a test adds beside the image's: its overlay puts them, with
			// their own modules.dep, under /lib/modules-extra/<release>.
			if v, ok := strings.CutPrefix(a, "fake.extra-modules="); ok {
				extra = strings.Split(v, ",")
			}
		}
	}
	var mods []modResult
	start := time.Now()
	load := func(dir string, names []string) {
		ix, err := kmod.Open(dir)
		if err != nil {
			out["kmod-error"] = []byte(err.Error())
			summary = "failed"
			return
		}
		res, err := ix.Load(names...)
		if err != nil {
			out["kmod-error"] = []byte(err.Error())
			summary = "failed"
		}
		for _, r := range res {
			m := modResult{Name: r.Name, Path: r.Path, DurationMs: float64(r.Duration.Microseconds()) / 1000, AlreadyLoaded: r.AlreadyLoaded}
			if r.Err != nil {
				m.Err = r.Err.Error()
			}
			_, serr := os.Stat("/sys/module/" + r.Name)
			m.Sysfs = serr == nil
			mods = append(mods, m)
		}
	}
	load(filepath.Join("/lib/modules", release), want)
	if extra != nil {
		load(filepath.Join("/lib/modules-extra", release), extra)
	}
	out["kmod.json"], _ = json.MarshalIndent(map[string]any{"modules": mods, "total_ms": time.Since(start).Milliseconds()}, "", " ")
	// Give drivers a moment to bind after the module loads (probing is asynchronous
	// for some of them), so the PCI table shows drivers.
	time.Sleep(300 * time.Millisecond)
	fns, table := scanPCI()
	out["pci.json"], _ = json.MarshalIndent(fns, "", " ")
	out["pci.txt"] = []byte(table)
	out["dhcp.txt"] = []byte(dhcp() + "\n")
	// Commands a test asks for (one a line in /etc/fakeuinit/run, e.g. "passage plan
	// --json"), run after the modules load; stdout+stderr of line N come back as run-N.out.
	if b, err := os.ReadFile("/etc/fakeuinit/run"); err == nil {
		n := 0
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 {
				continue
			}
			n++
			res, err := exec.Command("/bbin/"+f[0], f[1:]...).CombinedOutput()
			if err != nil {
				res = append(res, []byte("\nexit: "+err.Error()+"\n")...)
			}
			out[fmt.Sprintf("run-%d.out", n)] = res
		}
	}
	if _, err := os.Stat("/dev/tpm0"); err == nil {
		out["tpm"] = []byte("/dev/tpm0\n")
	}

	os.MkdirAll("/run/passage", 0o755)
	names := make([]string, 0, len(out))
	for n, d := range out {
		os.WriteFile(filepath.Join("/run/passage", n), d, 0o644)
		names = append(names, n)
	}
	marker("manifest-written")
	sort.Strings(names)
	for _, n := range names {
		emit.File(os.Stdout, n, out[n])
	}
	marker("handoff")
	if err := emit.Done(os.Stdout, summary); err != nil {
		fmt.Printf("fakeuinit: %v\n", err)
	}
	if err := emit.Drain(os.Stdout); err != nil {
		fmt.Printf("fakeuinit: %v\n", err)
	}
	unix.Sync()
	unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	select {}
}
