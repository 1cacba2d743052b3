package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind"
)

// TestCommandsNeverTouchNVSwitchBridge: on a B300 whose NVSwitch bridge sits below unit
// 0's switch, plan labels the bridge's four PFs nvswitch-mgmt; apply binds every unit
// (ACS written, host drivers unbound) and unbind hands every unit back, and neither
// writes to the bridge's PFs (driver_override, a driver's unbind or bind, drivers_probe,
// reset) nor changes their config space or the Bridge Control register (Secondary Bus
// Reset) of a bridge above them.
func TestCommandsNeverTouchNVSwitchBridge(t *testing.T) {
	n := pcitest.New(t, pcitest.WithNVSwitchBridge(pcitest.B300()))
	if err := os.MkdirAll(filepath.Join(n.Root, "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", n.Root, "--erase", "off"}, &out, &errb); code != 0 {
		t.Fatalf("plan: exit %d\n%s%s", code, out.String(), errb.String())
	}
	for _, name := range pcitest.NVSwitchBridgeFns {
		if line := lineWith(out.String(), n.Addr(name).String()); !strings.Contains(line, "nvswitch-mgmt") {
			t.Errorf("plan's line for %s: %q", name, line)
		}
	}
	watched := append([]string{"nvsw-bridge-dsp", "bcm-usp0", "rp0"}, pcitest.NVSwitchBridgeFns...)
	before := bridgeConfigs(t, n, watched)
	k := simulatedKernel(t, n.Root)
	env := applyEnv{sysfs: func(string) vfiobind.Sysfs { return k }, modules: func(string, string) vfiobind.ModuleLoader { return k }}
	out.Reset()
	if code := runApply([]string{"--root", n.Root, "--erase", "off"}, &out, &errb, env); code != 0 {
		t.Fatalf("apply: exit %d\n%s%s", code, out.String(), errb.String())
	}
	out.Reset()
	units := "gpu0,gpu1,gpu2,gpu3,gpu4,gpu5,gpu6,gpu7"
	if code := runUnbind([]string{"--root", n.Root, "--unit", units}, &out, &errb, unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }}); code != 0 {
		t.Fatalf("unbind: exit %d\n%s%s", code, out.String(), errb.String())
	}
	if len(k.Writes()) < 64 {
		t.Fatalf("%d writes: apply and unbind did not do what this test guards", len(k.Writes()))
	}
	for _, name := range pcitest.NVSwitchBridgeFns {
		a := n.Addr(name)
		if w := k.Touched(a); len(w) != 0 {
			t.Errorf("%s (%s) written: %v", name, a, w)
		}
	}
	for _, w := range k.Writes() {
		if strings.HasSuffix(w.Path, "/reset") || strings.HasSuffix(w.Path, "/remove") || strings.HasSuffix(w.Path, "/rescan") {
			t.Errorf("wrote %s", w.Path)
		}
	}
	after := bridgeConfigs(t, n, watched)
	for _, name := range watched {
		if before[name] != after[name] {
			t.Errorf("%s's config space changed", name)
		}
	}
}

func lineWith(text, s string) string {
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}

// bridgeConfigs reads the named functions' config space: whole for an endpoint, the
// Bridge Control register (0x3e; bit 6 is Secondary Bus Reset) for a bridge, whose ACS
// Control apply writes.
func bridgeConfigs(t *testing.T, n *pcitest.Node, names []string) map[string]string {
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
