package boot

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/attest/verifiertest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/record"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
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

// lockedDown refuses config writes as the kernel does under lockdown=integrity
// (pci_write_config: EPERM); reads go to the tree.
type lockedDown struct{ pci.SysfsConfig }

func (lockedDown) WriteConfig(pci.Address, int64, []byte) error { return syscall.EPERM }

// noWrites fails the test on any config write; reads go to the tree.
type noWrites struct {
	pci.SysfsConfig
	t *testing.T
}

func (n noWrites) WriteConfig(a pci.Address, off int64, _ []byte) error {
	n.t.Errorf("config write to %s at %#x", a, off)
	return syscall.EPERM
}

// TestACSLockdownAdvice: config writes refused, whether the kernel's lockdown file says
// so beforehand (the decision foresees it and writes nothing) or only the write's EPERM
// does: DT is lost, the isolation the kernel already set stays, so every unit ends
// degraded, bound, with the advice naming pci=config_acs= and the running kernel.
func TestACSLockdownAdvice(t *testing.T) {
	for _, tc := range []struct {
		name     string
		lockdown string // the lockdown file; "" for none
		foreseen bool   // the decision knew before the acs stage
	}{
		{name: "write refused", foreseen: false},
		{name: "lockdown file", lockdown: "none [integrity] confidentiality\n", foreseen: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bn := newBootNode(t)
			root := bn.node.Root
			files := map[string]string{"proc/sys/kernel/osrelease": "6.1.0-57-amd64\n"}
			var cfg pci.ConfigIO = lockedDown{pci.SysfsConfig{Root: root}}
			if tc.lockdown != "" {
				files["sys/kernel/security/lockdown"] = tc.lockdown
				cfg = noWrites{pci.SysfsConfig{Root: root}, t}
			}
			for p, c := range files {
				if err := os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			b := bn.boot("passage.profile=b300 passage.tpm=off passage.key=/etc/passage/passage.key")
			b.ConfigIO = cfg
			rs, st := run(t, b, "scan", "decide", "acs", "vfio", "manifest")
			decide, acs, vfio, mr := rs[1], rs[2], rs[3], rs[4]
			if said := slices.Contains(decide.Findings, "kernel lockdown integrity: config writes are refused; ports are read back, not written"); said != tc.foreseen {
				t.Errorf("decide %s %q: lockdown foreseen %v, want %v", decide.Status, decide.Findings, said, tc.foreseen)
			}
			if acs.Status != stages.Degraded {
				t.Fatalf("acs %s %v %v", acs.Status, acs.Err, acs.Findings)
			}
			if mr.Status != stages.OK {
				t.Fatalf("manifest %s %v %v", mr.Status, mr.Err, mr.Findings)
			}
			// Lockdown refuses config writes, not binding: every degraded unit is on vfio-pci.
			if vfio.Status != stages.OK || b.Bind == nil {
				t.Fatalf("vfio %s %v %v", vfio.Status, vfio.Err, vfio.Findings)
			}
			bound := 0
			for _, u := range b.Bind.Units {
				if !u.Bound() {
					t.Errorf("unit %d not bound: %s", u.ID, u.Error)
				}
				for _, f := range u.Functions {
					if f.DriverAfter != "vfio-pci" {
						t.Errorf("%s: driver %q after binding under lockdown", f.Addr, f.DriverAfter)
					}
					bound++
				}
			}
			if len(b.Bind.Units) != 8 || bound < 8*4 {
				t.Errorf("%d units, %d functions bound, want every unit's", len(b.Bind.Units), bound)
			}
			// The kernel's default leaves SV RR CR UF set: refusing DT only degrades. The
			// verdicts, the manifest and the runner's state say the same.
			advised := func(why string) bool {
				return strings.Contains(why, "pci=config_acs=") && strings.Contains(why, "6.11") && strings.Contains(why, "6.1.0-57-amd64")
			}
			if len(b.Verdicts) != 8 {
				t.Fatalf("%d verdicts, want 8", len(b.Verdicts))
			}
			for _, v := range b.Verdicts {
				if why := strings.Join(v.Reasons, "; "); v.Status != topology.StatusDegraded || !advised(why) {
					t.Errorf("verdict of unit %d: %s %q", v.Unit, v.Status, why)
				}
			}
			if len(b.Manifest.Units) != 8 {
				t.Fatalf("%d units in the manifest, want 8", len(b.Manifest.Units))
			}
			for _, u := range b.Manifest.Units {
				if why := strings.Join(u.Reasons, "; "); u.Status != string(topology.StatusDegraded) || !advised(why) {
					t.Errorf("manifest unit %s: %s %q", u.ID, u.Status, why)
				}
				locked := 0
				for _, ch := range u.ACSChanges {
					if strings.HasPrefix(ch.Result, "locked down: ") {
						locked++
						if strings.Contains(ch.After, "DirectTrans+") {
							t.Errorf("port %s reads DT after a refused write", ch.Port)
						}
					}
				}
				if locked != 1 {
					t.Errorf("unit %s: %d locked-down ports, want its NIC port: %+v", u.ID, locked, u.ACSChanges)
				}
			}
			for _, u := range st.Units() {
				if why := strings.Join(u.Reasons, "; "); u.Status != stages.Degraded || !advised(why) {
					t.Errorf("unit %s: %s %q", u.ID, u.Status, why)
				}
			}
			locked := 0
			for _, c := range b.ACSRun.Changes {
				if c.Result == apply.ResultLockedDown {
					locked++
					if c.Position != topology.PosNICPort {
						t.Errorf("locked-down %s %s: only the NIC ports need a write", c.Position, c.Addr)
					}
				}
			}
			if locked != 8 {
				t.Errorf("%d locked-down ports, want one NIC port per unit (8)", locked)
			}
			// Nothing reached the tree.
			tree, err := pci.Scan(root)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range b.Decision.ACS {
				if d := tree.Lookup(p.Addr); d == nil || d.ACS == nil || d.ACS.Ctl != p.Current {
					t.Errorf("port %s changed under lockdown", p.Addr)
				}
			}
		})
	}
}

// TestACSAppliesAndSkipsFailedUnits: the acs stage writes the decision's plan and leaves
// the ports of a unit the decision failed as they are; vfio leaves that unit unbound.
func TestACSAppliesAndSkipsFailedUnits(t *testing.T) {
	spec := pcitest.B300()
	// A NIC PF without ATS under passage.ats=require: the decision fails gpu3 before
	// anything is written.
	spec.Fn("nic3.1").ATS = nil
	node := pcitest.New(t, spec)
	root := node.Root
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Load("vfio-pci"); err != nil {
		t.Fatal(err)
	}
	before, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.ats=require"), Sysfs: k}
	rs, st := run(t, b, "scan", "decide", "acs", "vfio")
	decide, acs, vfio := rs[1], rs[2], rs[3]
	if decide.Status != stages.Degraded || !strings.Contains(strings.Join(decide.Findings, "\n"), node.Addr("nic3.1").String()) {
		t.Errorf("decide %s %v %q, want degraded naming nic3.1", decide.Status, decide.Err, decide.Findings)
	}
	// The runner's state holds the decided statuses: gpu3 failed, for the ATS policy.
	for _, u := range st.Units() {
		if failed := u.Status == stages.Failed; failed != (u.ID == "gpu3") {
			t.Errorf("unit %s after decide: %s %q", u.ID, u.Status, u.Reasons)
		}
		if u.ID == "gpu3" && !strings.Contains(strings.Join(u.Reasons, "; "), "passage.ats=require") {
			t.Errorf("gpu3 reasons %q, want the ATS policy", u.Reasons)
		}
	}
	if acs.Status != stages.OK {
		t.Fatalf("acs %s: %v %v", acs.Status, acs.Err, acs.Findings)
	}
	if b.ACSRun == nil {
		t.Fatal("the acs stage completed and committed no report")
	}
	perUnit := map[int]int{}
	applied, nicPorts := 0, 0
	for _, c := range b.ACSRun.Changes {
		perUnit[int(c.Unit)]++
		if c.Unit == 3 {
			if c.Result != apply.ResultSkipped || !strings.HasPrefix(c.Note, "unit failed") {
				t.Errorf("failed unit's port %s: %s (%s)", c.Addr, c.Result, c.Note)
			}
			if r := record.ACSChange(c).Result; !strings.HasPrefix(r, "skipped (unit failed") {
				t.Errorf("failed unit's port %s in the manifest: %q", c.Addr, r)
			}
			continue
		}
		switch c.Result {
		case apply.ResultApplied:
			applied++
		case apply.ResultUnchanged:
		default:
			t.Errorf("port %s: %s", c.Addr, record.ACSResult(c))
		}
		if c.After != c.Target {
			t.Errorf("port %s reads %#04x, target %#04x", c.Addr, uint16(c.After), uint16(c.Target))
		}
		if c.Position == topology.PosNICPort {
			nicPorts++
			if c.Target&pci.ACSDT == 0 {
				t.Errorf("NIC port %s target %s", c.Addr, c.Target.Lspci())
			}
		}
	}
	if len(perUnit) != 8 {
		t.Errorf("ACS changes for %d units, want 8", len(perUnit))
	}
	if nicPorts != 7 || applied < nicPorts {
		t.Errorf("%d writes for %d NIC ports of the 7 units passed through", applied, nicPorts)
	}
	if len(acs.Changes) != applied {
		t.Errorf("%d changes recorded, %d applied", len(acs.Changes), applied)
	}
	// The writes reached the synthetic config space: a fresh scan reads every port of the
	// units passed through at its target (DT on their NIC ports), and every port of gpu3
	// as it was before the boot.
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range b.Decision.ACS {
		d, was := tree.Lookup(p.Addr), before.Lookup(p.Addr)
		if d == nil || d.ACS == nil || was == nil || was.ACS == nil {
			t.Errorf("port %s: no ACS in the scans", p.Addr)
			continue
		}
		want := p.Target()
		if p.Unit == 3 {
			want = was.ACS.Ctl
			if d.ACS.Ctl&pci.ACSDT != 0 {
				t.Errorf("gpu3's %s %s has DT", p.Position, p.Addr)
			}
		}
		if d.ACS.Ctl != want {
			t.Errorf("unit %d %s %s: ACSCtl %#04x on disk, want %#04x", p.Unit, p.Position, p.Addr, uint16(d.ACS.Ctl), uint16(want))
		}
	}
	// vfio binds the other seven units and leaves gpu3's functions on their drivers.
	if vfio.Status != stages.OK || !slices.Contains(vfio.Findings, "unit gpu3: not to be bound (failed), left untouched") {
		t.Errorf("vfio %s %v %q", vfio.Status, vfio.Err, vfio.Findings)
	}
	if b.Bind == nil || b.Bind.Unit(3) != nil || len(b.Bind.Units) != 7 {
		t.Fatalf("bind report %+v, want the seven units other than gpu3", b.Bind)
	}
	for _, u := range b.Units() {
		if u.ID != 3 {
			continue
		}
		for _, f := range u.Functions() {
			if f != nil && len(k.Touched(f.Addr)) > 0 {
				t.Errorf("gpu3's %s touched: %v", f.Addr, k.Touched(f.Addr))
			}
		}
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
		cfg := initramfs.ParseCmdline("passage.erase=off passage.out=/dev/vda1:/passage passage.key=/etc/passage/passage.key passage.tpm=auto")
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
		rs, _ := run(t, b, "scan", "decide", "manifest")
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
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.erase=off passage.tpm=off")}
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

// signingNode is a B300 tree with a boot id and a key file at /etc/passage/passage.key;
// it returns the root and the key file's verifier.
func signingNode(t *testing.T) (string, *manifest.PublicKeyVerifier) {
	t.Helper()
	root := pcitest.New(t, pcitest.B300()).Root
	os.MkdirAll(filepath.Join(root, "proc/sys/kernel/random"), 0o755)
	os.WriteFile(filepath.Join(root, "proc/sys/kernel/random/boot_id"), []byte("b0071d\n"), 0o644)
	keyDir := filepath.Join(root, "etc/passage")
	os.MkdirAll(keyDir, 0o755)
	_, pub, err := manifest.GenerateKey(keyDir)
	if err != nil {
		t.Fatal(err)
	}
	edv, err := manifest.LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	return root, edv
}

// mutedTPM is a TPM key that stops answering when asked to sign.
type mutedTPM struct{}

func (mutedTPM) Sign(context.Context, []byte) ([]byte, error) { return nil, errors.New("tpm: timeout") }
func (mutedTPM) KeyID() (string, error)                       { return "SHA256:tpm", nil }

// TestManifestOneSignerFails: the TPM key fails to sign, the key file signs: one envelope
// with the key file's signature, written once, and the stage degraded naming the TPM key
// (passage.tpm=auto) or failed (passage.tpm=on: the TPM's signature was required).
func TestManifestOneSignerFails(t *testing.T) {
	for _, tc := range []struct {
		tpm  string
		want stages.Status
	}{{"auto", stages.Degraded}, {"on", stages.Failed}} {
		root, edv := signingNode(t)
		b := &Boot{Root: root, OpenTPM: func(string) (manifest.Signer, manifest.Measurer, error) { return mutedTPM{}, nil, nil },
			Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=" + tc.tpm + " passage.key=/etc/passage/passage.key")}
		rs, _ := run(t, b, "scan", "decide", "manifest")
		mr := rs[2]
		named := strings.Contains(fmt.Sprint(mr.Err, mr.Findings), "SHA256:tpm") && strings.Contains(fmt.Sprint(mr.Err, mr.Findings), "tpm: timeout")
		if mr.Status != tc.want || !named {
			t.Fatalf("passage.tpm=%s: manifest %s %v %q, want %s naming the TPM key", tc.tpm, mr.Status, mr.Err, mr.Findings, tc.want)
		}
		env, err := os.ReadFile(filepath.Join(root, "run/passage", EnvelopeName))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := manifest.Verify(env, edv, manifest.VerifyOptions{}); err != nil {
			t.Errorf("passage.tpm=%s: the key file's signature: %v", tc.tpm, err)
		}
		if b.Signed == nil || len(b.Signed.KeyIDs) != 1 {
			t.Errorf("passage.tpm=%s: signed %+v, want one signature", tc.tpm, b.Signed)
		}
	}
}

// keepOpen lets the boot close its TPM handle without powering off the simulator, which
// the test reads afterwards as a verifier would.
type keepOpen struct{ io.ReadWriter }

func (keepOpen) Close() error { return nil }

// TestManifestTPM: with a TPM the envelope carries the TPM key's signature and the key
// file's, the generation comes from the NV counter, and PCR 13 equals the replay of the
// event log beside the manifest.
func TestManifestTPM(t *testing.T) {
	sim, err := simulator.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	open := func(string) (manifest.Signer, manifest.Measurer, error) {
		k, err := tpmkey.New(transport.FromReadWriteCloser(keepOpen{sim}))
		if err != nil {
			return nil, nil, err
		}
		return k, k, nil
	}
	root, edv := signingNode(t)
	var gens []uint64
	for boot := 0; boot < 2; boot++ {
		b := &Boot{Root: root, OpenTPM: open,
			Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key")}
		rs, _ := run(t, b, "scan", "decide", "manifest")
		if mr := rs[2]; mr.Status != stages.OK {
			t.Fatalf("boot %d: manifest %s %v %v", boot, mr.Status, mr.Err, mr.Findings)
		}
		env, err := os.ReadFile(filepath.Join(root, "run/passage", EnvelopeName))
		if err != nil {
			t.Fatal(err)
		}
		k, err := tpmkey.New(transport.FromReadWriteCloser(keepOpen{sim}))
		if err != nil {
			t.Fatal(err)
		}
		tv, err := manifest.NewVerifier(k.Public())
		if err != nil {
			t.Fatal(err)
		}
		for name, v := range map[string]manifest.Verifier{"tpm": tv, "ed25519": edv} {
			ver, err := manifest.Verify(env, v, manifest.VerifyOptions{})
			if err != nil {
				t.Fatalf("boot %d: verify with the %s key: %v", boot, name, err)
			}
			if ver.Manifest.GenerationSource != manifest.GenerationTPMNV {
				t.Errorf("boot %d: generation source %s", boot, ver.Manifest.GenerationSource)
			}
			if name == "tpm" {
				gens = append(gens, ver.Manifest.Generation)
			}
		}
		log, err := manifest.ReadEventLog(filepath.Join(root, "run/passage", EnvelopeName+manifest.EventLogSuffix))
		if err != nil {
			t.Fatal(err)
		}
		if n := len(log.Events); n != boot+1 || log.Events[n-1].PayloadDigest != b.Signed.Digest {
			t.Fatalf("boot %d: event log %+v, want the manifest %s last", boot, log.Events, b.Signed.Digest)
		}
		want, err := log.Replay()
		if err != nil {
			t.Fatal(err)
		}
		got, err := k.ReadPCR("sha256")
		if err != nil {
			t.Fatal(err)
		}
		if hex.EncodeToString(got) != want["sha256"] {
			t.Errorf("boot %d: PCR %d = %x, replay %s", boot, tpmkey.PCR, got, want["sha256"])
		}
		k.Close()
	}
	if gens[1] <= gens[0] {
		t.Errorf("generations %v, want an increase", gens)
	}
}

func TestManifestTPMOnWithoutTPM(t *testing.T) {
	root, _ := signingNode(t) // a boot id: Sign refuses a manifest that names no node
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.erase=off passage.tpm=on passage.key=/etc/passage/passage.key")}
	rs, _ := run(t, b, "manifest")
	if rs[0].Status != stages.Failed || !strings.Contains(rs[0].Err.Error(), "passage.tpm=on") {
		t.Fatalf("manifest %s %v", rs[0].Status, rs[0].Err)
	}
	// Still signed with the key file, generation flagged as unordered.
	if b.Signed == nil || b.Manifest.GenerationSource != manifest.GenerationNone || b.Manifest.Generation != 0 {
		t.Errorf("signed %v, generation %d (%s)", b.Signed != nil, b.Manifest.Generation, b.Manifest.GenerationSource)
	}
}

// TestManifestContent: the manifest carries every unit's verdict, links, the ACS changes
// in apply's words, ATS findings, the drivers after binding, the guest plan with both
// matrices, and every earlier stage.
func TestManifestContent(t *testing.T) {
	bn := newBootNode(t)
	b := bn.boot("passage.profile=b300 passage.tpm=off passage.key=/etc/passage/passage.key passage.bogus=1")
	rs, st := run(t, b, "scan", "decide", "acs", "vfio", "manifest")
	if mr := rs[4]; mr.Status != stages.OK {
		t.Fatalf("manifest %s %v %v", mr.Status, mr.Err, mr.Findings)
	}
	m := b.Manifest
	if !strings.HasPrefix(m.Profile.Digest, "sha256:") || len(m.Errors) != 1 || !strings.Contains(m.Errors[0], "passage.bogus") {
		t.Errorf("profile %+v errors %q", m.Profile, m.Errors)
	}
	if len(m.Units) != 8 || len(b.Verdicts) != 8 {
		t.Fatalf("%d units in the manifest, %d verdicts, want 8", len(m.Units), len(b.Verdicts))
	}
	state := st.Units()
	applied := 0
	for i, u := range m.Units {
		// The reference node has nothing wrong: every unit ready, in the verdicts, the
		// manifest and the runner's state alike.
		if v := b.Verdicts[i]; UnitID(v.Unit) != u.ID || v.Status != topology.StatusReady || u.Status != string(topology.StatusReady) ||
			len(u.Reasons) != 0 || state[i].ID != u.ID || state[i].Status != stages.OK {
			t.Errorf("unit %s: manifest %s %q, verdict %+v, state %+v", u.ID, u.Status, u.Reasons, v, state[i])
		}
		if len(u.ACSChanges) == 0 || len(u.ATSFindings) != 2 {
			t.Errorf("unit %s: %d ACS changes, %d ATS findings", u.ID, len(u.ACSChanges), len(u.ATSFindings))
		}
		for _, ch := range u.ACSChanges {
			if ch.Result == "applied" {
				applied++
			}
			if ch.Result != "applied" && ch.Result != "unchanged" || ch.After != ch.Target || ch.Before == "" {
				t.Errorf("unit %s: ACS change %+v", u.ID, ch)
			}
			if _, err := pci.ParseAddress(ch.Port); err != nil {
				t.Errorf("unit %s: ACS change port %q: %v", u.ID, ch.Port, err)
			}
		}
		for _, f := range u.Functions {
			if f.Link.Speed == "" || f.Link.Speed == "unknown" || f.Link.MaxWidth == 0 {
				t.Errorf("%s (%s): link %+v", f.BDF, f.Role, f.Link)
			}
			if f.DriverAfter != "vfio-pci" || f.DriverBefore == "" || f.DriverBefore == "vfio-pci" {
				t.Errorf("%s (%s): driver %q -> %q", f.BDF, f.Role, f.DriverBefore, f.DriverAfter)
			}
		}
	}
	// DT on the NIC port of each of the eight units at least.
	if applied < 8 {
		t.Errorf("%d ACS changes applied, want at least the 8 NIC ports", applied)
	}
	g := m.GuestPlan
	if g == nil {
		t.Fatal("no guest plan")
	}
	n := len(g.MatrixLabels)
	if n != 8+16 || len(g.HostMatrix) != n || len(g.ExpectedGuest) != n || len(g.Plan) == 0 {
		t.Fatalf("guest plan: %d labels, host %d rows, guest %d rows, plan %d bytes", n, len(g.HostMatrix), len(g.ExpectedGuest), len(g.Plan))
	}
	// GPU0 and its first NIC (NIC0) share the unit's switch in the guest: PIX.
	if c := g.ExpectedGuest[0][8]; c != "PIX" {
		t.Errorf("guest GPU0-NIC0 = %s, want PIX", c)
	}
	var names []string
	for _, s := range m.Stages {
		names = append(names, s.Name)
	}
	if strings.Join(names, " ") != "scan decide acs vfio" {
		t.Errorf("stages %v", names)
	}
}

// TestStartTPMAhead: StartTPM opens the TPM and advances its counter before the manifest
// stage runs, once; the manifest stage uses that key and that generation.
func TestStartTPMAhead(t *testing.T) {
	sim, err := simulator.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	root, _ := signingNode(t)
	opened := make(chan struct{}, 4)
	opens := 0
	open := func(string) (manifest.Signer, manifest.Measurer, error) {
		opens++
		defer func() { opened <- struct{}{} }()
		k, err := tpmkey.New(transport.FromReadWriteCloser(keepOpen{sim}))
		if err != nil {
			return nil, nil, err
		}
		return k, k, nil
	}
	var gens []uint64
	for boot := 0; boot < 2; boot++ {
		b := &Boot{Root: root, OpenTPM: open,
			Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key")}
		b.StartTPM()
		select {
		case <-opened:
		case <-time.After(30 * time.Second):
			t.Fatal("StartTPM did not open the TPM")
		}
		rs, _ := run(t, b, "scan", "decide", "manifest")
		if mr := rs[2]; mr.Status != stages.OK {
			t.Fatalf("boot %d: manifest %s %v %v", boot, mr.Status, mr.Err, mr.Findings)
		}
		if opens != boot+1 {
			t.Errorf("boot %d: TPM opened %d times in all, want once per boot", boot, opens)
		}
		if b.Manifest.GenerationSource != manifest.GenerationTPMNV || len(b.Signed.KeyIDs) != 2 {
			t.Errorf("boot %d: generation from %s, signed by %q", boot, b.Manifest.GenerationSource, b.Signed.KeyIDs)
		}
		gens = append(gens, b.Manifest.Generation)
	}
	if gens[1] != gens[0]+1 {
		t.Errorf("generations %v, want one step per boot", gens)
	}
}

// TestStartTPMSilent: a TPM that never answers does not hold the manifest back: it is
// signed with the key file before the stage's deadline, degraded (passage.tpm=auto) or
// failed (passage.tpm=on).
func TestStartTPMSilent(t *testing.T) {
	for _, tc := range []struct {
		tpm  string
		want stages.Status
	}{{"auto", stages.Degraded}, {"on", stages.Failed}} {
		root, edv := signingNode(t)
		hang := make(chan struct{})
		b := &Boot{Root: root, OpenTPM: func(string) (manifest.Signer, manifest.Measurer, error) {
			<-hang
			return nil, nil, errors.New("tpm: gone")
		}, Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=" + tc.tpm + " passage.key=/etc/passage/passage.key")}
		b.StartTPM()
		var list []stages.Stage
		for _, s := range b.Stages() {
			if s.Name == "manifest" {
				list = append(list, s)
			}
		}
		rs, err := (&stages.Runner{Stages: list, Timeout: 800 * time.Millisecond}).Run(context.Background(), &stages.State{})
		close(hang)
		if err != nil {
			t.Fatal(err)
		}
		mr := rs[0]
		if mr.Status != tc.want || !strings.Contains(fmt.Sprint(mr.Err, mr.Findings), "no answer in time") ||
			strings.Contains(fmt.Sprint(mr.Err), "deadline") {
			t.Fatalf("passage.tpm=%s: manifest %s %v %q, want %s before the deadline, naming the silent TPM", tc.tpm, mr.Status, mr.Err, mr.Findings, tc.want)
		}
		env, err := os.ReadFile(filepath.Join(root, "run/passage", EnvelopeName))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := manifest.Verify(env, edv, manifest.VerifyOptions{}); err != nil {
			t.Errorf("passage.tpm=%s: the key file's signature: %v", tc.tpm, err)
		}
	}
}

// TestBootProfileFindsNoUnits: a boot under the b300 profile on a host without GPUs
// fails its decide stage, saying the profile found none of its units, and the boot's
// verdict is failed, not ok; the manifest is written all the same, with no unit and the
// reason in its decide stage.
func TestBootProfileFindsNoUnits(t *testing.T) {
	s := pcitest.B300()
	s.Hosts = s.Hosts[:1] // the management NICs alone
	root := pcitest.New(t, s).Root
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.profile=b300 passage.erase=off passage.tpm=off"), Sysfs: k}
	rs, st := run(t, b, "scan", "decide", "acs", "erase", "vfio", "manifest")
	decide := rs[1]
	if decide.Status != stages.Failed || decide.Err == nil || !strings.Contains(decide.Err.Error(), "profile b300") ||
		!strings.Contains(decide.Err.Error(), "found none of the units it is for") {
		t.Errorf("decide %s %v, want failed naming the profile", decide.Status, decide.Err)
	}
	if sum := stages.Summary(rs, st.Units()); sum != stages.Failed {
		t.Errorf("boot %s, want failed", sum)
	}
	if b.Manifest == nil || len(b.Manifest.Units) != 0 {
		t.Fatalf("manifest %v", b.Manifest)
	}
	var found bool
	for _, sr := range b.Manifest.Stages {
		for _, f := range sr.Findings {
			found = found || sr.Name == "decide" && strings.Contains(f.Message, "found none of the units it is for")
		}
	}
	if !found {
		t.Errorf("the manifest's decide stage does not say why: %+v", b.Manifest.Stages)
	}
}

// noClose lets the boot close its TPM without closing the swtpm connection the test
// goes on using as the node.
type noClose struct{ transport.TPM }

func (noClose) Close() error { return nil }

// TestManifestAttestation: with a TPM that has an EK certificate (swtpm), the manifest
// stage writes the attestation beside the manifest and passage.out publishes it; a
// verifier enrols the node from it and accepts it for this manifest (the TPM checks: a
// synthetic root has no firmware event log, which the full verification refuses).
func TestManifestAttestation(t *testing.T) {
	ca := attesttest.NewCA(t)
	tpm := attesttest.Start(t, ca)
	open := func(string) (manifest.Signer, manifest.Measurer, error) {
		k, err := tpmkey.New(noClose{tpm})
		if err != nil {
			return nil, nil, err
		}
		return k, k, nil
	}
	root, _ := signingNode(t)
	b := &Boot{Root: root, OpenTPM: open,
		Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key")}
	rs, _ := run(t, b, "scan", "decide", "manifest")
	if mr := rs[2]; mr.Status != stages.OK {
		t.Fatalf("manifest %s %v %v", mr.Status, mr.Err, mr.Findings)
	}
	a, err := attest.ReadAttestation(filepath.Join(root, "run/passage", EnvelopeName+attest.Suffix))
	if err != nil {
		t.Fatalf("%v (findings %v)", err, rs[2].Findings)
	}
	rec, pool := verifiertest.Enrol(t, tpm, ca, a)
	k, err := tpmkey.New(noClose{tpm})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	m := attest.Manifest{Payload: b.Signed.Payload, Generation: b.Manifest.Generation, Signer: k.Public()}
	if _, err := attest.VerifyTPM(rec, a, m, attest.Policy{EKCA: pool}); err != nil {
		t.Fatalf("verify: %v", err)
	}
	if len(a.FirmwareLog) != 0 {
		t.Errorf("a firmware log of %d bytes from a synthetic root", len(a.FirmwareLog))
	}
}

// TestPublishPostsAttestation: passage.url gets the envelope, then the attestation beside
// it (its own media type, the file's bytes); without an attestation only the envelope.
func TestPublishPostsAttestation(t *testing.T) {
	type post struct {
		ctype string
		body  []byte
	}
	var mu sync.Mutex
	var got []post
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			// A control plane that issues no nonces: the offline attestation is posted.
			http.NotFound(w, r)
			return
		}
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, post{r.Header.Get("Content-Type"), b})
		mu.Unlock()
	}))
	defer srv.Close()
	for _, withAttestation := range []bool{true, false} {
		got = nil
		root := t.TempDir()
		att := []byte(`{"format":"passage-attestation/1"}`)
		if withAttestation {
			dir := filepath.Join(root, "run/passage")
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, EnvelopeName+attest.Suffix), att, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.url=" + srv.URL + "/m"),
			Signed: &manifest.Signed{Envelope: []byte("{}"), Digest: "sha256:00"}}
		var publish stages.Stage
		for _, s := range b.Stages() {
			if s.Name == "publish" {
				publish = s
			}
		}
		publish.Needs = nil // run alone: no network or manifest stage before it
		rs, err := (&stages.Runner{Stages: []stages.Stage{publish}, Timeout: 10 * time.Second, Grace: time.Second}).Run(context.Background(), &stages.State{})
		if err != nil {
			t.Fatal(err)
		}
		if rs[0].Status != stages.OK {
			t.Fatalf("publish: %s %v %v", rs[0].Status, rs[0].Err, rs[0].Findings)
		}
		want := 1
		if withAttestation {
			want = 2
		}
		if len(got) != want || got[0].ctype != "application/vnd.dsse.envelope.v1+json" || string(got[0].body) != "{}" {
			t.Fatalf("attestation %v: posts %+v", withAttestation, got)
		}
		// The attestation carries the envelope: a control plane takes a manifest only
		// with the quote that names it.
		if withAttestation {
			a, err := attest.ParseAttestation(got[1].body)
			if got[1].ctype != "application/vnd.passage.attestation+json" || err != nil || string(a.Envelope) != "{}" {
				t.Errorf("second post %q %s (%v), want the attestation carrying the envelope", got[1].ctype, got[1].body, err)
			}
		}
	}
}

// TestManifestIdentity: a boot that could not read its boot id still signs, keeping the
// DMI serial and hostname it did read; a boot that read no identity at all signs
// nothing (the payload is written for the operator, the stage fails).
func TestManifestIdentity(t *testing.T) {
	for _, tc := range []struct {
		name   string
		files  map[string]string
		signed bool
	}{
		{"dmi and hostname, no boot id", map[string]string{"sys/class/dmi/id/product_serial": "S3R1AL-0042\n", "proc/sys/kernel/hostname": "b300-r07-n3\n"}, true},
		{"nothing", nil, false},
	} {
		root, _ := signingNode(t)
		os.Remove(filepath.Join(root, "proc/sys/kernel/random/boot_id"))
		for p, c := range tc.files {
			os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755)
			if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.erase=off passage.tpm=off passage.key=/etc/passage/passage.key")}
		rs, _ := run(t, b, "manifest")
		_, err := os.Stat(filepath.Join(root, "run/passage", EnvelopeName))
		if tc.signed {
			if err != nil || b.Signed == nil || b.Manifest.Node.DMISerial != "S3R1AL-0042" || b.Manifest.Node.Hostname != "b300-r07-n3" {
				t.Errorf("%s: envelope %v, node %+v", tc.name, err, b.Manifest.Node)
			}
			continue
		}
		if rs[0].Status != stages.Failed || rs[0].Err == nil || !strings.Contains(rs[0].Err.Error(), "no node identity") || err == nil || b.Signed != nil {
			t.Errorf("%s: stage %s %v, envelope %v: want failed for no node identity, nothing signed", tc.name, rs[0].Status, rs[0].Err, err)
		}
		if _, err := os.Stat(filepath.Join(root, "run/passage", PayloadName)); err != nil {
			t.Errorf("%s: payload not written: %v", tc.name, err)
		}
	}
}

// TestPublishFreshAttestation: a control plane on loopback issues nonces (attest's
// NonceHandler on GET passage.url, its store a file); the publish stage fetches one and
// posts an attestation quoted over it, which the verifier accepts once for this
// manifest; shown again it is refused naming the nonce, and so is the manifest stage's
// offline attestation (its nonce, the payload digest, was never issued), which says
// where its nonce came from.
func TestPublishFreshAttestation(t *testing.T) {
	ca := attesttest.NewCA(t)
	tpm := attesttest.Start(t, ca)
	open := func(string) (manifest.Signer, manifest.Measurer, error) {
		k, err := tpmkey.New(noClose{tpm})
		if err != nil {
			return nil, nil, err
		}
		return k, k, nil
	}
	store := &attest.NonceStore{Path: filepath.Join(t.TempDir(), "nonces.json")}
	srv := verifiertest.NewControlPlane(t, store.Path)

	root, _ := signingNode(t)
	b := &Boot{Root: root, OpenTPM: open,
		Config: initramfs.ParseCmdline("passage.erase=off passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key passage.url=" + srv.URL + "/m")}
	rs, _ := run(t, b, "scan", "decide", "manifest")
	if mr := rs[2]; mr.Status != stages.OK {
		t.Fatalf("manifest %s %v %v", mr.Status, mr.Err, mr.Findings)
	}
	attPath := filepath.Join(root, "run/passage", EnvelopeName+attest.Suffix)
	offline, err := os.ReadFile(attPath)
	if err != nil {
		t.Fatal(err)
	}
	var publish stages.Stage
	for _, s := range b.Stages() {
		if s.Name == "publish" {
			publish = s
		}
	}
	publish.Needs = nil // run alone: the control plane is on loopback, no network stage
	rs, err = (&stages.Runner{Stages: []stages.Stage{publish}, Timeout: 30 * time.Second, Grace: time.Second}).Run(context.Background(), &stages.State{})
	if err != nil {
		t.Fatal(err)
	}
	if rs[0].Status != stages.OK {
		t.Fatalf("publish: %s %v %v", rs[0].Status, rs[0].Err, rs[0].Findings)
	}
	readAtt := func(b []byte) *attest.Attestation {
		t.Helper()
		p := filepath.Join(t.TempDir(), "a.json")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		a, err := attest.ReadAttestation(p)
		if err != nil {
			t.Fatalf("%v (publish %v)", err, rs[0].Findings)
		}
		return a
	}
	fresh := readAtt(srv.Posted("application/vnd.passage.attestation+json"))
	sum := sha256.Sum256(b.Signed.Payload)
	if fresh.NonceSource != attest.NonceControlPlane || bytes.Equal(fresh.Nonce, sum[:]) || len(fresh.Nonce) != attest.NonceSize {
		t.Fatalf("posted attestation: nonce %x from %q, want the control plane's", fresh.Nonce, fresh.NonceSource)
	}

	rec, pool := verifiertest.Enrol(t, tpm, ca, fresh)
	k, err := tpmkey.New(noClose{tpm})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	m := attest.Manifest{Payload: b.Signed.Payload, Generation: b.Manifest.Generation, Signer: k.Public()}
	pol := attest.Policy{EKCA: pool, Nonces: store}
	if _, err := attest.VerifyTPM(rec, fresh, m, pol); err != nil {
		t.Fatalf("the fresh attestation: %v", err)
	}
	_, err = attest.VerifyTPM(rec, fresh, m, pol)
	if attest.CheckOf(err) != "nonce" || !strings.Contains(err.Error(), hex.EncodeToString(fresh.Nonce)) || !strings.Contains(err.Error(), "already used") {
		t.Errorf("the same attestation again: %v, want refused naming the nonce", err)
	}

	// The manifest stage's own attestation, as passage.out keeps it: over the payload
	// digest, which this verifier never issued.
	a := readAtt(offline)
	if a.NonceSource != attest.NoncePayloadDigest || !bytes.Equal(a.Nonce, sum[:]) {
		t.Errorf("offline attestation: nonce %x from %q, want the payload digest", a.Nonce, a.NonceSource)
	}
	_, err = attest.VerifyTPM(rec, a, m, pol)
	if attest.CheckOf(err) != "nonce" || !strings.Contains(err.Error(), hex.EncodeToString(sum[:])) || !strings.Contains(err.Error(), "never issued") {
		t.Errorf("a nonce never issued: %v, want refused naming the nonce", err)
	}
	// Without a store, the offline attestation is what it always was: fresh as its manifest.
	if _, err := attest.VerifyTPM(rec, a, m, attest.Policy{EKCA: pool}); err != nil {
		t.Errorf("offline attestation without a nonce store: %v", err)
	}
}
