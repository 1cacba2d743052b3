package recycle_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

var marker = bytes.Repeat([]byte("TENANT-A-SECRET!"), 32)

// node is a B300 node after its boot: every unit on vfio-pci, a signed manifest of
// generation 1, one simulated controller per NVMe holding a tenant's marker.
type node struct {
	pn             *pcitest.Node
	root, dir, gen string
	tree           *pci.Tree
	k              *vfiotest.Kernel
	ctrls          map[pci.Address]*erasetest.Controller
	signer         *manifest.Ed25519Signer
	verifier       manifest.Verifier
}

func newNode(t *testing.T) *node {
	t.Helper()
	return newNodeOf(t, pcitest.B300())
}

// newNodeOf is newNode on another spec.
func newNodeOf(t *testing.T, spec pcitest.Spec) *node {
	t.Helper()
	pn := pcitest.New(t, spec)
	root := pn.Root
	for p, c := range map[string]string{"proc/sys/kernel/random/boot_id": "6f1c2a4e-8d3b-4c7a-9e15-2b7d0f4a9c31\n",
		"proc/sys/kernel/osrelease": "6.12.48\n", "proc/cmdline": "console=ttyS0\n"} {
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Load(vfiobind.Modules...); err != nil {
		t.Fatal(err)
	}
	n := &node{pn: pn, root: root, dir: filepath.Join(root, "run/passage"), tree: tree, k: k, ctrls: map[pci.Address]*erasetest.Controller{}}
	n.gen = filepath.Join(t.TempDir(), "generation")
	for _, d := range tree.Devices {
		dir := filepath.Join(root, pci.DevicesDir, d.Addr.String())
		if err := os.WriteFile(filepath.Join(dir, "reset_method"), []byte("flr\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "reset"), nil, 0o200); err != nil {
			t.Fatal(err)
		}
		if d.Class == pcitest.ClassNVMe {
			c := erasetest.New("S"+d.Addr.String(), erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 20})
			c.Write(1, 0, marker)
			c.Write(1, 1<<20-1, marker)
			n.ctrls[d.Addr] = c
		}
	}
	priv, pub, err := manifest.GenerateKey(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if n.signer, err = manifest.LoadSigner(priv); err != nil {
		t.Fatal(err)
	}
	if n.verifier, err = manifest.LoadVerifier(pub); err != nil {
		t.Fatal(err)
	}
	// The boot: every unit bound, generation 1 says ready.
	lab, err := topology.Label(tree, mustProfile(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vfiobind.Bind(context.Background(), k, tree, lab.Units, vfiobind.Options{}); err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Build(root, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range lab.Units {
		m.Units = append(m.Units, manifest.Unit{ID: u.ID.String(), Status: manifest.StatusReady})
	}
	m.Generation, m.GenerationSource, err = manifest.NextGeneration(manifest.FileCounter{Path: n.gen})
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(n.dir, 0o755)
	if _, err := manifest.WriteSigned(context.Background(), m, n.dir, recycle.EnvelopeName, nil, n.signer); err != nil {
		t.Fatal(err)
	}
	n.tree, _ = pci.Scan(root)
	return n
}

func mustProfile(t *testing.T) *topology.Profile {
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (n *node) opts(units ...topology.UnitID) recycle.Options {
	return recycle.Options{Root: n.root, Profile: "b300", Units: units, Dir: n.dir, Signers: []manifest.Signer{n.signer},
		Verifier: n.verifier, Counters: []manifest.Counter{manifest.FileCounter{Path: n.gen}}, Sysfs: n.k,
		Open: func(_ context.Context, a pci.Address) (erase.Controller, string, error) {
			return n.ctrls[a], "nvme", nil
		},
		Erase: erase.RunOptions{Erase: erase.Options{SanitizeTimeout: time.Second, PollInterval: time.Millisecond, Samples: 8}}}
}

func (n *node) latest(t *testing.T) *manifest.Manifest {
	t.Helper()
	env, err := manifest.ReadEnvelope(filepath.Join(n.dir, recycle.EnvelopeName))
	if err != nil {
		t.Fatal(err)
	}
	v, err := manifest.Verify(env, n.verifier, manifest.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return v.Manifest
}

func unitOf(m *manifest.Manifest, id string) *manifest.Unit {
	for i := range m.Units {
		if m.Units[i].ID == id {
			return &m.Units[i]
		}
	}
	return nil
}

func (n *node) drivers(t *testing.T, id int) []string {
	t.Helper()
	after, err := pci.Scan(n.root)
	if err != nil {
		t.Fatal(err)
	}
	lab, _ := topology.Label(after, mustProfile(t))
	var out []string
	for _, f := range lab.Unit(topology.UnitID(id)).Functions() {
		out = append(out, f.Driver)
	}
	return out
}

// TestRecycle: refused (nothing written) while a process holds the unit's vfio group;
// once it is closed, the unit is erased, reset, back on vfio-pci, and the new manifest
// verifies with a higher generation, the other units carried as they were.
func TestRecycle(t *testing.T) {
	n := newNode(t)
	nvme3 := n.tree.Lookup(n.ctrlAddr(t, 3))
	holder := filepath.Join(n.root, "proc/4242/fd")
	os.MkdirAll(holder, 0o755)
	os.WriteFile(filepath.Join(n.root, "proc/4242/comm"), []byte("qemu-system-x86\n"), 0o644)
	if err := os.Symlink("/dev/vfio/"+strconv.Itoa(nvme3.IOMMUGroup), filepath.Join(holder, "17")); err != nil {
		t.Fatal(err)
	}
	n.k.ResetWrites()
	res, err := recycle.Run(context.Background(), n.opts(3))
	if !errors.Is(err, recycle.ErrHeld) || len(res.Refusal) != 1 || res.Refusal[0].PID != 4242 || !strings.Contains(err.Error(), "qemu-system-x86") {
		t.Fatalf("held: err %v refusal %+v", err, res.Refusal)
	}
	if w := n.k.Writes(); len(w) != 0 {
		t.Errorf("refused, yet %d sysfs writes: %v", len(w), w)
	}
	if g := n.latest(t).Generation; g != 1 {
		t.Errorf("refused, yet the manifest is generation %d", g)
	}
	if n.ctrls[nvme3.Addr].Dirty(1) == 0 {
		t.Error("refused, yet the NVMe was erased")
	}

	os.RemoveAll(filepath.Join(n.root, "proc/4242"))
	res, err = recycle.Run(context.Background(), n.opts(3))
	if err != nil || !res.Completed {
		t.Fatalf("recycle: %v", err)
	}
	if len(res.Verdicts) != 1 || res.Verdicts[0].Status != topology.StatusReady {
		t.Fatalf("verdicts %+v", res.Verdicts)
	}
	if n.ctrls[nvme3.Addr].Dirty(1) != 0 {
		t.Error("the tenant's blocks remain")
	}
	for _, d := range n.drivers(t, 3) {
		if d != vfiobind.VFIODriver {
			t.Errorf("unit 3 function on %q after recycle", d)
		}
	}
	m := n.latest(t)
	if m.Generation != 3 || res.InFlight != 2 || res.Final != 3 {
		t.Errorf("generations: in flight %d, final %d, on disk %d; want 2, 3, 3", res.InFlight, res.Final, m.Generation)
	}
	u3 := unitOf(m, "gpu3")
	if u3 == nil || u3.Status != manifest.StatusReady || u3.Erase == nil || u3.Erase.NVMe[0].Method != string(erase.SanitizeBlock) || len(u3.Erase.Resets) != 4 {
		t.Errorf("gpu3 record %+v", u3)
	}
	// The record is the boot's (package record): what the hypervisor renders from a
	// recycled unit is what it rendered from the boot's.
	if u3 != nil {
		if u3.UpLink.Speed == "" || len(u3.ACSChanges) == 0 || len(u3.ATSFindings) == 0 {
			t.Errorf("gpu3 record lacks the uplink, ACS or ATS the boot records: %+v", u3)
		}
		for _, f := range u3.Functions {
			if f.Link.Speed == "" || f.DriverAfter != vfiobind.VFIODriver {
				t.Errorf("gpu3 function %s: link %+v, driver after %q", f.BDF, f.Link, f.DriverAfter)
			}
		}
	}
	if u := unitOf(m, "gpu0"); u == nil || u.Status != manifest.StatusReady || u.Erase != nil {
		t.Errorf("gpu0 not carried as it was: %+v", u)
	}
	if n.ctrls[n.ctrlAddr(t, 0)].Dirty(1) == 0 {
		t.Error("unit 0 was not asked for, yet erased")
	}
}

// TestRecycleCrashMidway: a crash after release (before the erase, or before the bind)
// leaves the unit off vfio-pci and the latest signed generation saying it is not ready.
func TestRecycleCrashMidway(t *testing.T) {
	for _, step := range []string{"erase", "bind"} {
		t.Run(step, func(t *testing.T) {
			n := newNode(t)
			o := n.opts(5)
			crash := errors.New("power lost")
			o.Crash = func(s string) error {
				if s == step {
					return crash
				}
				return nil
			}
			_, err := recycle.Run(context.Background(), o)
			if !errors.Is(err, crash) {
				t.Fatalf("err %v", err)
			}
			for _, d := range n.drivers(t, 5) {
				if d == vfiobind.VFIODriver {
					t.Errorf("a unit 5 function is on vfio-pci after a crash at %s", step)
				}
			}
			m := n.latest(t)
			u := unitOf(m, "gpu5")
			if m.Generation != 2 || u == nil || u.Status != manifest.StatusFailed || !strings.Contains(strings.Join(u.Reasons, ";"), "recycle: in progress") {
				t.Errorf("latest generation %d, gpu5 %+v: want 2, failed, recycle in progress", m.Generation, u)
			}
		})
	}
}

func (n *node) ctrlAddr(t *testing.T, id int) pci.Address {
	lab, err := topology.Label(n.tree, mustProfile(t))
	if err != nil {
		t.Fatal(err)
	}
	return lab.Unit(topology.UnitID(id)).NVMe[0].Addr
}

// TestRecycleShowsEraseProgress: a recycle's erase says on its log, every tick, which NVMe
// is at which step, with the controller's SPROG while it sanitizes.
func TestRecycleShowsEraseProgress(t *testing.T) {
	n := newNode(t)
	a := n.ctrlAddr(t, 3)
	n.ctrls[a].Faults.SanitizeTime = 300 * time.Millisecond
	var log bytes.Buffer
	o := n.opts(3)
	o.Log, o.Tick = &log, 20*time.Millisecond
	o.Erase.Erase.PollInterval = 10 * time.Millisecond
	if res, err := recycle.Run(context.Background(), o); err != nil || !res.Completed {
		t.Fatalf("recycle: %v", err)
	}
	re := regexp.MustCompile(`(?m)^erasing \([0-9]+s\): ` + regexp.QuoteMeta(a.String()) + ` sanitize-block-erase ([0-9]+)% \(SPROG [0-9]+/65536\)$`)
	ms := re.FindAllStringSubmatch(log.String(), -1)
	if len(ms) < 2 {
		t.Fatalf("%d progress lines for %s; the log:\n%s", len(ms), a, log.String())
	}
	first, _ := strconv.Atoi(ms[0][1])
	last, _ := strconv.Atoi(ms[len(ms)-1][1])
	if last <= first {
		t.Errorf("progress from %d%% to %d%%, want it growing; the log:\n%s", first, last, log.String())
	}
}
