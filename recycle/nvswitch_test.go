package recycle_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
)

// TestRecycleNeverResetsNVSwitchBridge recycles every unit of a B300 whose NVSwitch
// bridge sits below unit 0's switch, every function offering FLR and bus reset: each
// unit is released, erased, reset and bound again, and no write lands on the bridge's
// PFs (reset, driver_override, a driver's unbind or bind, drivers_probe), nothing is
// removed or rescanned, and neither their config space nor the Bridge Control register
// (Secondary Bus Reset) of a bridge above them changes.
func TestRecycleNeverResetsNVSwitchBridge(t *testing.T) {
	n := newNodeOf(t, pcitest.WithNVSwitchBridge(pcitest.B300()))
	watched := append([]string{"nvsw-bridge-dsp", "bcm-usp0", "rp0"}, pcitest.NVSwitchBridgeFns...)
	before := configs(t, n.pn, watched)
	n.k.ResetWrites()
	units := []topology.UnitID{0, 1, 2, 3, 4, 5, 6, 7}
	res, err := recycle.Run(context.Background(), n.opts(units...))
	if err != nil || !res.Completed {
		t.Fatalf("recycle: %v", err)
	}
	resets := 0
	for _, u := range res.Erase.Units {
		for _, r := range u.Resets {
			if r.Err != "" {
				t.Errorf("unit %s: reset %s: %s", u.ID, r.Addr, r.Err)
			}
			resets++
		}
	}
	if resets < 32 {
		t.Fatalf("%d resets: the recycle did not do what this test guards", resets)
	}
	for _, name := range pcitest.NVSwitchBridgeFns {
		a := n.pn.Addr(name)
		if w := n.k.Touched(a); len(w) != 0 {
			t.Errorf("%s (%s) written by the recycle: %v", name, a, w)
		}
	}
	for _, w := range n.k.Writes() {
		if strings.HasSuffix(w.Path, "/remove") || strings.HasSuffix(w.Path, "/rescan") {
			t.Errorf("the recycle wrote %s", w.Path)
		}
	}
	after := configs(t, n.pn, watched)
	for _, name := range watched {
		if before[name] != after[name] {
			t.Errorf("%s's config space changed", name)
		}
	}
}

// configs reads the named functions' config space: whole for an endpoint, the Bridge
// Control register (0x3e; bit 6 is Secondary Bus Reset) for a bridge, whose ACS Control
// the recycle may write.
func configs(t *testing.T, n *pcitest.Node, names []string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, name := range names {
		b, err := os.ReadFile(filepath.Join(n.Root, pci.DevicesDir, n.Addr(name).String(), "config"))
		if err != nil {
			t.Fatal(err)
		}
		if b[pci.ConfigHeaderType]&0x7f == pci.HeaderTypeBridge {
			b = b[0x3e:0x40]
		}
		out[name] = string(b)
	}
	return out
}
