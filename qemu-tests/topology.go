package qemutest

import (
	"fmt"
	"strings"
)

// Topology is the emulated PCIe tree of the `qemu` profile (qemu-tests/README.md has
// the BDFs the guest sees). Each GPU unit is shaped like one B300 GPU subtree:
//
//	root port -> x3130-upstream ("Broadcom switch")
//	  port 00.0 -> x3130-upstream ("CX-8 internal switch")
//	    port 00.0 -> virtio-net-pci 00.0 + 00.1 ("CX-8 PF0/PF1", ats=on)
//	    port 02.0 -> x3130-upstream -> port 00.0 -> virtio-gpu-pci ("GPU")
//	  port 02.0 -> nvme (the unit's NVMe)
//
// The switch "downstream ports" are pcie-root-ports: QEMU 7.2's xio3130-downstream has
// no ACS capability, and the ACS path is what the stage programs.
type Topology struct {
	Units int // GPU units; 0 means 2

	// ATSOff takes ATS away from unit 1's PF1 (scenario 3).
	ATSOff bool
	// SharedGroup puts a pcie-pci-bridge on unit 1's outer switch port 01.0 with an
	// e1000 passthrough stand-in and a second management NIC (e1000) behind it: one
	// IOMMU group for both (scenario 5).
	SharedGroup bool
	// NoACSPort puts unit 1's NVMe below an xio3130-downstream port, which has no ACS
	// capability (scenario 5, second half).
	NoACSPort bool
	// NVMeImages are raw image files backing unit i's NVMe namespace (index i; "" or
	// beyond the list: a controller without a namespace, the default).
	NVMeImages []string
	// DHCPHostname is the host name QEMU's DHCP server gives the management NIC (option
	// 12: slirp's hostname=); "" sends none.
	DHCPHostname string
}

// Root-complex slots: fixed, so every variant keeps the same BDFs for what it shares.
const (
	mgmtRootSlot  = 0x02
	unitRootSlot0 = 0x03 // unit i's root port is at 00:(03+i).0
	diskSlot      = 0x10
)

type argBuilder struct {
	args    []string
	chassis int
}

func (b *argBuilder) dev(format string, a ...any) {
	b.args = append(b.args, "-device", fmt.Sprintf(format, a...))
}

// rootPort adds a pcie-root-port; every one needs its own chassis/slot pair.
func (b *argBuilder) rootPort(id, bus string, addr string) {
	b.chassis++
	b.dev("pcie-root-port,id=%s,bus=%s,addr=%s,chassis=%d,slot=0", id, bus, addr, b.chassis)
}

// nic adds a NIC with its own user-mode netdev; restrict=on keeps the guest off any
// network but QEMU's own DHCP/DNS.
func (b *argBuilder) nic(model, id, bus, addr, extra string) {
	b.nicNamed(model, id, bus, addr, extra, "")
}

// nicNamed is nic whose DHCP answers carry host name option 12 (when hostname is not "").
func (b *argBuilder) nicNamed(model, id, bus, addr, extra, hostname string) {
	netdev := fmt.Sprintf("user,id=%s,restrict=on", id)
	if hostname != "" {
		netdev += ",hostname=" + hostname
	}
	b.args = append(b.args, "-netdev", netdev)
	opt := ""
	if extra != "" {
		opt = "," + extra
	}
	b.dev("%s,id=%s,netdev=%s,bus=%s,addr=%s,romfile=%s", model, id+"d", id, bus, addr, opt)
}

// Args renders the topology as QEMU -device/-netdev arguments.
func (t Topology) Args() []string {
	units := t.Units
	if units == 0 {
		units = 2
	}
	b := &argBuilder{}
	// The management NIC on its own root port, as on a real node's separate host bridge.
	b.rootPort("mgmt", "pcie.0", fmt.Sprintf("0x%x.0", mgmtRootSlot))
	b.nicNamed("e1000e", "mgmt0", "mgmt", "0x0.0", "mac=52:54:00:00:00:01", t.DHCPHostname)
	for i := 0; i < units; i++ {
		u := fmt.Sprintf("u%d", i)
		b.rootPort(u+"rp", "pcie.0", fmt.Sprintf("0x%x.0", unitRootSlot0+i))
		b.dev("x3130-upstream,id=%ssw,bus=%srp", u, u)
		// The "CX-8 internal switch" on the outer switch's port 00.0.
		b.rootPort(u+"p0", u+"sw", "0x0.0")
		b.dev("x3130-upstream,id=%scx,bus=%sp0", u, u)
		b.rootPort(u+"cxp0", u+"cx", "0x0.0")
		pf1ATS := "on"
		if t.ATSOff && i == 1 {
			pf1ATS = "off"
		}
		b.nic("virtio-net-pci", u+"pf0", u+"cxp0", "0x0.0",
			fmt.Sprintf("multifunction=on,ats=on,iommu_platform=on,disable-legacy=on,mac=52:54:00:00:%02x:10", i))
		b.nic("virtio-net-pci", u+"pf1", u+"cxp0", "0x0.1",
			fmt.Sprintf("ats=%s,iommu_platform=on,disable-legacy=on,mac=52:54:00:00:%02x:11", pf1ATS, i))
		// The GPU sits one more switch down, as B300's GPU does below the CX-8 bridge.
		b.rootPort(u+"cxp2", u+"cx", "0x2.0")
		b.dev("x3130-upstream,id=%sgs,bus=%scxp2", u, u)
		b.rootPort(u+"gp", u+"gs", "0x0.0")
		b.dev("virtio-gpu-pci,id=%sgpu,bus=%sgp,addr=0x0.0,ats=on,iommu_platform=on,disable-legacy=on", u, u)
		if t.SharedGroup && i == 1 {
			b.rootPort(u+"p1", u+"sw", "0x1.0")
			b.dev("pcie-pci-bridge,id=%sppb,bus=%sp1,addr=0x0.0", u, u)
			b.nic("e1000", u+"pt", u+"ppb", "0x1.0", fmt.Sprintf("mac=52:54:00:00:%02x:20", i))
			b.nic("e1000", "mgmt1", u+"ppb", "0x2.0", "mac=52:54:00:00:00:02")
		}
		// The unit's NVMe on the outer switch's port 02.0.
		if t.NoACSPort && i == 1 {
			b.chassis++
			b.dev("xio3130-downstream,id=%sp2,bus=%ssw,addr=0x2.0,chassis=%d,slot=0", u, u, b.chassis)
		} else {
			b.rootPort(u+"p2", u+"sw", "0x2.0")
		}
		if i < len(t.NVMeImages) && t.NVMeImages[i] != "" {
			b.args = append(b.args, "-drive", fmt.Sprintf("file=%s,if=none,id=%snvmedrv,format=raw,cache=unsafe", t.NVMeImages[i], u))
			b.dev("nvme,id=%snvme,bus=%sp2,addr=0x0.0,serial=unit%dnvme,drive=%snvmedrv", u, u, i, u)
		} else {
			b.dev("nvme,id=%snvme,bus=%sp2,addr=0x0.0,serial=unit%dnvme", u, u, i)
		}
	}
	return b.args
}

// Name is a short label for logs and file names.
func (t Topology) Name() string {
	var parts []string
	if t.ATSOff {
		parts = append(parts, "ats-off")
	}
	if t.SharedGroup {
		parts = append(parts, "shared-group")
	}
	if t.NoACSPort {
		parts = append(parts, "no-acs-port")
	}
	if len(parts) == 0 {
		return "default"
	}
	return strings.Join(parts, "+")
}

// ParseTopology reads a variant list as Name writes it ("default", "ats-off",
// "shared-group+no-acs-port", ...).
func ParseTopology(s string) (Topology, error) {
	var t Topology
	if s == "" || s == "default" {
		return t, nil
	}
	for _, p := range strings.Split(s, "+") {
		switch p {
		case "ats-off":
			t.ATSOff = true
		case "shared-group":
			t.SharedGroup = true
		case "no-acs-port":
			t.NoACSPort = true
		default:
			return t, fmt.Errorf("topology %q: unknown variant %q (want default, ats-off, shared-group, no-acs-port, joined by +)", s, p)
		}
	}
	return t, nil
}
