//go:build qemu

package qemutest

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/attest/verifiertest"
	"github.com/passage-boot/passage/manifest"
)

var (
	ossslDigest = regexp.MustCompile(`(?m)^Calculated message digest\s*:\s*([0-9A-Fa-f]{64})\s*$`)
	measured11  = regexp.MustCompile(`(?m)^11:sha256=([0-9a-f]{64})$`)
)

// approvedFor is what an operator approves of a signed UKI, computed by the real tools
// from the image file: its Authenticode hash (osslsigncode, what the firmware logs in
// PCR 4), the PCR 11 value systemd-stub will extend from its sections (systemd-measure
// calculate of the sections objcopy extracts; --phase=: as no systemd-pcrphase runs in
// passage's boot), and the db certificate that signs it (the snakeoil test key).
func approvedFor(t *testing.T, uki string) *attest.Approved {
	t.Helper()
	out, err := exec.Command("osslsigncode", "verify", "-in", uki).CombinedOutput()
	m := ossslDigest.FindSubmatch(out)
	if m == nil {
		t.Fatalf("osslsigncode verify %s: %v: no calculated digest in\n%s", uki, err, out)
	}
	auth, _ := hex.DecodeString(string(m[1]))
	dir := t.TempDir()
	args := []string{"calculate", "--bank=sha256", "--phase=:"}
	for _, s := range []string{"linux", "osrel", "cmdline", "initrd"} {
		f := filepath.Join(dir, s)
		if out, err := exec.Command("objcopy", "-O", "binary", "--only-section=."+s, uki, f).CombinedOutput(); err != nil {
			t.Fatalf("objcopy .%s of %s: %v: %s", s, uki, err, out)
		}
		args = append(args, "--"+s+"="+f)
	}
	out, err = exec.Command("/usr/lib/systemd/systemd-measure", args...).CombinedOutput()
	m = measured11.FindSubmatch(out)
	if m == nil {
		t.Fatalf("systemd-measure %v: %v: no PCR 11 in\n%s", args, err, out)
	}
	pcr11, _ := hex.DecodeString(string(m[1]))
	cert, err := os.ReadFile(snakeoilCert)
	if err != nil {
		t.Fatal(err)
	}
	ap := &attest.Approved{Format: attest.ApprovedFormat, Authenticode: []attest.HexBytes{auth},
		PCR11: []attest.HexBytes{pcr11}, DBCertificates: []string{string(cert)}}
	if err := ap.Parse(); err != nil {
		t.Fatal(err)
	}
	return ap
}

// attestationOf is the attestation the guest published beside its manifest, and the
// manifest verified with the key the attestation certifies.
func attestationOf(t *testing.T, run *Run, rec *attest.NodeRecord) (*attest.Attestation, attest.Manifest) {
	t.Helper()
	b, ok := run.Files["manifest.dsse.json"+attest.Suffix]
	if !ok {
		t.Fatalf("no attestation from the guest; files %v; console end:\n%s", keys(run.Files), consoleTail(run.Console, 40))
	}
	path := filepath.Join(t.TempDir(), "manifest.dsse.json"+attest.Suffix)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := attest.ReadAttestation(path)
	if err != nil {
		t.Fatal(err)
	}
	if rec == nil {
		return a, attest.Manifest{}
	}
	pemKey, err := rec.SigningKeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	v, err := manifest.ParsePublicKey(pemKey)
	if err != nil {
		t.Fatal(err)
	}
	ver, err := manifest.Verify(run.Files["manifest.dsse.json"], v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatalf("the manifest does not verify with the enrolled, certified key: %v", err)
	}
	return a, attest.Manifest{Payload: ver.Payload, Generation: ver.Manifest.Generation, Signer: v.Public()}
}

func wantRefusal(t *testing.T, what string, err error, check, words string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: accepted, want refused by %s", what, check)
		return
	}
	if attest.CheckOf(err) != check || !strings.Contains(err.Error(), words) {
		t.Errorf("%s: %v, want refused by %s saying %q", what, err, check, words)
		return
	}
	t.Logf("%s: refused: %v", what, err)
}

// Scenario 9: remote attestation of a netbooted node. The TPM is manufactured with an
// EK certificate from a private CA (swtpm_setup, as a vendor's factory does); OVMF with
// Secure Boot boots the signed UKI as in scenario 8, and passage publishes the
// attestation beside its manifest. The verifier, holding only the CA, the snakeoil db
// certificate and the image's Authenticode hash and predicted PCR 11, enrols the node
// (the credential round against the TPM's state once QEMU is gone: the same EK and AK
// the guest used) and accepts the manifest; against another db certificate it is
// refused naming PCR 7. A second boot of the same node runs another build of the image,
// signed with the same db key: refused naming PCR 4, and PCR 11 when its Authenticode
// hash is approved too. A third, with Secure Boot off, is refused naming PCR 7.
// The first boot runs against a control plane on the host's loopback (passage.url): it
// fetches a nonce from it before quoting, and the verifier holding the nonce store
// accepts that attestation once, refusing it shown again, naming the nonce.
func TestScenario9Attest(t *testing.T) {
	ca := attesttest.NewCA(t)
	dir := t.TempDir()
	state := filepath.Join(dir, "tpm")
	attesttest.Manufacture(t, ca, state)
	pool, err := attest.CAPool(ca.PEM(t))
	if err != nil {
		t.Fatal(err)
	}

	// The control plane: passage.url on the host's loopback (the guest reaches it through
	// the management network), issuing nonces from the verifier's store on GET and
	// keeping what the boot POSTs.
	v := t.TempDir()
	store := filepath.Join(v, "nonces.json")
	srv := verifiertest.NewControlPlane(t, store)

	work := filepath.Join(dir, "secureboot")
	run, _ := bootPassage(t, Options{NetBoot: &NetBoot{ControlPlane: srv.Listener.Addr().String()}, TPMState: state, WorkDir: work})
	con, _ := os.ReadFile(run.Console)
	if !strings.Contains(string(con), "EFI stub: UEFI Secure Boot is enabled") {
		t.Fatal("the boot did not run under Secure Boot")
	}
	a, _ := attestationOf(t, run, nil)
	if len(a.FirmwareLog) == 0 {
		t.Fatal("the guest published no firmware event log")
	}
	// The boot fetched a nonce before it quoted: the attestation it posted and kept is
	// over the control plane's nonce, not the payload digest.
	// What it posted is that attestation carrying the manifest's envelope.
	sent := srv.Posted("application/vnd.passage.attestation+json")
	want, err := attest.WithEnvelope(run.Files["manifest.dsse.json"+attest.Suffix], run.Files["manifest.dsse.json"])
	if err != nil {
		t.Fatal(err)
	}
	if a.NonceSource != attest.NonceControlPlane || len(a.Nonce) != attest.NonceSize || string(sent) != string(want) {
		t.Fatalf("attestation nonce %x from %q (posted %d bytes), want the control plane's, posted; console end:\n%s", a.Nonce, a.NonceSource, len(sent), consoleTail(run.Console, 40))
	}

	// Enrolment and verification through the commands, as an operator runs them: the
	// verifier's challenge, the node's answer from its TPM (its state once QEMU is gone:
	// the same EK and AK the guest used), the node record, verify --attest.
	passage := filepath.Join(v, "passage")
	if out, err := exec.Command("go", "build", "-o", passage, "../cmd/passage").CombinedOutput(); err != nil {
		t.Fatalf("build passage: %v\n%s", err, out)
	}
	cli := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(passage, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("passage %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	write := func(name string, b []byte) string {
		t.Helper()
		path := filepath.Join(v, name)
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	env := write("manifest.dsse.json", run.Files["manifest.dsse.json"])
	attPath := write("manifest.dsse.json"+attest.Suffix, run.Files["manifest.dsse.json"+attest.Suffix])
	caFile := write("ek-ca.pem", ca.PEM(t))
	ch, pend, ans := filepath.Join(v, "challenge.json"), filepath.Join(v, "pending.json"), filepath.Join(v, "answer")
	node, pub := filepath.Join(v, "node.json"), filepath.Join(v, "node-tpm.pub")
	cli("attest", "enroll", "--ek-ca", caFile, "--challenge", ch, "--pending", pend, attPath)
	sock, stop := attesttest.Serve(t, state)
	cli("attest", "activate", "--tpm-device", sock, "-o", ans, ch)
	stop() // the second boot runs on the same state
	cli("attest", "enroll", "--pending", pend, "--answer", ans, "-o", node, "--tpm-pub-out", pub)
	var rec attest.NodeRecord
	if err := attest.ReadJSON(node, attest.NodeFormat, &rec); err != nil {
		t.Fatal(err)
	}

	approved := approvedFor(t, filepath.Join(work, "tftp", "passage.efi"))
	apJSON, err := json.Marshal(approved)
	if err != nil {
		t.Fatal(err)
	}
	out := cli("verify", "--tpm-pub", pub, "--attest", attPath, "--node", node, "--ek-ca", caFile,
		"--approved", write("approved.json", apJSON), "--nonces", store, "--update-node", env)
	t.Logf("passage verify --attest:\n%s", out)
	if !strings.Contains(out, ": OK, signed by") || !strings.Contains(out, "attested    EK certified") || !strings.Contains(out, "Secure Boot by O=SnakeOil") {
		t.Errorf("verify --attest accepted without saying what was attested:\n%s", out)
	}
	if err := attest.ReadJSON(node, attest.NodeFormat, &rec); err != nil || rec.Seen.Generation == 0 {
		t.Fatalf("--update-node: record %+v, %v", rec.Seen, err)
	}

	a, m := attestationOf(t, run, &rec)
	// Shown again, the attestation is a replay: its nonce is used up.
	_, err = attest.Verify(&rec, a, m, attest.Policy{EKCA: pool, Approved: approved, Nonces: &attest.NonceStore{Path: store}})
	wantRefusal(t, "the same attestation shown twice", err, "nonce", hex.EncodeToString(a.Nonce)+" was already used")
	// The checks below are of the image, with the nonce given.
	res, err := attest.Verify(&rec, a, m, attest.Policy{EKCA: pool, Approved: approved, Nonce: a.Nonce})
	if err != nil {
		t.Fatalf("the approved image's attestation is refused: %v", err)
	}
	t.Logf("accepted: reset count %d, generation %d, db %s, Authenticode %x, PCR 11 %x",
		res.ResetCount, m.Generation, res.Firmware.Authority, res.Firmware.Image, []byte(a.PCRs[11]))

	// Another build of the image, signed by the same db key: the same kernel and
	// initramfs (the sections of the image the harness serves), another command line.
	// The node boots it: the firmware runs it, but it is not the image the operator
	// approved. Refused naming PCR 4 (its Authenticode hash is not approved), and naming
	// PCR 11 where a lax list approves its Authenticode hash but not what its sections
	// measure.
	other := filepath.Join(dir, "other")
	otherUKI := filepath.Join(other, "passage.efi")
	rebuild := func(uki string) error {
		parts := filepath.Join(dir, "parts")
		if err := os.MkdirAll(parts, 0o755); err != nil {
			return err
		}
		for _, sec := range []string{"linux", "initrd", "cmdline"} {
			if out, err := exec.Command("objcopy", "-O", "binary", "--only-section=."+sec, uki, filepath.Join(parts, sec)).CombinedOutput(); err != nil {
				return fmt.Errorf("objcopy .%s: %v: %s", sec, err, out)
			}
		}
		line, err := os.ReadFile(filepath.Join(parts, "cmdline"))
		if err != nil {
			return err
		}
		key, cert, err := SnakeoilKey(dir)
		if err != nil {
			return err
		}
		cmd := strings.TrimRight(string(line), "\x00\n ") + " passage.build=other"
		if out, err := exec.Command("bash", filepath.Join("..", "image", "uki.sh"), other,
			filepath.Join(parts, "linux"), filepath.Join(parts, "initrd"), cmd, key, cert).CombinedOutput(); err != nil {
			return fmt.Errorf("uki.sh: %v: %s", err, out)
		}
		b, err := os.ReadFile(otherUKI)
		if err != nil {
			return err
		}
		return os.WriteFile(uki, b, 0o644)
	}
	orun, _ := bootPassage(t, Options{NetBoot: &NetBoot{Tamper: rebuild}, TPMState: state, WorkDir: filepath.Join(dir, "unapproved")})
	if con, _ := os.ReadFile(orun.Console); !strings.Contains(string(con), "EFI stub: UEFI Secure Boot is enabled") || !strings.Contains(string(con), "passage.build=other") {
		t.Fatal("the other build did not run under Secure Boot")
	}
	unapproved := approvedFor(t, otherUKI)
	oa, om := attestationOf(t, orun, &rec)
	_, err = attest.Verify(&rec, oa, om, attest.Policy{EKCA: pool, Approved: approved})
	wantRefusal(t, "another signed build booted", err, "PCR 4", "not approved was loaded")
	lax := *approved
	lax.Authenticode = append(append([]attest.HexBytes(nil), approved.Authenticode...), unapproved.Authenticode...)
	_, err = attest.Verify(&rec, oa, om, attest.Policy{EKCA: pool, Approved: &lax})
	wantRefusal(t, "another signed build booted, its Authenticode hash approved", err, "PCR 11", "not an approved UKI's")
	// What the TPM vouches for holds: only the image is not the approved one.
	if _, err := attest.VerifyTPM(&rec, oa, om, attest.Policy{EKCA: pool}); err != nil {
		t.Errorf("TPM checks of the unapproved build's boot: %v", err)
	}

	otherDB := *approved
	otherDB.DBCertificates = []string{string(ca.PEM(t))}
	if err := otherDB.Parse(); err != nil {
		t.Fatal(err)
	}
	_, err = attest.Verify(&rec, a, m, attest.Policy{EKCA: pool, Approved: &otherDB, Nonce: a.Nonce})
	wantRefusal(t, "another db certificate approved", err, "PCR 7", "not an approved db certificate")

	// The same node, Secure Boot off (no keys enrolled: the firmware checks nothing).
	// Without Secure Boot systemd-stub takes the loader's arguments as the command line
	// (iPXE passes the image's name), so boot.ipxe gives the image's own line, as a
	// script for such a node would.
	cmdline := run.Cmdline
	passArgs := func(uki string) error {
		script := "#!ipxe\nchain passage.efi " + cmdline + "\n"
		return os.WriteFile(filepath.Join(filepath.Dir(uki), "boot.ipxe"), []byte(script), 0o644)
	}
	work = filepath.Join(dir, "nosecureboot")
	run, _ = bootPassage(t, Options{NetBoot: &NetBoot{Vars: OVMFVarsNoKeys, Tamper: passArgs}, TPMState: state, WorkDir: work})
	if con, _ := os.ReadFile(run.Console); strings.Contains(string(con), "UEFI Secure Boot is enabled") {
		t.Fatal("the second boot ran under Secure Boot")
	}
	a, m = attestationOf(t, run, &rec)
	_, err = attest.Verify(&rec, a, m, attest.Policy{EKCA: pool, Approved: approvedFor(t, filepath.Join(work, "tftp", "passage.efi"))})
	wantRefusal(t, "Secure Boot off", err, "PCR 7", "Secure Boot is off")
	// Without Secure Boot systemd-stub took the loader's command line: a command line
	// override, which it measures into PCR 12 (TestVerifyFirmware refuses it by name).
	if bytes.Equal(a.PCRs[12], make([]byte, len(a.PCRs[12]))) {
		t.Errorf("the loader's command line left PCR 12 at zero")
	}
	// Everything the TPM vouches for still holds: only the firmware's word refuses it.
	if _, err := attest.VerifyTPM(&rec, a, m, attest.Policy{EKCA: pool}); err != nil {
		t.Errorf("TPM checks of the second boot: %v", err)
	}
}
