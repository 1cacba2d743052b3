package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// TestAttestRound: the enrolment round and verify --attest through the commands, on a
// swtpm with an EK certificate: the node's attestation (attest quote), enroll, the
// node's activate, enroll --answer writing the node record and the certified key, and
// verify --attest, which refuses for the empty firmware event log (no firmware here)
// and names the check.
func TestAttestRound(t *testing.T) {
	ca := attesttest.NewCA(t)
	sock := attesttest.StartSocket(t, ca)
	dir := t.TempDir()
	k, err := tpmkey.Open(sock)
	if err != nil {
		t.Fatal(err)
	}
	signed, err := manifest.WriteSigned(context.Background(), manifesttest.B300(1), dir, "manifest.dsse.json", k, k)
	k.Close() // swtpm serves one connection at a time
	if err != nil {
		t.Fatal(err)
	}
	env := filepath.Join(dir, "manifest.dsse.json")
	att := env + attest.Suffix
	nonce := sha256.Sum256(signed.Payload)
	mustRun := func(want int, args ...string) (string, string) {
		t.Helper()
		code, out, errs := runCmd(t, run, args...)
		if code != want {
			t.Fatalf("%v: exit %d, want %d\n%s%s", args, code, want, out, errs)
		}
		return out, errs
	}
	mustRun(0, "attest", "quote", "--tpm-device", sock, "--dir", dir, "--nonce", hex.EncodeToString(nonce[:]), "-o", att)

	v := t.TempDir()
	caFile := filepath.Join(v, "ek-ca.pem")
	os.WriteFile(caFile, ca.PEM(t), 0o600)
	ch, pend, ans := filepath.Join(v, "challenge.json"), filepath.Join(v, "pending.json"), filepath.Join(v, "answer")
	node, pub := filepath.Join(v, "node.json"), filepath.Join(v, "node.pub")
	mustRun(0, "attest", "enroll", "--ek-ca", caFile, "--challenge", ch, "--pending", pend, att)

	// A wrong answer is refused, naming the AK.
	os.WriteFile(ans, []byte(strings.Repeat("00", 32)+"\n"), 0o600)
	_, errs := mustRun(1, "attest", "enroll", "--pending", pend, "--answer", ans, "-o", node)
	if !strings.Contains(errs, "REFUSED: AK:") {
		t.Errorf("wrong answer: %s", errs)
	}
	mustRun(0, "attest", "activate", "--tpm-device", sock, "-o", ans, ch)
	mustRun(0, "attest", "enroll", "--pending", pend, "--answer", ans, "-o", node, "--tpm-pub-out", pub)
	var rec attest.NodeRecord
	if err := attest.ReadJSON(node, attest.NodeFormat, &rec); err != nil {
		t.Fatal(err)
	}
	// The certified key verifies the manifest.
	mustRun(0, "verify", "--tpm-pub", pub, env)

	approved := filepath.Join(v, "approved.json")
	ap, _ := json.Marshal(attest.Approved{Format: attest.ApprovedFormat,
		Authenticode: []attest.HexBytes{make([]byte, 32)}, PCR11: []attest.HexBytes{make([]byte, 32)},
		DBCertificates: []string{string(ca.PEM(t))}})
	os.WriteFile(approved, ap, 0o600)
	_, errs = mustRun(1, "verify", "--tpm-pub", pub, "--attest", att, "--node", node, "--ek-ca", caFile, "--approved", approved, env)
	if !strings.Contains(errs, "REFUSED: attestation") || !strings.Contains(errs, "firmware event log: empty") {
		t.Errorf("verify --attest: %s", errs)
	}
	// Another nonce than the one the node quoted.
	_, errs = mustRun(1, "verify", "--tpm-pub", pub, "--attest", att, "--node", node, "--ek-ca", caFile, "--approved", approved, "--nonce", "0011", env)
	if !strings.Contains(errs, "quote: made for nonce") {
		t.Errorf("verify --attest --nonce: %s", errs)
	}
	// --attest without what it is checked against is a usage error.
	mustRun(2, "verify", "--tpm-pub", pub, "--attest", att, env)

	// A verifier that issues nonces: the node quotes over one it issued; the TPM checks
	// pass (the firmware log is what refuses here), and the nonce is then used up.
	store := filepath.Join(v, "nonces.json")
	out, _ := mustRun(0, "attest", "nonce", "--nonces", store)
	issued := strings.TrimSpace(out)
	fresh := filepath.Join(v, "fresh.attest.json")
	mustRun(0, "attest", "quote", "--tpm-device", sock, "--dir", dir, "--nonce", issued, "-o", fresh)
	verify := func(a string) string {
		_, errs := mustRun(1, "verify", "--tpm-pub", pub, "--attest", a, "--node", node, "--ek-ca", caFile, "--approved", approved, "--nonces", store, env)
		return errs
	}
	if errs := verify(fresh); !strings.Contains(errs, "firmware event log: empty") {
		t.Errorf("verify --nonces, an issued nonce: %s, want past the nonce to the firmware log", errs)
	}
	if errs := verify(fresh); !strings.Contains(errs, "nonce: "+issued+" was already used") {
		t.Errorf("the same attestation again: %s, want refused naming the nonce", errs)
	}
	if errs := verify(att); !strings.Contains(errs, "nonce: "+hex.EncodeToString(nonce[:])+" was never issued") {
		t.Errorf("an attestation over a nonce never issued: %s, want refused naming the nonce", errs)
	}
	mustRun(2, "verify", "--tpm-pub", pub, "--attest", att, "--node", node, "--ek-ca", caFile, "--approved", approved, "--nonces", store, "--nonce", issued, env)
}
