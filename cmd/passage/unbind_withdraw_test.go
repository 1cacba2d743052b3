package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// A node after its boot for unbind: unit 3 on vfio-pci (simulated kernel), a signed
// generation 1 saying every unit ready, the key where unbind reads it, a /proc.
func withdrawNode(t *testing.T) (root, gen string, k *vfiotest.Kernel, v manifest.Verifier) {
	t.Helper()
	n := pcitest.New(t, pcitest.B300())
	root = n.Root
	for p, c := range map[string]string{"proc/sys/kernel/random/boot_id": "6f1c2a4e-8d3b-4c7a-9e15-2b7d0f4a9c31\n", "proc/cmdline": "console=ttyS0\n"} {
		os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(root, p), []byte(c), 0o644)
	}
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	tree, _ := pci.Scan(root)
	p, _ := topology.LoadProfile("b300")
	labels, _ := topology.Label(tree, p)
	if rep, err := vfiobind.Bind(context.Background(), k, tree, []*topology.Unit{labels.Unit(3)}, vfiobind.Options{Modules: k}); err != nil || !rep.Units[0].Bound() {
		t.Fatalf("bind unit 3: %v", err)
	}
	os.MkdirAll(filepath.Join(root, "etc/passage"), 0o755)
	priv, pub, err := manifest.GenerateKey(filepath.Join(root, "etc/passage"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(priv, filepath.Join(root, "etc/passage/key")); err != nil {
		t.Fatal(err)
	}
	s, _ := manifest.LoadSigner(filepath.Join(root, "etc/passage/key"))
	if v, err = manifest.LoadVerifier(pub); err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Build(root, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range labels.Units {
		m.Units = append(m.Units, manifest.Unit{ID: u.ID.String(), Status: manifest.StatusReady})
	}
	gen = filepath.Join(t.TempDir(), "generation")
	m.Generation, m.GenerationSource, _ = manifest.NextGeneration(manifest.FileCounter{Path: gen})
	dir := filepath.Join(root, "run/passage")
	os.MkdirAll(dir, 0o755)
	if _, err := manifest.WriteSigned(context.Background(), m, dir, "manifest.dsse.json", nil, s); err != nil {
		t.Fatal(err)
	}
	return root, gen, k, v
}

func latestManifest(t *testing.T, root string, v manifest.Verifier) *manifest.Manifest {
	t.Helper()
	env, err := manifest.ReadEnvelope(filepath.Join(root, "run/passage/manifest.dsse.json"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return got.Manifest
}

// unbind refuses while a VMM holds the unit's device cdev (iommufd) or group, and
// without a counter; otherwise it writes a generation saying the unit is failed before
// it releases anything.
func TestUnbindWithdrawsTheUnit(t *testing.T) {
	root, gen, k, v := withdrawNode(t)
	env := unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }}
	nvme := unitFunctionAddrs(t, root, 3)[3]
	os.MkdirAll(filepath.Join(root, "sys/bus/pci/devices", nvme.String(), "vfio-dev/vfio2"), 0o755)
	fd := filepath.Join(root, "proc/777/fd")
	os.MkdirAll(fd, 0o755)
	os.WriteFile(filepath.Join(root, "proc/777/comm"), []byte("qemu-system-x86\n"), 0o644)
	os.Symlink("/dev/iommu", filepath.Join(fd, "9"))
	os.Symlink("/dev/vfio/devices/vfio2", filepath.Join(fd, "10"))

	base := []string{"--root", root, "--unit", "gpu3", "--tpm", "off"}
	k.ResetWrites()
	code, out, errs := runCmdEnv(t, env, append(base, "--generation-file", gen)...)
	if code != 1 || out != "" || !strings.Contains(errs, "/dev/vfio/devices/vfio2 is held open by pid 777 (qemu-system-x86)") {
		t.Errorf("held cdev: exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
	os.RemoveAll(filepath.Join(root, "proc/777"))
	code, out, errs = runCmdEnv(t, env, base...)
	if code != 1 || out != "" || !strings.Contains(errs, "no generation counter") {
		t.Errorf("no counter: exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
	if w := k.Writes(); len(w) != 0 {
		t.Errorf("refused, yet %d sysfs writes", len(w))
	}
	if m := latestManifest(t, root, v); m.Generation != 1 {
		t.Errorf("refused, yet generation %d", m.Generation)
	}

	code, out, errs = runCmdEnv(t, env, append(base, "--generation-file", gen)...)
	if code != 0 || !strings.HasPrefix(out, "manifest generation 2 (file): gpu3=failed\n") {
		t.Fatalf("unbind: exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
	m := latestManifest(t, root, v)
	for _, u := range m.Units {
		want := manifest.StatusReady
		if u.ID == "gpu3" {
			want = manifest.StatusFailed
		}
		if u.Status != want || (u.ID == "gpu3" && !strings.Contains(strings.Join(u.Reasons, ";"), "unbind: returned to host drivers")) {
			t.Errorf("generation %d: %s %s %q, want %s", m.Generation, u.ID, u.Status, u.Reasons, want)
		}
	}
}

func runCmdEnv(t *testing.T, env unbindEnv, args ...string) (int, string, string) {
	t.Helper()
	return runCmd(t, func(a []string, o, e io.Writer) int { return runUnbind(a, o, e, env) }, args...)
}

// TestUnbindAttestsOverNonce: with the TPM, unbind attests the generation it signs; with
// --nonce, over the verifier's nonce (passage attest nonce), which verify --attest
// --nonces accepts once and then refuses as used. Bad --nonce values are usage errors, in
// recycle too (the same flags; recycle's own run is QEMU's TestRecycleRunningHost).
func TestUnbindAttestsOverNonce(t *testing.T) {
	root, gen, k, _ := withdrawNode(t)
	env := unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }}
	ca := attesttest.NewCA(t)
	sock := attesttest.StartSocket(t, ca)
	os.MkdirAll(filepath.Join(root, "dev"), 0o755)
	if err := os.Symlink(sock, filepath.Join(root, tpmkey.DefaultDevice)); err != nil {
		t.Fatal(err)
	}
	base := []string{"--root", root, "--unit", "gpu3", "--generation-file", gen}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--nonce", "zz"}, `--nonce "zz": want 1 to 64 bytes of hex`},
		{[]string{"--nonce", strings.Repeat("00", 65)}, "want 1 to 64 bytes of hex"},
		{[]string{"--nonce", "0011", "--tpm", "off"}, "--nonce with --tpm off"},
	} {
		if code, _, errs := runCmdEnv(t, env, append(base, c.args...)...); code != 2 || !strings.Contains(errs, c.want) {
			t.Errorf("unbind %v: exit %d, stderr %q; want 2 and %q", c.args, code, errs, c.want)
		}
		if code, _, errs := runCmd(t, run, append(append([]string{"recycle"}, base...), c.args...)...); code != 2 || !strings.HasPrefix(errs, "passage recycle: ") || !strings.Contains(errs, c.want) {
			t.Errorf("recycle %v: exit %d, stderr %q; want 2 and %q", c.args, code, errs, c.want)
		}
	}

	v := t.TempDir()
	store := filepath.Join(v, "nonces.json")
	_, out, _ := runCmd(t, run, "attest", "nonce", "--nonces", store)
	issued := strings.TrimSpace(out)
	code, out, errs := runCmdEnv(t, env, append(base, "--nonce", issued)...)
	if code != 0 || !strings.Contains(out, "gpu3=failed") {
		t.Fatalf("unbind --nonce: exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
	dir := filepath.Join(root, "run/passage")
	env2 := filepath.Join(dir, "manifest.dsse.json")
	att := env2 + attest.Suffix
	a, err := attest.ReadAttestation(att)
	if err != nil {
		t.Fatalf("unbind wrote no attestation: %v", err)
	}
	if a.NonceSource != attest.NonceControlPlane || hex.EncodeToString(a.Nonce) != issued {
		t.Fatalf("attestation over nonce %x (%s), want %s", a.Nonce, a.NonceSource, issued)
	}

	// The verifier enrols the node and checks the attestation over its own store: the
	// TPM's checks pass (the empty firmware log is what refuses here), the nonce is used.
	mustRun := func(want int, args ...string) string {
		t.Helper()
		code, out, errs := runCmd(t, run, args...)
		if code != want {
			t.Fatalf("%v: exit %d, want %d\n%s%s", args, code, want, out, errs)
		}
		return errs
	}
	caFile := filepath.Join(v, "ek-ca.pem")
	os.WriteFile(caFile, ca.PEM(t), 0o600)
	ch, pend, ans := filepath.Join(v, "challenge.json"), filepath.Join(v, "pending.json"), filepath.Join(v, "answer")
	node, pub := filepath.Join(v, "node.json"), filepath.Join(v, "node.pub")
	mustRun(0, "attest", "enroll", "--ek-ca", caFile, "--challenge", ch, "--pending", pend, att)
	mustRun(0, "attest", "activate", "--tpm-device", sock, "-o", ans, ch)
	mustRun(0, "attest", "enroll", "--pending", pend, "--answer", ans, "-o", node, "--tpm-pub-out", pub)
	approved := filepath.Join(v, "approved.json")
	ap, _ := json.Marshal(attest.Approved{Format: attest.ApprovedFormat,
		Authenticode: []attest.HexBytes{make([]byte, 32)}, PCR11: []attest.HexBytes{make([]byte, 32)},
		DBCertificates: []string{string(ca.PEM(t))}})
	os.WriteFile(approved, ap, 0o600)
	verify := func() string {
		return mustRun(1, "verify", "--tpm-pub", pub, "--attest", att, "--node", node, "--ek-ca", caFile, "--approved", approved, "--nonces", store, env2)
	}
	if errs := verify(); !strings.Contains(errs, "firmware event log: empty") {
		t.Errorf("verify --nonces of unbind's generation: %s, want past the nonce to the firmware log", errs)
	}
	if errs := verify(); !strings.Contains(errs, "nonce: "+issued+" was already used") {
		t.Errorf("the same attestation again: %s, want refused naming the nonce", errs)
	}
}

// TestUnbindNonceAttestationFails: unbind --nonce whose generation cannot be attested
// (the firmware event log cannot be read: a directory where securityfs has the file)
// still withdraws unit 3 and releases its functions (the signed generation says failed,
// attested or not), but the verifier waiting for an attestation over its nonce gets
// none: unbind says why on stderr and exits 1, as recycle --nonce does. Without --nonce
// the same failure is reported and the exit is 0.
func TestUnbindNonceAttestationFails(t *testing.T) {
	for _, c := range []struct {
		args []string
		want int
	}{
		{[]string{"--nonce", "00112233445566778899aabbccddeeff"}, 1},
		{nil, 0},
	} {
		root, gen, k, v := withdrawNode(t)
		env := unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }}
		sock := attesttest.StartSocket(t, attesttest.NewCA(t))
		os.MkdirAll(filepath.Join(root, "dev"), 0o755)
		if err := os.Symlink(sock, filepath.Join(root, tpmkey.DefaultDevice)); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(root, attest.FirmwareLogPath), 0o755); err != nil {
			t.Fatal(err)
		}
		code, out, errs := runCmdEnv(t, env, append([]string{"--root", root, "--unit", "gpu3", "--generation-file", gen}, c.args...)...)
		if code != c.want || !strings.Contains(out, "gpu3=failed") || !strings.Contains(errs, "attestation: firmware event log") {
			t.Errorf("unbind %v, attestation failing: exit %d, want %d with gpu3 withdrawn and the attestation's failure named\nstdout %s\nstderr %s", c.args, code, c.want, out, errs)
		}
		if !strings.Contains(out, "vfio-pci -> nvme") {
			t.Errorf("unbind %v: the functions were not released\nstdout %s", c.args, out)
		}
		for _, u := range latestManifest(t, root, v).Units {
			if u.ID == "gpu3" && u.Status != manifest.StatusFailed {
				t.Errorf("unbind %v: the signed generation says gpu3 %s, want failed", c.args, u.Status)
			}
		}
		if _, err := os.Stat(filepath.Join(root, "run/passage/manifest.dsse.json"+attest.Suffix)); !os.IsNotExist(err) {
			t.Errorf("unbind %v: an attestation is beside the generation it could not attest: %v", c.args, err)
		}
	}
}
