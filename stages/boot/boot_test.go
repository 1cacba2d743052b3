package boot

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/topology"
)

func run(t *testing.T, b *Boot, names ...string) ([]stages.Result, *stages.State) {
	t.Helper()
	var list []stages.Stage
	for _, s := range b.Stages() {
		for _, n := range names {
			if s.Name == n {
				list = append(list, s)
			}
		}
	}
	st := &stages.State{}
	rs, err := (&stages.Runner{Stages: list}).Run(context.Background(), st)
	if err != nil {
		t.Fatal(err)
	}
	return rs, st
}

// portsAbove plans SV+RR+CR+UF+DT on the first bridge above each unit's first NIC that has
// ACS: enough to exercise the apply path without topology's real plan.
func portsAbove(tree *pci.Tree, units []*topology.Unit) ([]topology.ACSPort, error) {
	var out []topology.ACSPort
	for _, u := range units {
		for _, br := range u.NICs[0].Ancestors() {
			if br.ACS == nil {
				continue
			}
			out = append(out, topology.ACSPort{Addr: br.Addr, Unit: u.ID, Position: "nic-port", Offset: br.ACS.Offset,
				Cap: br.ACS.Cap, Current: br.ACS.Ctl, Mask: pci.ACSIsolation | pci.ACSDT, Flags: (pci.ACSIsolation | pci.ACSDT) & br.ACS.Cap})
			break
		}
	}
	return out, nil
}

func TestACSAppliesAndSkipsFailedUnits(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.profile=b300"), Domain: Domain{ACSPlan: portsAbove}}
	// A unit failed before acs is left alone: mark gpu3 failed from a stage in between.
	list := b.Stages()
	fail3 := stages.Stage{Name: "fail3", Needs: []string{"label"}, Run: func(_ context.Context, st *stages.State, _ *stages.Result) error {
		b.Units[3].Degrade(topology.StatusFailed, "test: broken")
		b.syncUnits(st, "fail3")
		return nil
	}}
	var sel []stages.Stage
	for _, s := range list {
		switch s.Name {
		case "scan", "label", "firmware":
			sel = append(sel, s)
		case "acs":
			sel = append(sel, fail3, s)
		}
	}
	st := &stages.State{}
	rs, err := (&stages.Runner{Stages: sel}).Run(context.Background(), st)
	if err != nil {
		t.Fatal(err)
	}
	acs := rs[len(rs)-1]
	if acs.Status != stages.OK {
		t.Fatalf("acs %s: %v %v", acs.Status, acs.Err, acs.Findings)
	}
	if len(b.ACS) != 8 {
		t.Fatalf("ACS changes for %d units", len(b.ACS))
	}
	applied := 0
	for id, chs := range b.ACS {
		for _, ch := range chs {
			switch {
			case id == 3 && ch.Result != "unchanged: unit failed":
				t.Errorf("failed unit's port %s: %s", ch.Port, ch.Result)
			case ch.Result == "applied":
				applied++
				if !strings.Contains(ch.After, "DirectTrans+") {
					t.Errorf("port %s after = %q", ch.Port, ch.After)
				}
			}
		}
	}
	if len(acs.Changes) != applied || applied == 0 {
		t.Errorf("%d changes recorded, %d applied", len(acs.Changes), applied)
	}
	// The write reached the synthetic config space: a fresh scan reads DT back.
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	port := b.ACS[0][0].Port
	d := tree.Lookup(pci.MustParseAddress(port))
	if d == nil || d.ACS == nil || d.ACS.Ctl&pci.ACSDT == 0 {
		t.Errorf("port %s: DT not set on disk", port)
	}
	if u := st.Units()[3]; u.Status != stages.Failed {
		t.Errorf("gpu3 = %+v", u)
	}
}

func TestACSPermissionAdvice(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	b := &Boot{Root: root, Config: initramfs.ParseCmdline(""), Domain: Domain{ACSPlan: portsAbove}}
	// Lockdown refuses config writes: make one port's config file read-only.
	rs, _ := run(t, b, "scan", "label")
	if rs[1].Status != stages.OK {
		t.Fatal(rs[1].Err)
	}
	ports, _ := portsAbove(b.Tree, b.Units)
	cfg := filepath.Join(root, "sys/bus/pci/devices", ports[0].Addr.String(), "config")
	if err := os.Chmod(cfg, 0o444); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		// root ignores file modes; an unwritable parent is the portable way to get EPERM
		// here, and pcitest's files are regular files, so use a plan pointing past EOF.
		t.Log("running as root: simulating refusal with a plan outside config space")
		b.Domain.ACSPlan = func(tree *pci.Tree, units []*topology.Unit) ([]topology.ACSPort, error) {
			p, _ := portsAbove(tree, units)
			p[0].Offset = 1 << 20
			return p[:1], nil
		}
	}
	st := &stages.State{}
	st.SetUnits(nil)
	var r stages.Result
	if err := b.acs(context.Background(), st, &r); err != nil {
		t.Fatal(err)
	}
	if r.Status != stages.Degraded {
		t.Fatalf("acs status %q findings %v", r.Status, r.Findings)
	}
	if b.Units[0].Status != topology.StatusDegraded {
		t.Errorf("unit 0 = %s %v", b.Units[0].Status, b.Units[0].Reasons)
	}
	if os.Geteuid() != 0 && !strings.Contains(strings.Join(b.Units[0].Reasons, " "), "pci=config_acs=") {
		t.Errorf("no advice in %v", b.Units[0].Reasons)
	}
}

func TestManifestGenerationOnOut(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	for p, c := range map[string]string{
		"proc/sys/kernel/random/boot_id": "b00710",
		"proc/cmdline":                   "passage.out=/dev/vda1:/passage",
	} {
		os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(root, p), []byte(c), 0o644)
	}
	keyDir := filepath.Join(root, "etc/passage")
	os.MkdirAll(keyDir, 0o755)
	if _, _, err := manifest.GenerateKey(keyDir); err != nil {
		t.Fatal(err)
	}
	disk := t.TempDir() // stands for the filesystem on /dev/vda1
	var mounts []string
	for gen := uint64(1); gen <= 2; gen++ {
		cfg := initramfs.ParseCmdline("passage.out=/dev/vda1:/passage passage.key=/etc/passage/passage.key passage.tpm=auto")
		b := &Boot{Root: root, Config: cfg, Mount: func(dev, dir string) (func() error, error) {
			mounts = append(mounts, dev)
			if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
				return nil, err
			}
			os.Remove(dir)
			if err := os.Symlink(disk, dir); err != nil {
				return nil, err
			}
			return func() error { return os.Remove(dir) }, nil
		}}
		rs, _ := run(t, b, "scan", "label", "manifest")
		mr := rs[2]
		if mr.Status != stages.OK {
			t.Fatalf("boot %d: manifest %s %v %v", gen, mr.Status, mr.Err, mr.Findings)
		}
		if b.Manifest.Generation != gen || b.Manifest.GenerationSource != manifest.GenerationFile {
			t.Errorf("boot %d: generation %d (%s)", gen, b.Manifest.Generation, b.Manifest.GenerationSource)
		}
		// TPM auto without a TPM falls back to the key file and says why.
		if !strings.Contains(strings.Join(mr.Findings, " "), "tpm") {
			t.Errorf("findings %v", mr.Findings)
		}
		if _, err := os.Stat(filepath.Join(disk, "passage", EnvelopeName)); err != nil {
			t.Errorf("boot %d: envelope not copied to passage.out: %v", gen, err)
		}
	}
	if len(mounts) != 2 || mounts[0] != filepath.Join(root, "dev/vda1") {
		t.Errorf("mounts = %v", mounts)
	}
}

func TestManifestWithoutKeyIsWrittenUnsigned(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.tpm=off")}
	rs, _ := run(t, b, "manifest")
	if rs[0].Status != stages.Failed || !strings.Contains(rs[0].Err.Error(), "unsigned") {
		t.Fatalf("manifest %s %v", rs[0].Status, rs[0].Err)
	}
	if _, err := os.Stat(filepath.Join(root, "run/passage", PayloadName)); err != nil {
		t.Errorf("payload not written: %v", err)
	}
	// No boot id in this tree: the manifest says so rather than not existing.
	if len(b.Manifest.Errors) == 0 || !strings.Contains(b.Manifest.Errors[0], "boot id") {
		t.Errorf("errors %v", b.Manifest.Errors)
	}
	if errors.Is(rs[0].Err, os.ErrNotExist) == false {
		t.Errorf("err %v does not wrap the missing key", rs[0].Err)
	}
}
