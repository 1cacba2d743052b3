package boot

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
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

func TestACSAppliesAndSkipsFailedUnits(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.profile=b300")}
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
	applied, nicPorts := 0, 0
	for id, chs := range b.ACS {
		for _, ch := range chs {
			if id == 3 {
				if ch.Result != "unchanged: unit failed before the acs stage" {
					t.Errorf("failed unit's port %s: %s", ch.Port, ch.Result)
				}
				continue
			}
			if ch.Result == "applied" {
				applied++
			}
			if !strings.HasPrefix(ch.Result, "applied") && !strings.HasPrefix(ch.Result, "unchanged") {
				t.Errorf("port %s: %s", ch.Port, ch.Result)
			}
			if ch.After != ch.Target {
				t.Errorf("port %s reads %q, target %q", ch.Port, ch.After, ch.Target)
			}
		}
	}
	for _, p := range b.ACSPlan {
		if p.Position == topology.PosNICPort && p.Unit != 3 {
			nicPorts++
			if !strings.Contains(p.Target().Lspci(), "DirectTrans+") {
				t.Errorf("NIC port %s target %s", p.Addr, p.Target().Lspci())
			}
		}
	}
	if nicPorts == 0 || applied < nicPorts {
		t.Errorf("%d writes for %d NIC ports", applied, nicPorts)
	}
	if len(acs.Changes) != applied {
		t.Errorf("%d changes recorded, %d applied", len(acs.Changes), applied)
	}
	// The writes reached the synthetic config space: a fresh scan reads DT back on every
	// NIC port of the units that were not failed, and not on unit 3's.
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range b.ACSPlan {
		if p.Position != topology.PosNICPort {
			continue
		}
		d := tree.Lookup(p.Addr)
		dt := d != nil && d.ACS != nil && d.ACS.Ctl&pci.ACSDT != 0
		if dt != (p.Unit != 3) {
			t.Errorf("unit %d NIC port %s: DT on disk %v", p.Unit, p.Addr, dt)
		}
	}
	if u := st.Units()[3]; u.Status != stages.Failed {
		t.Errorf("gpu3 = %+v", u)
	}
}

func TestACSLockdownAdvice(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Load("vfio-pci"); err != nil {
		t.Fatal(err)
	}
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.profile=b300"), Release: "6.1.0-57-amd64",
		ConfigIO: lockedDown{pci.SysfsConfig{Root: root}}, Sysfs: k}
	rs, st := run(t, b, "scan", "label", "firmware", "acs", "vfio")
	acs, vfio := rs[3], rs[4]
	if acs.Status != stages.Degraded {
		t.Fatalf("acs %s %v %v", acs.Status, acs.Err, acs.Findings)
	}
	// Lockdown refuses config writes, not binding: every degraded unit is on vfio-pci.
	if vfio.Status == stages.Failed || vfio.Status == stages.Skipped {
		t.Fatalf("vfio %s %v %v", vfio.Status, vfio.Err, vfio.Findings)
	}
	bound := 0
	for _, u := range b.Bind.Units {
		for _, f := range u.Functions {
			if f.DriverAfter != "vfio-pci" {
				t.Errorf("%s: driver %q after binding under lockdown", f.Addr, f.DriverAfter)
			}
			bound++
		}
	}
	if bound < 8*4 {
		t.Errorf("%d functions bound, want every unit's", bound)
	}
	for _, u := range st.Units() {
		why := strings.Join(u.Reasons, "; ")
		// The kernel's default leaves SV RR CR UF set: refusing DT only degrades.
		if u.Status != stages.Degraded || !strings.Contains(why, "pci=config_acs=") || !strings.Contains(why, "6.11") ||
			!strings.Contains(why, "6.1.0-57-amd64") {
			t.Errorf("unit %s: %s %q", u.ID, u.Status, why)
		}
	}
	locked := 0
	for _, chs := range b.ACS {
		for _, ch := range chs {
			if strings.HasPrefix(ch.Result, "failed: locked down") {
				locked++
				if strings.Contains(ch.After, "DirectTrans+") {
					t.Errorf("port %s reads DT after a refused write", ch.Port)
				}
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
	for _, p := range b.ACSPlan {
		if d := tree.Lookup(p.Addr); d != nil && d.ACS != nil && d.ACS.Ctl != p.Current {
			t.Errorf("port %s changed under lockdown", p.Addr)
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
			Config: initramfs.ParseCmdline("passage.profile=b300 passage.tpm=" + tc.tpm + " passage.key=/etc/passage/passage.key")}
		rs, _ := run(t, b, "scan", "label", "manifest")
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
			Config: initramfs.ParseCmdline("passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key")}
		rs, _ := run(t, b, "scan", "label", "manifest")
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
	root := pcitest.New(t, pcitest.B300()).Root
	keyDir := filepath.Join(root, "etc/passage")
	os.MkdirAll(keyDir, 0o755)
	if _, _, err := manifest.GenerateKey(keyDir); err != nil {
		t.Fatal(err)
	}
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.tpm=on passage.key=/etc/passage/passage.key")}
	rs, _ := run(t, b, "manifest")
	if rs[0].Status != stages.Failed || !strings.Contains(rs[0].Err.Error(), "passage.tpm=on") {
		t.Fatalf("manifest %s %v", rs[0].Status, rs[0].Err)
	}
	// Still signed with the key file, generation flagged as unordered.
	if b.Signed == nil || b.Manifest.GenerationSource != manifest.GenerationNone || b.Manifest.Generation != 0 {
		t.Errorf("signed %v, generation %d (%s)", b.Signed != nil, b.Manifest.Generation, b.Manifest.GenerationSource)
	}
}

// TestManifestContent: the manifest carries links, the ACS changes, ATS findings, the
// guest plan with both matrices, and every earlier stage.
func TestManifestContent(t *testing.T) {
	root := pcitest.New(t, pcitest.B300()).Root
	keyDir := filepath.Join(root, "etc/passage")
	os.MkdirAll(keyDir, 0o755)
	if _, _, err := manifest.GenerateKey(keyDir); err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(root, "proc/sys/kernel/random"), 0o755)
	os.WriteFile(filepath.Join(root, "proc/sys/kernel/random/boot_id"), []byte("b0071d\n"), 0o644)
	b := &Boot{Root: root, Config: initramfs.ParseCmdline("passage.profile=b300 passage.tpm=off passage.key=/etc/passage/passage.key passage.bogus=1")}
	rs, _ := run(t, b, "scan", "label", "firmware", "acs", "manifest")
	if mr := rs[4]; mr.Status != stages.OK {
		t.Fatalf("manifest %s %v %v", mr.Status, mr.Err, mr.Findings)
	}
	m := b.Manifest
	if !strings.HasPrefix(m.Profile.Digest, "sha256:") || len(m.Errors) != 1 || !strings.Contains(m.Errors[0], "passage.bogus") {
		t.Errorf("profile %+v errors %q", m.Profile, m.Errors)
	}
	for _, u := range m.Units {
		if len(u.ACSChanges) == 0 || len(u.ATSFindings) != 2 {
			t.Errorf("unit %s: %d ACS changes, %d ATS findings", u.ID, len(u.ACSChanges), len(u.ATSFindings))
		}
		for _, f := range u.Functions {
			if f.Link.Speed == "" || f.Link.Speed == "unknown" || f.Link.MaxWidth == 0 {
				t.Errorf("%s (%s): link %+v", f.BDF, f.Role, f.Link)
			}
		}
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
	if strings.Join(names, " ") != "scan label firmware acs" {
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
			Config: initramfs.ParseCmdline("passage.profile=b300 passage.tpm=on passage.key=/etc/passage/passage.key")}
		b.StartTPM()
		select {
		case <-opened:
		case <-time.After(30 * time.Second):
			t.Fatal("StartTPM did not open the TPM")
		}
		rs, _ := run(t, b, "scan", "label", "manifest")
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
		}, Config: initramfs.ParseCmdline("passage.profile=b300 passage.tpm=" + tc.tpm + " passage.key=/etc/passage/passage.key")}
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
