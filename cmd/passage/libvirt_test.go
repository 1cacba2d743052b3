package main

import (
	"encoding/xml"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/hypervisor/libvirttest"
	"github.com/passage-boot/passage/pci/pcitest"
)

// libvirtXML is the part of a domain this test compares: every PCI controller and
// every hostdev, with their addresses.
type libvirtXML struct {
	Type        string `xml:"type,attr"`
	Name        string `xml:"name"`
	Controllers []struct {
		Type    string     `xml:"type,attr"`
		Index   int        `xml:"index,attr"`
		Model   string     `xml:"model,attr"`
		Address *lvAddrXML `xml:"address"`
		Target  *struct {
			Chassis *int `xml:"chassis,attr"`
		} `xml:"target"`
	} `xml:"devices>controller"`
	Balloon struct {
		Model string `xml:"model,attr"`
	} `xml:"devices>memballoon"`
	Hostdevs []struct {
		Managed string    `xml:"managed,attr"`
		Source  lvAddrXML `xml:"source>address"`
		Address lvAddrXML `xml:"address"`
	} `xml:"devices>hostdev"`
}

type lvAddrXML struct {
	Domain   string `xml:"domain,attr"`
	Bus      string `xml:"bus,attr"`
	Slot     string `xml:"slot,attr"`
	Function string `xml:"function,attr"`
}

// key reads the address as numbers, so 0x0 and 0x00 compare equal.
func (a lvAddrXML) key(t *testing.T) string {
	t.Helper()
	var out []string
	for _, s := range []string{a.Domain, a.Bus, a.Slot, a.Function} {
		v, err := strconv.ParseUint(strings.TrimPrefix(s, "0x"), 16, 32)
		if err != nil {
			t.Fatalf("address %+v: %q: %v", a, s, err)
		}
		out = append(out, fmt.Sprint(v))
	}
	return strings.Join(out, ":")
}

// noNUMA is the reference B300 tree on a host that reports no NUMA placement: every
// function's numa_node reads -1, as under QEMU or on a single-socket host.
func noNUMA() pcitest.Spec {
	s := pcitest.B300()
	for i := range s.Hosts {
		s.Hosts[i].NUMA = -1
	}
	return s
}

// TestLibvirtAcceptsDomain: every domain rendered from a signed manifest, in every
// combination (flat and --numa, kvm and qemu, units whose numa_node is -1 and >= 0),
// validates against libvirt's own schema (virt-xml-validate), and a real libvirtd
// defines it and keeps every controller and hostdev address as rendered.
func TestLibvirtAcceptsDomain(t *testing.T) {
	if _, err := exec.LookPath("virt-xml-validate"); err != nil {
		t.Fatalf("virt-xml-validate is needed for this test (apt-get install libvirt-clients libxml2-utils): %v", err)
	}
	nodes := map[string]signedNode{"numa": bootSigned(t, pcitest.B300()), "nonuma": bootSigned(t, noNUMA())}
	for _, u := range nodes["nonuma"].m.Units {
		for _, f := range u.Functions {
			if f.NUMANode != -1 {
				t.Fatalf("nonuma: %s numa_node %d, want -1", f.BDF, f.NUMANode)
			}
		}
	}
	dir := t.TempDir()
	type domainCase struct {
		name, node string
		args       []string
	}
	var cases []domainCase
	for _, node := range []string{"numa", "nonuma"} {
		for _, layout := range []struct {
			name string
			args []string
		}{{"flat", []string{"--unit", "0,1"}}, {"numa", []string{"--unit", "0,1,4", "--numa"}}} {
			for _, typ := range []string{"kvm", "qemu"} {
				cases = append(cases, domainCase{name: node + "-" + layout.name + "-" + typ, node: node,
					args: append([]string{"--domain-type", typ}, layout.args...)})
			}
		}
	}
	files := map[string]string{}
	for _, c := range cases {
		n := nodes[c.node]
		args := append([]string{n.envelope, "--pub", n.pub, "--format", "libvirt",
			"--vcpus", "2", "--memory", "1024", "--name", "passage-test-" + c.name}, c.args...)
		code, out, errs := runCmd(t, cmdRender, args...)
		if code != 0 {
			t.Fatalf("render %v: exit %d %s", args, code, errs)
		}
		f := filepath.Join(dir, c.name+".xml")
		if err := os.WriteFile(f, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
		files[c.name] = f
		v, err := exec.Command("virt-xml-validate", f, "domain").CombinedOutput()
		if err != nil || !strings.Contains(string(v), "validates") {
			t.Errorf("%s: virt-xml-validate: %v\n%s\n%s", c.name, err, v, out)
		}
	}

	uri := libvirttest.Start(t)
	for _, c := range cases {
		rendered, err := os.ReadFile(files[c.name])
		if err != nil {
			t.Fatal(err)
		}
		name := "passage-test-" + c.name
		libvirttest.TCG.Define(t, uri, files[c.name])
		dumped := libvirttest.Virsh(t, uri, "dumpxml", name)
		libvirttest.Virsh(t, uri, "undefine", name)

		var want, got libvirtXML
		if err := xml.Unmarshal(rendered, &want); err != nil {
			t.Fatal(err)
		}
		if err := xml.Unmarshal([]byte(dumped), &got); err != nil {
			t.Fatalf("dumpxml: %v\n%s", err, dumped)
		}
		if typ := libvirttest.TCG.DomainType(c.args[1]); got.Type != typ || got.Name != name {
			t.Errorf("%s: libvirt keeps type %q name %q", c.name, got.Type, got.Name)
		}
		kept := map[int]string{}
		for _, ctl := range got.Controllers {
			if ctl.Type == "pci" {
				addr := ""
				if ctl.Address != nil {
					addr = ctl.Address.key(t)
				}
				kept[ctl.Index] = ctl.Model + "@" + addr
			}
		}
		controllers := 0
		chassis := map[int]int{} // chassis -> controller index
		for _, ctl := range want.Controllers {
			if ctl.Type != "pci" {
				continue
			}
			// libvirt gives QEMU no slot (it stays 0): each port needs a chassis of
			// its own, or QEMU refuses the second one in it.
			if ctl.Target != nil && ctl.Target.Chassis != nil {
				if other, ok := chassis[*ctl.Target.Chassis]; ok {
					t.Errorf("%s: controllers %d and %d in chassis %d", c.name, other, ctl.Index, *ctl.Target.Chassis)
				}
				chassis[*ctl.Target.Chassis] = ctl.Index
			}
			addr := ""
			if ctl.Address != nil {
				addr = ctl.Address.key(t)
			}
			if w := ctl.Model + "@" + addr; kept[ctl.Index] != w {
				t.Errorf("%s: controller index %d: libvirt keeps %q, rendered %q", c.name, ctl.Index, kept[ctl.Index], w)
			}
			controllers++
		}
		// libvirt adds no PCI controller of its own (a USB controller or a balloon
		// would each get a root port before the plan's) and no balloon.
		if len(kept) != controllers || got.Balloon.Model != "none" {
			t.Errorf("%s: libvirt keeps %d PCI controllers, %d rendered; memballoon %q", c.name, len(kept), controllers, got.Balloon.Model)
		}
		hostdevs := map[string]string{}
		for _, h := range got.Hostdevs {
			if h.Managed != "no" {
				t.Errorf("%s: hostdev %+v: managed %q", c.name, h.Source, h.Managed)
			}
			hostdevs[h.Source.key(t)] = h.Address.key(t)
		}
		for _, h := range want.Hostdevs {
			if g := hostdevs[h.Source.key(t)]; g != h.Address.key(t) {
				t.Errorf("%s: hostdev %s: libvirt puts it at %q, rendered %q", c.name, h.Source.key(t), g, h.Address.key(t))
			}
		}
		units := len(strings.Split(c.args[3], ","))
		if len(want.Hostdevs) != 4*units || len(got.Hostdevs) != len(want.Hostdevs) || controllers < 1+6*units {
			t.Errorf("%s: rendered %d hostdevs, %d controllers; libvirt kept %d hostdevs", c.name, len(want.Hostdevs), controllers, len(got.Hostdevs))
		}
		if c.node == "numa" && slices.Contains(c.args, "--numa") {
			// Two guest cells (host nodes 0 and 1), one vCPU each, pinned to its node's CPUs.
			for _, pin := range []string{`<vcpupin vcpu='0' cpuset='0-63,128-191'/>`, `<vcpupin vcpu='1' cpuset='64-127,192-255'/>`, `<memnode cellid='1' mode='strict' nodeset='1'/>`} {
				if !strings.Contains(dumped, pin) {
					t.Errorf("numa: libvirt does not keep %s:\n%s", pin, dumped)
				}
			}
		}
		// The guest's width: 0,1 need 1 TiB + 544 GiB of 64-bit MMIO (44 bits), 0,1,4
		// on two expanders 2 TiB + 576 GiB (45 bits).
		bits := map[int]string{2: "44", 3: "45"}[units]
		if want := "<maxphysaddr mode='emulate' bits='" + bits + "'/>"; !strings.Contains(dumped, want) {
			t.Errorf("%s: libvirt does not keep %s:\n%s", c.name, want, dumped)
		}
		t.Logf("%s: libvirt kept %d controllers and %d hostdevs as rendered", c.name, controllers, len(got.Hostdevs))
	}
	// Nothing of the host's networking was touched: no network defined, no bridge.
	if nets := strings.TrimSpace(libvirttest.Virsh(t, uri, "net-list", "--all", "--name")); nets != "" {
		t.Errorf("libvirt has networks: %q", nets)
	}
	if _, err := net.InterfaceByName("virbr0"); err == nil {
		t.Error("virbr0 exists")
	}
}
