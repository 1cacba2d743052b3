package erase_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// bridgeNode is the B300 reference with the NVSwitch bridge below unit 0's switch,
// labelled by b300, every function offering FLR, and the simulated kernel recording
// every write.
func bridgeNode(t *testing.T) (*pcitest.Node, *topology.Labels, *vfiotest.Kernel) {
	t.Helper()
	n := pcitest.New(t, pcitest.WithNVSwitchBridge(pcitest.B300()))
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range tree.Devices {
		dir := filepath.Join(n.Root, pci.DevicesDir, d.Addr.String())
		if err := os.WriteFile(filepath.Join(dir, "reset_method"), []byte("flr bus\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "reset"), nil, 0o200); err != nil {
			t.Fatal(err)
		}
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	l, err := topology.Label(tree, p)
	if err != nil {
		t.Fatal(err)
	}
	k, err := vfiotest.New(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	return n, l, k
}

// TestResetRefusesHostKept: Reset, which every reset passage makes goes through,
// writes a unit function's reset attribute and refuses, writing nothing, the NVSwitch
// bridge's PFs (an FLR of a limited PF resets its NVSwitch), any other function the
// host keeps, a bridge (its secondary bus reset reaches everything below), and any
// function at all without labels.
func TestResetRefusesHostKept(t *testing.T) {
	n, l, k := bridgeNode(t)
	ctx := context.Background()
	gpu := n.Addr("gpu0")
	if rr := erase.Reset(ctx, k, l, gpu); rr.Err != "" || rr.Methods != "flr bus" {
		t.Fatalf("gpu0: %+v", rr)
	}
	if w := k.Touched(gpu); len(w) != 1 || w[0].Path != pci.DevicesDir+"/"+gpu.String()+"/reset" {
		t.Fatalf("gpu0's reset wrote %v", w)
	}
	for name, want := range map[string]string{
		"nvsw-lpf0": `is nvswitch-mgmt (rule "nvswitch-bridge"): an FLR of an NVSwitch management function resets its NVSwitch`,
		"nvsw-lpf1": "is nvswitch-mgmt",
		"nvsw-fc0":  `is nvswitch-mgmt (rule "nvswitch-bridge-fc")`,
		"mgmt0":     "is mgmt-nic",
		"rp0":       "is switch-port",
		"bcm-usp0":  "is switch-port",
	} {
		a := n.Addr(name)
		rr := erase.Reset(ctx, k, l, a)
		if !strings.HasPrefix(rr.Err, "refused: "+a.String()) || !strings.Contains(rr.Err, want) {
			t.Errorf("%s: %+v, want refused: %q", name, rr, want)
		}
		if w := k.Touched(a); len(w) != 0 {
			t.Errorf("%s refused, yet written: %v", name, w)
		}
	}
	k.ResetWrites()
	if rr := erase.Reset(ctx, k, nil, gpu); !strings.Contains(rr.Err, "no labelling") {
		t.Errorf("without labels: %+v", rr)
	}
	if w := k.Writes(); len(w) != 0 {
		t.Errorf("refused without labels, yet written: %v", w)
	}
}

// TestRunNeverResetsNVSwitchBridge: a unit that holds an NVSwitch bridge PF, as a
// labelling bug or a hand-made unit could, has that reset refused, named in its
// problems, and written nowhere; its own functions are reset.
func TestRunNeverResetsNVSwitchBridge(t *testing.T) {
	n, l, k := bridgeNode(t)
	u := *l.Unit(0)
	lpf := l.Tree.Lookup(n.Addr("nvsw-lpf0"))
	u.NICs = append(append([]*pci.Device{}, u.NICs...), lpf)
	u.NVMe = nil // nothing to erase: this is about the resets
	rep := erase.Run(context.Background(), k, l, []*topology.Unit{&u}, nil, erase.RunOptions{})
	ur := rep.Unit(0)
	if ur == nil || len(ur.Resets) != len(u.Functions()) {
		t.Fatalf("report %+v", ur)
	}
	probs := strings.Join(ur.Problems(), "\n")
	if !strings.Contains(probs, "reset "+lpf.Addr.String()+": refused: ") || !strings.Contains(probs, "nvswitch-mgmt") {
		t.Errorf("problems do not name the refused reset:\n%s", probs)
	}
	if w := k.Touched(lpf.Addr); len(w) != 0 {
		t.Errorf("the bridge's limited PF was written: %v", w)
	}
	for _, f := range u.Functions() {
		if f != lpf && len(k.Touched(f.Addr)) != 1 {
			t.Errorf("%s: writes %v, want its reset", f.Addr, k.Touched(f.Addr))
		}
	}
}
