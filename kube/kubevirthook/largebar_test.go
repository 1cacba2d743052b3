package kubevirthook

import (
	"encoding/xml"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"libvirt.org/go/libvirtxml"

	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
)

// withCPUMode sets the domain's <cpu mode>, as KubeVirt writes spec.domain.cpu.model
// (host-passthrough, host-model, or a named model as custom).
func withCPUMode(t *testing.T, dom []byte, mode string) []byte {
	t.Helper()
	var s api.DomainSpec
	if err := xml.Unmarshal(dom, &s); err != nil {
		t.Fatal(err)
	}
	s.CPU.Mode = mode
	b, err := xml.MarshalIndent(s, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestDefineDomainGuestWidth: the manifest signs B300 BAR sizes (GPU BAR1 512 GiB); eight
// units need 8 TiB of 64-bit MMIO, which OVMF maps only at a 46-bit guest width. The
// hook cannot set the width (virt-launcher keeps no <maxphysaddr>), so it refuses a
// domain whose CPU mode gives less, naming the width needed and the width given, and
// passes one that holds it.
func TestDefineDomainGuestWidth(t *testing.T) {
	m, path, keys := signed(t, nil)
	all := []string{"gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6", "gpu7"}
	eight := kubevirtDomain(t, m, all, false)
	one := kubevirtDomain(t, m, []string{"gpu0"}, false)
	for _, tc := range []struct {
		name     string
		dom      []byte
		hostBits int
		want     string // "" accepted
	}{
		{"8 units, host-model", withCPUMode(t, eight, "host-model"), 52,
			"guest: 8 units need 7808 GiB of 64-bit MMIO, a 46-bit physical address width; the width given is 40 bits, whose OVMF window is 128 GiB: their BARs would not all be mapped (cpu mode host-model: QEMU's default for a named CPU model; spec.domain.cpu.model: host-passthrough gives the host's 52)"},
		{"8 units, no cpu mode", eight, 52, "the width given is 40 bits"},
		{"8 units, host-passthrough on a 45-bit host", withCPUMode(t, eight, "host-passthrough"), 45,
			"a 46-bit physical address width; the width given is 45 bits, whose OVMF window is 4 TiB: their BARs would not all be mapped (cpu mode host-passthrough: the host's)"},
		{"1 unit, host-model", withCPUMode(t, one, "host-model"), 52, "guest: 1 units need 528 GiB of 64-bit MMIO, a 43-bit physical address width; the width given is 40 bits"},
		{"8 units, host-passthrough on a 52-bit host", withCPUMode(t, eight, "host-passthrough"), 52, ""},
		{"1 unit, host-passthrough on a 43-bit host", withCPUMode(t, one, "host-passthrough"), 43, ""},
		{"width unknown: not checked", eight, 0, ""},
	} {
		c := Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID, HostPhysBits: tc.hostBits}
		r, err := c.DefineDomain(tc.dom)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want == "" && (r.Guest == nil || len(r.Guest.Units) != unitsNamed(tc.name)):
			t.Errorf("%s: guest %+v", tc.name, r.Guest)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: err %v, want %q", tc.name, err, tc.want)
		}
	}
}

// unitsNamed is how many units a case's name says its domain holds.
func unitsNamed(name string) int {
	if strings.HasPrefix(name, "1 unit") {
		return 1
	}
	return 8
}

func TestHostPhysBits(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, text string
		want       int
		err        string
	}{
		{"xeon", "processor\t: 0\naddress sizes\t: 52 bits physical, 57 bits virtual\n", 52, ""},
		{"second cpu ignored", "address sizes\t: 46 bits physical, 48 bits virtual\naddress sizes\t: 52 bits physical\n", 46, ""},
		{"none", "processor\t: 0\n", 0, "no address sizes line"},
		{"garbage", "address sizes\t: lots\n", 0, `address sizes "lots": not a physical width`},
		{"too wide", "address sizes\t: 99 bits physical\n", 0, "not a physical width"},
	} {
		f := filepath.Join(dir, tc.name)
		if err := os.WriteFile(f, []byte(tc.text), 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := HostPhysBits(f)
		if got != tc.want || tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%s: %d, %v; want %d, %q", tc.name, got, err, tc.want, tc.err)
		}
	}
	if _, err := HostPhysBits(filepath.Join(dir, "missing")); err == nil {
		t.Error("missing cpuinfo: no error")
	}
}

// withRootPorts adds n root ports on pcie.0 at 00:02.x, as libvirt places KubeVirt's.
func withRootPorts(t *testing.T, dom []byte, n int) []byte {
	t.Helper()
	d, err := parseDomain(dom)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		d.Devices.Controllers = append(d.Devices.Controllers, libvirtxml.DomainController{
			Type: "pci", Index: ptr(uint(100 + i)), Model: "pcie-root-port",
			Address: &libvirtxml.DomainAddress{PCI: &libvirtxml.DomainAddressPCI{Domain: ptr(uint(0)), Bus: ptr(uint(0)), Slot: ptr(uint(2)), Function: ptr(uint(i))}},
		})
	}
	s, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return []byte(s)
}

// TestDefineDomainOtherPorts: the domain's other root ports sit on pcie.0 with the units'
// (no guest NUMA): OVMF lays the one root bridge out in descending alignment, so their
// padding (4 GiB each at 43 bits) goes after the unit, in its alignment gap. A unit alone
// and a unit beside seven hotplug-capable ports both fit 43 bits (528 and 556 GiB of the
// 1 TiB window); neither fits 42.
func TestDefineDomainOtherPorts(t *testing.T) {
	m, path, keys := signed(t, nil)
	one := withCPUMode(t, kubevirtDomain(t, m, []string{"gpu0"}, false), "host-passthrough")
	for _, tc := range []struct {
		name     string
		dom      []byte
		hostBits int
		want     string // "" accepted
	}{
		{"alone at 43", one, 43, ""},
		{"alone at 42", one, 42, "guest: 1 units need 528 GiB of 64-bit MMIO, a 43-bit physical address width; the width given is 42 bits"},
		{"7 ports at 42", withRootPorts(t, one, 7), 42,
			"guest: 1 units beside the domain's 7 other root ports (OVMF pads each of the 7 hotplug-capable ones with 4 GiB of the window at 43 bits, 28 GiB in all) need 556 GiB of 64-bit MMIO, a 43-bit physical address width; the width given is 42 bits"},
		{"7 ports at 43", withRootPorts(t, one, 7), 43, ""},
	} {
		c := Config{Manifest: path, Keys: keys, NodeUUID: m.Node.DMIUUID, HostPhysBits: tc.hostBits}
		_, err := c.DefineDomain(tc.dom)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}
