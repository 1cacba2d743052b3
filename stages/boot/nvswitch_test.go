package boot

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
)

// configWrites records every config-space write made through it.
type configWrites struct {
	pci.ConfigIO
	mu     sync.Mutex
	writes []configWrite
}

type configWrite struct {
	addr pci.Address
	off  int64
	n    int
}

func (c *configWrites) WriteConfig(a pci.Address, off int64, p []byte) error {
	c.mu.Lock()
	c.writes = append(c.writes, configWrite{a, off, len(p)})
	c.mu.Unlock()
	return c.ConfigIO.WriteConfig(a, off, p)
}

// bridgeControl is the type 1 header's Bridge Control register (PCI-to-PCI Bridge 1.2,
// 3.2.5.18); its bit 6 is Secondary Bus Reset, which resets everything below the bridge.
const bridgeControl = 0x3e

// TestBootNeverResetsNVSwitchBridge runs a whole boot under b300's passage.erase=require
// (every unit's NVMe erased, every unit function reset through the kernel, then bound to
// vfio-pci, ACS written) on a B300 whose NVSwitch bridge sits below unit 0's switch, every
// function offering FLR and bus reset. No write lands on the bridge's PFs (reset,
// driver_override, a driver's unbind or bind, drivers_probe, config space) nor on the
// Bridge Control register of any bridge (a secondary bus reset), nothing is removed or
// rescanned; the units are reset and ready all the same.
func TestBootNeverResetsNVSwitchBridge(t *testing.T) {
	bn := newBootNodeOf(t, pcitest.WithNVSwitchBridge(pcitest.B300()))
	root := bn.node.Root
	ctrls := simulateNVMe(t, root, "flr bus", func(a pci.Address) *erasetest.Controller {
		return erasetest.New("S"+a.String(), erase.SANICAPCES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16})
	})
	watched := append([]string{"nvsw-bridge-dsp", "bcm-usp0", "rp0"}, pcitest.NVSwitchBridgeFns...)
	before := configFiles(t, bn.node, watched)
	cfg := &configWrites{ConfigIO: pci.SysfsConfig{Root: root}}
	b := &Boot{Root: root, Config: initramfs.ParseCmdline(bootCmdline + " passage.net=off"), Sysfs: bn.kern, ConfigIO: cfg,
		OpenNVMe: func(_ context.Context, a pci.Address) (erase.Controller, string, error) { return ctrls[a], "nvme", nil }}
	if _, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{}); err != nil {
		t.Fatal(err)
	}
	m, err := bn.envelopeOnDisk()
	if err != nil {
		t.Fatal(err)
	}
	// The premise: the boot did reset and bind every unit.
	resets := 0
	for _, u := range m.Units {
		if u.Status != manifest.StatusReady || u.Erase == nil || len(u.Erase.Resets) != len(u.Functions) {
			t.Errorf("%s: %s %v, erase %+v", u.ID, u.Status, u.Reasons, u.Erase)
		}
		if u.Erase != nil {
			resets += len(u.Erase.Resets)
		}
	}
	if len(m.Units) != 8 || resets < 32 || len(cfg.writes) == 0 {
		t.Fatalf("%d units, %d resets, %d config writes: the boot did not do what this test guards", len(m.Units), resets, len(cfg.writes))
	}

	// b300 lays out the HGX partitions and declares no Module ID: each is signed unknown.
	if nv := m.NVLink; nv == nil || len(nv.Partitions) != 15 || len(nv.Partitions[0]) != 8 || nv.Source != "profile b300: nvlink_partitions" {
		t.Errorf("nvlink %+v", nv)
	}
	for _, u := range m.Units {
		if u.ModuleID != 0 || u.ModuleSource != "" {
			t.Errorf("%s: Module ID %d from %q under b300, which declares none", u.ID, u.ModuleID, u.ModuleSource)
		}
	}

	bridgePFs := map[pci.Address]string{}
	for _, name := range pcitest.NVSwitchBridgeFns {
		a := bn.node.Addr(name)
		bridgePFs[a] = name
		if w := bn.kern.Touched(a); len(w) != 0 {
			t.Errorf("%s (%s) written by the boot: %v", name, a, w)
		}
	}
	for _, w := range bn.kern.Writes() {
		if strings.HasSuffix(w.Path, "/remove") || strings.HasSuffix(w.Path, "/rescan") {
			t.Errorf("the boot wrote %s", w.Path)
		}
	}
	for _, w := range cfg.writes {
		if name, ok := bridgePFs[w.addr]; ok {
			t.Errorf("config write to %s (%s) at %#x", name, w.addr, w.off)
		}
		if w.off <= bridgeControl+1 && w.off+int64(w.n) > bridgeControl {
			t.Errorf("config write to %s's Bridge Control (%#x, %d bytes)", w.addr, w.off, w.n)
		}
	}
	after := configFiles(t, bn.node, watched)
	for _, name := range watched {
		if before[name] != after[name] {
			t.Errorf("%s's config space changed", name)
		}
	}
	for _, u := range m.Units {
		for _, f := range u.Functions {
			a, _ := pci.ParseAddress(f.BDF)
			if name, ok := bridgePFs[a]; ok {
				t.Errorf("%s (%s) is a function of unit %s", name, f.BDF, u.ID)
			}
		}
	}
}

// configFiles reads the named functions' config space: whole for an endpoint, the
// Bridge Control register for a bridge, whose ACS Control the boot may write.
func configFiles(t *testing.T, n *pcitest.Node, names []string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, name := range names {
		b, err := os.ReadFile(filepath.Join(n.Root, pci.DevicesDir, n.Addr(name).String(), "config"))
		if err != nil {
			t.Fatal(err)
		}
		if b[pci.ConfigHeaderType]&0x7f == pci.HeaderTypeBridge {
			b = b[bridgeControl : bridgeControl+2]
		}
		out[name] = string(b)
	}
	return out
}

// TestNetworkLeavesNVSwitchBridgeAlone: with no management NIC's netdev to prefer,
// passage.net=auto brings up the netdevs that are neither a unit's nor the NVSwitch
// bridge's (its ports are on the NVLink management fabric, Fabric Manager's and
// NVLSM's), and says why it left the latter out. (eth9 is a netdev on some other host
// function; the test tree has no such NIC, so it borrows the placeholder's address.)
func TestNetworkLeavesNVSwitchBridgeAlone(t *testing.T) {
	bn := newBootNodeOf(t, pcitest.WithNVSwitchBridge(pcitest.B300()))
	root := bn.node.Root
	if err := os.RemoveAll(filepath.Join(root, "sys/class/net/eth0")); err != nil { // mgmt0's
		t.Fatal(err)
	}
	for iface, fn := range map[string]string{"ibp32s0": "nvsw-lpf0", "ibp32s0f2": "nvsw-fc0", "eth9": "holder3"} {
		dir := filepath.Join(root, "sys/class/net", iface)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("../../../bus/pci/devices/"+bn.node.Addr(fn).String(), filepath.Join(dir, "device")); err != nil {
			t.Fatal(err)
		}
	}
	b := bn.boot(bootCmdline + " passage.net=auto")
	var up []string
	b.LinkUp = func(string) error { return nil }
	b.NetUp = func(_ context.Context, ifs []string) ([]netboot.Lease, error) {
		up = ifs
		return []netboot.Lease{{Iface: ifs[0], MAC: "52:54:00:00:00:02", CIDR: "10.0.2.16/24"}}, nil
	}
	rs, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(up, ",") != "eth9" {
		t.Errorf("brought up %v, want eth9 alone (eth1 is a unit's, the ib ports the NVSwitch bridge's)", up)
	}
	notes := strings.Join(resultOf(rs, "network").Findings, "\n")
	for _, iface := range []string{"ibp32s0", "ibp32s0f2"} {
		if !strings.Contains(notes, iface+" (") || !strings.Contains(notes, "NVSwitch management function: not used") {
			t.Errorf("network findings do not say why %s was left out:\n%s", iface, notes)
		}
	}
}
