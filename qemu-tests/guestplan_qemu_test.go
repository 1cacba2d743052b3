//go:build qemu

package qemutest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// guestProfile is the profile that labels a rendered guest plan's emulated stand-ins
// (topology/profiles/qemu-guest.yaml). It goes into the image as a file, so the round
// trip does not depend on the image's passage having it built in.
const guestProfile = "../topology/profiles/qemu-guest.yaml"

// measuredPlan is the part of `passage plan --json` the round trip reads.
type measuredPlan struct {
	Profile  string                        `json:"profile"`
	Units    []topology.UnitJSON           `json:"units"`
	Problems []string                      `json:"problems"`
	Host     measuredMatrix                `json:"host_matrix"`
	Funcs    []struct{ Addr, Role string } `json:"functions"`
}

type measuredMatrix struct {
	Names []string   `json:"names"`
	Addrs []string   `json:"addrs"`
	NUMA  []int      `json:"numa"`
	Cells [][]string `json:"cells"`
}

func (m measuredMatrix) at(a, b string) string {
	i, j := -1, -1
	for k, x := range m.Addrs {
		if x == a {
			i = k
		}
		if x == b {
			j = k
		}
	}
	if i < 0 || j < 0 || i >= len(m.Cells) || j >= len(m.Cells[i]) {
		return ""
	}
	return m.Cells[i][j]
}

// TestGuestPlanRoundTrip is scenario 6: plan a guest for B300 units, render it as QEMU
// arguments with emulated stand-ins in place of vfio-pci, boot the real image on that
// tree, run `passage plan` inside, and hold the distances the guest's own kernel shows
// against the plan's expected guest matrix. Flat: one switch per unit on pcie.0 (GPU-NIC
// PIX, other units PHB). NUMA: one pxb-pcie per unit on guest NUMA nodes standing for
// the host's (other units NODE on one node, SYS across).
func TestGuestPlanRoundTrip(t *testing.T) {
	node := pcitest.New(t, pcitest.B300())
	tree, err := pci.Scan(node.Root)
	if err != nil {
		t.Fatal(err)
	}
	b300, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		units []topology.UnitID
		numa  bool
		// hostNUMA is each unit's host NUMA node, written out from B300.md (GPUs 0-3
		// on socket 0, 4-7 on socket 1), not taken from the code under test.
		hostNUMA map[int]int
	}{
		{"flat", []topology.UnitID{0, 1}, false, map[int]int{0: 0, 1: 0}},
		{"numa", []topology.UnitID{0, 1, 4}, true, map[int]int{0: 0, 1: 0, 4: 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			d, err := decision.Decide(decision.Input{Tree: tree, Profile: b300, Guest: topology.GuestOptions{Units: c.units, NUMA: c.numa}})
			if err != nil {
				t.Fatalf("decide: %v", err)
			}
			if d.LabelErr != nil || d.GuestErr != nil {
				t.Fatalf("plan: label %v, guest %v", d.LabelErr, d.GuestErr)
			}
			pl := d.Plan()
			g := pl.Guest
			var devices []string
			if c.numa {
				// The guest nodes the plan names must exist, memory split between them.
				nodes := len(g.GuestNodes)
				for n := 0; n < nodes; n++ {
					devices = append(devices,
						"-object", fmt.Sprintf("memory-backend-ram,id=mem%d,size=%dM", n, 2048/nodes),
						"-numa", fmt.Sprintf("node,nodeid=%d,cpus=%d,memdev=mem%d", n, n%2, n))
				}
			}
			devices = append(devices, g.QEMUArgs(topology.EmulatedDevice)...)
			_, got := measureGuest(t, guestBoot{Name: "guestplan-" + c.name, Devices: devices})
			for _, u := range got.Units {
				t.Logf("guest unit %s: %s %v", u.ID, u.Status, u.Reasons)
			}
			for _, f := range got.Funcs {
				if f.Role == string(topology.RoleUnlabeled) {
					t.Errorf("guest function %s unlabeled", f.Addr)
				}
			}

			// The guest's units sit where the plan put them.
			if len(got.Units) != len(g.Units) {
				t.Fatalf("guest has %d units, plan %d: %+v", len(got.Units), len(g.Units), got.Units)
			}
			for i, gu := range g.Units {
				var want topology.UnitJSON
				for _, f := range gu.Functions {
					switch f.Role {
					case topology.RoleGPU:
						want.GPU = f.Addr.String()
					case topology.RoleGPUNIC:
						want.NICs = append(want.NICs, f.Addr.String())
					case topology.RoleGPUNVMe:
						want.NVMe = append(want.NVMe, f.Addr.String())
					}
				}
				u := got.Units[i]
				if u.GPU != want.GPU || strings.Join(u.NICs, ",") != strings.Join(want.NICs, ",") || strings.Join(u.NVMe, ",") != strings.Join(want.NVMe, ",") {
					t.Errorf("guest unit %s: gpu %s nics %v nvme %v; plan (host unit %d): gpu %s nics %v nvme %v",
						u.ID, u.GPU, u.NICs, u.NVMe, gu.Unit, want.GPU, want.NICs, want.NVMe)
				}
				if len(want.NICs) != 2 || len(want.NVMe) != 1 {
					t.Errorf("plan unit %d: %d NICs, %d NVMe; B300 has 2 and 1", gu.Unit, len(want.NICs), len(want.NVMe))
				}
				if c.numa && u.NUMANode != gu.GuestNUMA {
					t.Errorf("guest unit %s on NUMA node %d, plan says %d", u.ID, u.NUMANode, gu.GuestNUMA)
				}
			}

			// The measured matrix equals the plan's expected one, cell for cell. The plan's
			// own matrix shows the profile's NVLink between GPUs (NV18 on B300): NVLink is
			// not PCIe, and the stand-ins have none, so GPU pairs compare at PCIe distance.
			exp := g.Matrix(0)
			if strings.Join(got.Host.Names, " ") != strings.Join(exp.Names, " ") {
				t.Errorf("guest matrix names %v, plan %v", got.Host.Names, exp.Names)
			}
			var expAddrs []string
			for _, a := range exp.Addrs {
				expAddrs = append(expAddrs, a.String())
			}
			if strings.Join(got.Host.Addrs, " ") != strings.Join(expAddrs, " ") {
				t.Errorf("guest matrix addresses %v, plan %v", got.Host.Addrs, expAddrs)
			}
			for i, a := range expAddrs {
				for j, b := range expAddrs {
					want := exp.Cells[i][j]
					if w := pl.GuestMatrix.Cells[i][j]; w != want && !(exp.Names[i][:3] == "GPU" && exp.Names[j][:3] == "GPU" && w == "NV18") {
						t.Errorf("plan's guest matrix %s-%s = %s, PCIe-only %s", exp.Names[i], exp.Names[j], w, want)
					}
					if gotC := got.Host.at(a, b); gotC != want {
						t.Errorf("guest %s-%s (%s, %s) = %q, plan %q", exp.Names[i], exp.Names[j], a, b, gotC, want)
					}
				}
			}
			if c.numa && fmt.Sprint(got.Host.NUMA) != fmt.Sprint(exp.NUMA) {
				t.Errorf("guest matrix NUMA %v, plan %v", got.Host.NUMA, exp.NUMA)
			}

			// And what that means, written out by hand: a unit's GPU and NICs PIX, another
			// unit's NICs PHB (flat), NODE on the same host socket or SYS across (NUMA).
			checked := map[string]int{}
			for _, gu := range g.Units {
				for _, f := range gu.Functions {
					if f.Role != topology.RoleGPU && f.Role != topology.RoleGPUNIC {
						continue
					}
					for _, ou := range g.Units {
						for _, o := range ou.Functions {
							if o.Role != topology.RoleGPUNIC || o.Addr == f.Addr {
								continue
							}
							want := topology.PIX
							switch {
							case ou.Unit == gu.Unit:
							case !c.numa:
								want = topology.PHB
							case c.hostNUMA[int(ou.Unit)] == c.hostNUMA[int(gu.Unit)]:
								want = topology.NODE
							default:
								want = topology.SYS
							}
							if gotC := got.Host.at(f.Addr.String(), o.Addr.String()); gotC != want {
								t.Errorf("guest %s (host unit %d %s) - %s (host unit %d NIC) = %q, want %s",
									f.Addr, gu.Unit, f.Role, o.Addr, ou.Unit, gotC, want)
							}
							checked[want]++
						}
					}
				}
			}
			t.Logf("guest matrix as the guest measured it:\n%s", textOf(got.Host))
			t.Logf("checked pairs by expected distance: %v", checked)
			if checked[topology.PIX] != 4*len(g.Units) {
				t.Errorf("checked %d PIX pairs, want %d (GPU-NIC x2, NIC-NIC x2 per unit)", checked[topology.PIX], 4*len(g.Units))
			}
			if c.numa && (checked[topology.NODE] == 0 || checked[topology.SYS] == 0) || !c.numa && checked[topology.PHB] == 0 {
				t.Errorf("the units chosen do not exercise the cross-unit distances: %v", checked)
			}
		})
	}
}

func textOf(m measuredMatrix) string {
	var b strings.Builder
	b.WriteString("\t" + strings.Join(m.Names, "\t") + "\n")
	for i, n := range m.Names {
		if i < len(m.Cells) {
			fmt.Fprintf(&b, "%s\t%s\n", n, strings.Join(m.Cells[i], "\t"))
		}
	}
	return b.String()
}

// guestBoot is a guest that measures itself: the image booted with Devices (a plan's
// emulated stand-ins), `passage plan --json` run inside with the qemu-guest profile, then
// the commands of Then (their output in run-2.out, run-3.out, ...).
type guestBoot struct {
	Name    string
	Devices []string
	Then    []string
	Append  []string      // more of the kernel command line
	Overlay []OverlayFile // more files in the initramfs
	// OVMF and PhysBits boot through UEFI firmware at a guest address width (Options).
	OVMF     bool
	PhysBits int
}

// measureGuest boots gb and returns the run and what plan measured in the guest.
func measureGuest(t *testing.T, gb guestBoot) (*Run, measuredPlan) {
	t.Helper()
	prof, err := os.ReadFile(guestProfile)
	if err != nil {
		t.Fatalf("guest profile: %v", err)
	}
	cmd := "passage plan --profile /etc/passage/qemu-guest.yaml --json"
	timeout := 4 * time.Minute
	if gb.OVMF {
		// OVMF under TCG takes about 100 s before it has enumerated the devices
		// behind the root ports.
		timeout = 9 * time.Minute
	}
	run, err := Boot(context.Background(), Options{
		Build: buildDir(t),
		Name:  gb.Name,
		Overlay: append([]OverlayFile{fakeUinit(t),
			{Name: "etc/passage/qemu-guest.yaml", Data: prof},
			{Name: "etc/fakeuinit/run", Data: []byte(strings.Join(append([]string{cmd}, gb.Then...), "\n") + "\n")}}, gb.Overlay...),
		Devices:  gb.Devices,
		Append:   gb.Append,
		WorkDir:  filepath.Join(t.TempDir(), "work"),
		Timeout:  timeout,
		OVMF:     gb.OVMF,
		PhysBits: gb.PhysBits,
	})
	if run != nil {
		t.Logf("console: %s; wall %v, to PASSAGE-DONE %v\n%s", run.Console, run.Wall, run.WallDone, run.Timeline())
	}
	if err != nil {
		t.Fatal(err)
	}
	if run.Done != "ok" {
		t.Fatalf("PASSAGE-DONE %q, want ok; kmod-error: %s", run.Done, run.Files["kmod-error"])
	}
	t.Logf("guest PCI tree:\n%s", run.Files["pci.txt"])
	out := run.Files["run-1.out"]
	var got measuredPlan
	dec := json.NewDecoder(bytes.NewReader(out))
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("%s: %v\n%s", cmd, err, out)
	}
	// After the JSON: plan's verdict. The guest's switch ports are xio3130-downstream,
	// which has no ACS, so the guest's own ACS plan fails its units; the distances do
	// not depend on that.
	t.Logf("passage plan in the guest, after the JSON: %s", bytes.TrimSpace(out[dec.InputOffset():]))
	if got.Profile != "qemu-guest" {
		t.Fatalf("guest plan profile %q, want qemu-guest", got.Profile)
	}
	return run, got
}
