// Package pcitest builds synthetic sysfs trees that carry real config-space bytes, for
// tests of everything that reads /sys/bus/pci: this project's packages and lspci itself
// (lspci -A linux-sysfs -O sysfs.path=<root>/sys/bus/pci reads them as it reads a node).
package pcitest

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"

	"github.com/passage-boot/passage/pci"
)

// Link is a function's link, in LnkCap/LnkSta encoding (1 = 2.5 GT/s ... 6 = 64 GT/s).
type Link struct {
	Speed, Width       uint8
	MaxSpeed, MaxWidth uint8
}

// ACS is the ACS capability to give a port.
type ACS struct{ Cap, Ctl pci.ACSBits }

// ATS is the ATS capability to give a function (its presence means firmware enabled ATS).
type ATS struct {
	Enable bool
	STU    int
}

// SRIOV is an SR-IOV capability; Num VFs are created as functions after the PF.
type SRIOV struct {
	Total, Num int
	VFDevice   uint16
	VFDriver   string
}

// Fn describes one function and, for a bridge, the functions on its secondary bus.
type Fn struct {
	Name      string // optional key into Node.Names ("gpu0", "nic0.1", ...)
	Dev, Func uint8
	Vendor    uint16
	Device    uint16
	SubVendor uint16
	SubDevice uint16
	Class     uint32 // 24 bits; 0x0604xx makes a bridge (type 1 header)
	Rev       uint8

	Conventional bool         // no PCI Express capability (and 256 bytes of config)
	Port         pci.PortType // Express device/port type
	Link         Link
	ACS          *ACS
	ATS          *ATS
	SRIOV        *SRIOV
	VPD          *pci.VPD
	Driver       string
	NUMA         *int // overrides the host bridge's node
	BARs         []BAR

	Below []Fn // functions on the secondary bus of a bridge
}

// BAR is a Base Address Register to give a function: its register (0..5, 0..1 on a
// bridge), a power-of-two size and its type. Build assigns it an address aligned to its
// size, writes that into config space and the kernel's line into <bdf>/resource.
type BAR struct {
	Index              int
	Size               uint64
	IO, Is64, Prefetch bool
}

// Host is a host bridge (a root bus) and what hangs off it.
type Host struct {
	Domain uint16
	Bus    uint8
	NUMA   int
	Fns    []Fn
}

// Spec is a whole node.
type Spec struct {
	Hosts []Host
	// NoIOMMU leaves out iommu_group links, as on a node booted without an IOMMU.
	NoIOMMU bool
}

// Node is a built tree.
type Node struct {
	Root  string                 // pass to pci.Scan
	Names map[string]pci.Address // Fn.Name -> address
	Spec  Spec
}

// Addr returns the address of a named function; it panics on an unknown name, which is a
// bug in the test.
func (n *Node) Addr(name string) pci.Address {
	a, ok := n.Names[name]
	if !ok {
		panic("pcitest: no function named " + name)
	}
	return a
}

// SysfsPath is what lspci's sysfs.path option wants.
func (n *Node) SysfsPath() string { return filepath.Join(n.Root, "sys", "bus", "pci") }

// New builds spec under a test's temporary directory.
func New(t testing.TB, spec Spec) *Node {
	t.Helper()
	n, err := Build(tempDir(t), spec)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// tempDir is a test's scratch directory, on tmpfs when the machine has one: a tree is
// tens of thousands of small files (a 4096-function node is about 80k), which a loaded
// disk file system creates a hundred times slower than memory does.
func tempDir(t testing.TB) string {
	t.Helper()
	const shm = "/dev/shm"
	var st syscall.Statfs_t
	if err := syscall.Statfs(shm, &st); err == nil && st.Type == tmpfsMagic {
		if dir, err := os.MkdirTemp(shm, "pcitest-"); err == nil {
			t.Cleanup(func() {
				if err := os.RemoveAll(dir); err != nil {
					t.Errorf("pcitest: cleanup: %v", err)
				}
			})
			return dir
		}
	}
	return t.TempDir()
}

// tmpfsMagic is TMPFS_MAGIC from linux/magic.h.
const tmpfsMagic = 0x01021994

type built struct {
	fn       *Fn
	addr     pci.Address
	parent   *built
	dir      string // relative to root: sys/devices/pci0000:15/0000:15:02.0/...
	numa     int
	sec, sub uint8
	multi    bool
	vf       bool // an SR-IOV virtual function: its config space reads Vendor/Device 0xffff
	vfOffset int  // a PF's First VF Offset
	cfg      []byte
	bases    []uint64 // the address of each of fn.BARs
}

// barSpace hands out BAR addresses the way a host's firmware might: I/O from 0x1000,
// 32-bit memory from 2 GiB, 64-bit memory from 16 TiB, each aligned to its size.
type barSpace struct{ io, mem32, mem64 uint64 }

func (s *barSpace) place(bs []BAR) ([]uint64, error) {
	out := make([]uint64, len(bs))
	for i, b := range bs {
		if b.Size == 0 || b.Size&(b.Size-1) != 0 {
			return nil, fmt.Errorf("pcitest: BAR %d size %#x is not a power of two", b.Index, b.Size)
		}
		cur := &s.mem32
		switch {
		case b.IO:
			cur = &s.io
		case b.Is64:
			cur = &s.mem64
		}
		base := (*cur + b.Size - 1) &^ (b.Size - 1)
		out[i], *cur = base, base+b.Size
	}
	return out, nil
}

// barRegister is the low register's value: address and the type bits (PCI 3.0 6.2.5.1).
func barRegister(b BAR, base uint64) uint32 {
	if b.IO {
		return uint32(base) | 0x1
	}
	v := uint32(base) &^ 0xf
	if b.Is64 {
		v |= 0x4
	}
	if b.Prefetch {
		v |= 0x8
	}
	return v
}

// resourceFlags is what the kernel writes as a BAR's flags in sysfs resource: the
// register's type bits, IORESOURCE_IO or _MEM, _PREFETCH, _MEM_64 and _SIZEALIGN
// (include/linux/ioport.h; decode_bar and __pci_read_base in drivers/pci/probe.c).
func resourceFlags(b BAR) uint64 {
	const sizeAlign = 0x40000
	if b.IO {
		return 0x100 | sizeAlign | 0x1
	}
	f := uint64(0x200 | sizeAlign)
	if b.Is64 {
		f |= 0x100000 | 0x4
	}
	if b.Prefetch {
		f |= 0x2000 | 0x8
	}
	return f
}

// Build writes spec under root.
func Build(root string, spec Spec) (*Node, error) {
	n := &Node{Root: root, Names: map[string]pci.Address{}, Spec: spec}
	var all []*built
	var err error
	space := barSpace{io: 0x1000, mem32: 0x8000_0000, mem64: 1 << 44}
	for hi := range spec.Hosts {
		h := &spec.Hosts[hi]
		next := int(h.Bus)
		hostDir := filepath.Join("sys", "devices", fmt.Sprintf("pci%04x:%02x", h.Domain, h.Bus))
		if err := place(h.Domain, h.Bus, h.Fns, nil, hostDir, h.NUMA, &next, &all); err != nil {
			return nil, err
		}
	}
	for _, b := range all {
		if b.fn.Name != "" {
			if _, dup := n.Names[b.fn.Name]; dup {
				return nil, fmt.Errorf("pcitest: name %q used twice", b.fn.Name)
			}
			n.Names[b.fn.Name] = b.addr
		}
		if b.bases, err = space.place(b.fn.BARs); err != nil {
			return nil, fmt.Errorf("%s: %w", b.addr, err)
		}
		b.cfg = configBytes(b)
	}
	groups := map[*built]int{}
	if !spec.NoIOMMU {
		groups = assignGroups(all)
	}
	for _, b := range all {
		if err := writeFunction(root, b, groups); err != nil {
			return nil, err
		}
	}
	for _, d := range []string{"sys/bus/pci/drivers", "sys/kernel/iommu_groups"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{"sys/bus/pci/drivers_probe", "sys/bus/pci/rescan"} {
		if err := os.WriteFile(filepath.Join(root, f), nil, 0o200); err != nil {
			return nil, err
		}
	}
	return n, nil
}

func isBridge(f *Fn) bool { return f.Class>>8 == 0x0604 }

// place assigns bus numbers depth first, as firmware enumerates. The VFs of the PFs on a
// bus take the routing IDs after the bus's last function (First VF Offset past the other
// PFs, stride 1, TotalVFs reserved per PF, as ConnectX lays them out), and the buses they
// spill onto are reserved before any bridge on the bus gets its secondary bus.
func place(domain uint16, bus uint8, fns []Fn, parent *built, dir string, numa int, next *int, all *[]*built) error {
	slots := map[uint8]int{}
	lastRID := 0
	for i := range fns {
		slots[fns[i].Dev]++
		if rid := int(fns[i].Dev)<<3 | int(fns[i].Func); rid > lastRID {
			lastRID = rid
		}
	}
	vfStart := map[int]int{} // index into fns -> first VF routing ID
	nextRID := lastRID + 1
	for i := range fns {
		if sr := fns[i].SRIOV; sr != nil {
			if sr.Num > sr.Total {
				return fmt.Errorf("pcitest: %d VFs of %d", sr.Num, sr.Total)
			}
			vfStart[i] = nextRID
			nextRID += sr.Total
		}
	}
	if nextRID > 1 {
		if last := int(bus) + (nextRID-1)>>8; last > 255 {
			return fmt.Errorf("pcitest: VFs on bus %02x run past bus 255", bus)
		} else if last > *next {
			*next = last
		}
	}
	for i := range fns {
		f := &fns[i]
		if f.Dev > 31 || f.Func > 7 {
			return fmt.Errorf("pcitest: bad device %d function %d", f.Dev, f.Func)
		}
		b := &built{fn: f, addr: pci.Address{Domain: domain, Bus: bus, Device: f.Dev, Function: f.Func}, parent: parent, numa: numa}
		if f.NUMA != nil {
			b.numa = *f.NUMA
		}
		b.multi = slots[f.Dev] > 1
		b.dir = filepath.Join(dir, b.addr.String())
		*all = append(*all, b)
		if isBridge(f) {
			*next++
			if *next > 255 {
				return fmt.Errorf("pcitest: out of bus numbers at %s", b.addr)
			}
			b.sec = uint8(*next)
			if err := place(domain, b.sec, f.Below, b, b.dir, b.numa, next, all); err != nil {
				return err
			}
			b.sub = uint8(*next)
		} else if len(f.Below) > 0 {
			return fmt.Errorf("pcitest: %s has functions below but is not a bridge", b.addr)
		}
		if f.SRIOV != nil {
			pfRID := int(f.Dev)<<3 | int(f.Func)
			b.vfOffset = vfStart[i] - pfRID
			for v := 0; v < f.SRIOV.Num; v++ {
				rid := vfStart[i] + v
				vf := &Fn{Vendor: f.Vendor, Device: f.SRIOV.VFDevice, SubVendor: f.SubVendor, SubDevice: f.SubDevice,
					Class: f.Class, Port: pci.PortEndpoint, Link: f.Link, Driver: f.SRIOV.VFDriver}
				if f.ATS != nil {
					vf.ATS = &ATS{}
				}
				va := pci.Address{Domain: domain, Bus: uint8(int(bus) + rid>>8), Device: uint8(rid >> 3 & 31), Function: uint8(rid & 7)}
				vb := &built{fn: vf, addr: va, parent: parent, numa: b.numa, dir: filepath.Join(dir, va.String()), vf: true}
				*all = append(*all, vb)
			}
		}
	}
	return nil
}

func le16(b []byte, off int, v uint16) { binary.LittleEndian.PutUint16(b[off:], v) }
func le32(b []byte, off int, v uint32) { binary.LittleEndian.PutUint32(b[off:], v) }

// configBytes lays out a plausible config space: header, PM, VPD, Express (with LnkCap2),
// then extended capabilities AER, ACS, ATS, SR-IOV, DSN chained from 0x100.
func configBytes(b *built) []byte {
	f := b.fn
	size := pci.ExtendedSize
	if f.Conventional {
		size = pci.ConventionalSize
	}
	c := make([]byte, size)
	if b.vf {
		// A VF's Vendor and Device ID registers read 0xffff (PCIe SR-IOV 1.1 3.4.1.1); the
		// kernel's sysfs vendor/device files carry the real IDs.
		le32(c, pci.ConfigVendorID, 0xffffffff)
	} else {
		le16(c, pci.ConfigVendorID, f.Vendor)
		le16(c, pci.ConfigDeviceID, f.Device)
	}
	le16(c, pci.ConfigCommand, 0x0006) // memory space, bus master
	le16(c, pci.ConfigStatus, pci.StatusCapList)
	c[pci.ConfigRevision] = f.Rev
	c[pci.ConfigClassProg] = byte(f.Class)
	c[pci.ConfigClassProg+1] = byte(f.Class >> 8)
	c[pci.ConfigClassProg+2] = byte(f.Class >> 16)
	ht := byte(pci.HeaderTypeNormal)
	if isBridge(f) {
		ht = pci.HeaderTypeBridge
	}
	if b.multi {
		ht |= 0x80
	}
	c[pci.ConfigHeaderType] = ht
	if isBridge(f) {
		if b.parent != nil {
			c[pci.ConfigPrimaryBus] = b.parent.sec
		} else {
			c[pci.ConfigPrimaryBus] = b.addr.Bus
		}
		c[pci.ConfigSecondaryBus] = b.sec
		c[pci.ConfigSubordinate] = b.sub
	} else {
		le16(c, pci.ConfigSubsysVendor, f.SubVendor)
		le16(c, pci.ConfigSubsysID, f.SubDevice)
	}
	for i, bar := range f.BARs {
		le32(c, pci.ConfigBAR0+4*bar.Index, barRegister(bar, b.bases[i]))
		if bar.Is64 {
			le32(c, pci.ConfigBAR0+4*(bar.Index+1), uint32(b.bases[i]>>32))
		}
	}

	// Standard list: PM at 0x40 -> [VPD at 0x50] -> [Express at 0x60].
	c[pci.ConfigCapPtr] = 0x40
	c[0x40] = pci.CapPM
	le16(c, 0x42, 0x0003) // PM version 3
	next := byte(0)
	if !f.Conventional {
		next = 0x60
	}
	if f.VPD != nil {
		c[0x41] = 0x50
		c[0x50] = pci.CapVPD
		c[0x51] = next
	} else {
		c[0x41] = next
	}
	if f.Conventional {
		return c
	}
	e := 0x60
	c[e] = pci.CapExpress
	flags := uint16(2) | uint16(f.Port)<<4
	if f.Port == pci.PortRootPort || f.Port == pci.PortDownstream {
		flags |= 0x100 // slot implemented
	}
	le16(c, e+pci.ExpFlags, flags)
	le32(c, e+pci.ExpDevCap, 0x00008002) // role-based error reporting, MPS 512
	lk := f.Link
	if lk.MaxSpeed == 0 {
		lk.MaxSpeed = lk.Speed
	}
	if lk.MaxWidth == 0 {
		lk.MaxWidth = lk.Width
	}
	portNum := uint32(0)
	if f.Port == pci.PortRootPort || f.Port == pci.PortDownstream {
		portNum = uint32(f.Dev)
	}
	le32(c, e+pci.ExpLnkCap, uint32(lk.MaxSpeed)|uint32(lk.MaxWidth)<<4|portNum<<24)
	sta := uint16(lk.Speed) | uint16(lk.Width)<<4
	if f.Port == pci.PortRootPort || f.Port == pci.PortDownstream {
		sta |= 0x2000 // Data Link Layer Link Active
	}
	le16(c, e+pci.ExpLnkSta, sta)
	if lk.MaxSpeed > 0 {
		le32(c, e+0x2c, uint32((1<<lk.MaxSpeed)-1)<<1) // LnkCap2: supported speeds vector
	}

	type ext struct {
		id, ver uint16
		fill    func(off int)
	}
	exts := []ext{{pci.ExtCapAER, 2, func(int) {}}}
	if f.ACS != nil {
		exts = append(exts, ext{pci.ExtCapACS, 1, func(off int) {
			le16(c, off+pci.ACSCapReg, uint16(f.ACS.Cap))
			le16(c, off+pci.ACSCtlReg, uint16(f.ACS.Ctl))
		}})
	}
	if f.ATS != nil {
		exts = append(exts, ext{pci.ExtCapATS, 1, func(off int) {
			le16(c, off+pci.ATSCapReg, 0x0020) // page aligned request, queue depth 32
			ctl := uint16(f.ATS.STU & 0x1f)
			if f.ATS.Enable {
				ctl |= 0x8000
			}
			le16(c, off+pci.ATSCtlReg, ctl)
		}})
	}
	if f.SRIOV != nil {
		exts = append(exts, ext{pci.ExtCapSRIOV, 1, func(off int) {
			if f.SRIOV.Num > 0 {
				le16(c, off+pci.SRIOVCtl, 0x0001)
			}
			le16(c, off+pci.SRIOVInitial, uint16(f.SRIOV.Total))
			le16(c, off+pci.SRIOVTotal, uint16(f.SRIOV.Total))
			le16(c, off+pci.SRIOVNum, uint16(f.SRIOV.Num))
			le16(c, off+pci.SRIOVVFOffset, uint16(b.vfOffset))
			le16(c, off+pci.SRIOVVFStride, 1)
			le16(c, off+pci.SRIOVVFDID, f.SRIOV.VFDevice)
		}})
	}
	exts = append(exts, ext{pci.ExtCapDSN, 1, func(off int) {
		le32(c, off+4, uint32(b.addr.Bus)<<8|uint32(b.addr.Device)<<3|uint32(b.addr.Function))
		le32(c, off+8, 0xb300b300)
	}})
	const stride = 0x50
	for i, x := range exts {
		off := pci.ConventionalSize + i*stride
		nxt := 0
		if i+1 < len(exts) {
			nxt = off + stride
		}
		le32(c, off, uint32(x.id)|uint32(x.ver)<<16|uint32(nxt)<<20)
		x.fill(off)
	}
	return c
}

// VPDBytes encodes an identifier string and read-only keywords (with an RV checksum).
func VPDBytes(v *pci.VPD) []byte {
	var out []byte
	out = append(out, 0x82, byte(len(v.Name)), byte(len(v.Name)>>8))
	out = append(out, v.Name...)
	keys := make([]string, 0, len(v.Keywords))
	for k := range v.Keywords {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var ro []byte
	for _, k := range keys {
		ro = append(ro, k[0], k[1], byte(len(v.Keywords[k])))
		ro = append(ro, v.Keywords[k]...)
	}
	ro = append(ro, 'R', 'V', 1, 0)
	out = append(out, 0x90, byte(len(ro)), byte(len(ro)>>8))
	rvAt := len(out) + len(ro) - 1
	out = append(out, ro...)
	var sum byte
	for _, x := range out[:rvAt] {
		sum += x
	}
	out[rvAt] = -sum
	return append(out, 0x78)
}

func rel(from, to string) string {
	r, err := filepath.Rel(from, to)
	if err != nil {
		panic(err)
	}
	return r
}

func writeFunction(root string, b *built, groups map[*built]int) error {
	f := b.fn
	dir := filepath.Join(root, b.dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	files := map[string]string{
		"vendor":           fmt.Sprintf("0x%04x\n", f.Vendor),
		"device":           fmt.Sprintf("0x%04x\n", f.Device),
		"subsystem_vendor": fmt.Sprintf("0x%04x\n", f.SubVendor),
		"subsystem_device": fmt.Sprintf("0x%04x\n", f.SubDevice),
		"class":            fmt.Sprintf("0x%06x\n", f.Class),
		"revision":         fmt.Sprintf("0x%02x\n", f.Rev),
		"numa_node":        fmt.Sprintf("%d\n", b.numa),
		"irq":              "0\n",
		"driver_override":  "(null)\n",
		"enable":           "1\n",
	}
	nres := 17 // 6 BARs, ROM, bridge windows: the kernel prints PCI_NUM_RESOURCES lines
	lines := make([]string, nres)
	for i := range lines {
		lines[i] = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
	}
	for i, bar := range f.BARs {
		lines[bar.Index] = fmt.Sprintf("0x%016x 0x%016x 0x%016x\n", b.bases[i], b.bases[i]+bar.Size-1, resourceFlags(bar))
	}
	res := strings.Join(lines, "")
	files["resource"] = res
	if !f.Conventional {
		speeds := []string{"Unknown", "2.5 GT/s PCIe", "5.0 GT/s PCIe", "8.0 GT/s PCIe", "16.0 GT/s PCIe", "32.0 GT/s PCIe", "64.0 GT/s PCIe"}
		sp := func(s uint8) string {
			if int(s) < len(speeds) {
				return speeds[s]
			}
			return "Unknown"
		}
		files["current_link_speed"] = sp(f.Link.Speed) + "\n"
		files["current_link_width"] = fmt.Sprintf("%d\n", f.Link.Width)
		mx, mw := f.Link.MaxSpeed, f.Link.MaxWidth
		if mx == 0 {
			mx = f.Link.Speed
		}
		if mw == 0 {
			mw = f.Link.Width
		}
		files["max_link_speed"] = sp(mx) + "\n"
		files["max_link_width"] = fmt.Sprintf("%d\n", mw)
	}
	if f.SRIOV != nil {
		files["sriov_totalvfs"] = fmt.Sprintf("%d\n", f.SRIOV.Total)
		files["sriov_numvfs"] = fmt.Sprintf("%d\n", f.SRIOV.Num)
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "config"), b.cfg, 0o644); err != nil {
		return err
	}
	if f.VPD != nil {
		if err := os.WriteFile(filepath.Join(dir, "vpd"), VPDBytes(f.VPD), 0o600); err != nil {
			return err
		}
	}
	busDevs := filepath.Join(root, "sys", "bus", "pci", "devices")
	if err := os.MkdirAll(busDevs, 0o755); err != nil {
		return err
	}
	if err := os.Symlink(rel(busDevs, dir), filepath.Join(busDevs, b.addr.String())); err != nil {
		return err
	}
	if f.Driver != "" {
		drv := filepath.Join(root, "sys", "bus", "pci", "drivers", f.Driver)
		if err := os.MkdirAll(drv, 0o755); err != nil {
			return err
		}
		for _, ctl := range []string{"bind", "unbind", "new_id", "remove_id"} {
			p := filepath.Join(drv, ctl)
			if _, err := os.Stat(p); err != nil {
				if err := os.WriteFile(p, nil, 0o200); err != nil {
					return err
				}
			}
		}
		if err := os.Symlink(rel(dir, drv), filepath.Join(dir, "driver")); err != nil {
			return err
		}
		if err := os.Symlink(rel(drv, dir), filepath.Join(drv, b.addr.String())); err != nil {
			return err
		}
	}
	if g, ok := groups[b]; ok {
		gdir := filepath.Join(root, "sys", "kernel", "iommu_groups", fmt.Sprint(g))
		gdevs := filepath.Join(gdir, "devices")
		if err := os.MkdirAll(gdevs, 0o755); err != nil {
			return err
		}
		if err := os.Symlink(rel(dir, gdir), filepath.Join(dir, "iommu_group")); err != nil {
			return err
		}
		if err := os.Symlink(rel(gdevs, dir), filepath.Join(gdevs, b.addr.String())); err != nil {
			return err
		}
	}
	return nil
}

// Fn returns the function named name anywhere in the spec, to make variants of a
// reference node; it panics on an unknown name, which is a bug in the test.
func (s *Spec) Fn(name string) *Fn {
	var walk func(fns []Fn) *Fn
	walk = func(fns []Fn) *Fn {
		for i := range fns {
			if fns[i].Name == name {
				return &fns[i]
			}
			if f := walk(fns[i].Below); f != nil {
				return f
			}
		}
		return nil
	}
	for i := range s.Hosts {
		if f := walk(s.Hosts[i].Fns); f != nil {
			return f
		}
	}
	panic("pcitest: no function named " + name + " in the spec")
}
