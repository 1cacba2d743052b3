package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	goattest "github.com/google/go-attestation/attest"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/attest/verifiertest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// TestAttestNonceHeals: passage attest nonce on a store file that is not one (here over
// its bound) sets it aside and issues, instead of failing until someone deletes it.
func TestAttestNonceHeals(t *testing.T) {
	store := filepath.Join(t.TempDir(), "nonces.json")
	if err := os.WriteFile(store, []byte(strings.Repeat("x", attest.MaxFile+1)), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errs := runCmd(t, run, "attest", "nonce", "--nonces", store)
	if n, err := hex.DecodeString(strings.TrimSpace(out)); code != 0 || err != nil || len(n) != attest.NonceSize {
		t.Fatalf("attest nonce on an oversize store: exit %d %q %s", code, out, errs)
	}
	if fi, err := os.Stat(store + ".bad"); err != nil || fi.Size() != attest.MaxFile+1 {
		t.Errorf("the oversize store is not kept aside: %v", err)
	}
	if !strings.Contains(errs, "set aside as "+store+".bad") {
		t.Errorf("attest nonce did not say it set the store aside: %q", errs)
	}
}

// firmwareNode is a swtpm whose firmware PCRs are those of a real OVMF Secure Boot
// (attest/testdata: the log's every measurement extended again), enrolled, so that
// verify --attest accepts its attestations: the firmware log is the real one.
type firmwareNode struct {
	sock, dir, node, pub, caFile, approved string
}

func bootFirmwareNode(t *testing.T) (*firmwareNode, *tpmkey.TPM) {
	t.Helper()
	raw, err := os.ReadFile("../../attest/testdata/ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	el, err := goattest.ParseEventLog(raw)
	if err != nil {
		t.Fatal(err)
	}
	ca := attesttest.NewCA(t)
	n := &firmwareNode{sock: attesttest.StartSocket(t, ca), dir: t.TempDir()}
	k, err := tpmkey.Open(n.sock)
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range el.Events(goattest.HashSHA256) {
		if ev.Type == 3 { // EV_NO_ACTION: logged, never extended (PC Client PFP 10.4.1)
			continue
		}
		if err := extend(k.Transport(), ev.Index, ev.Digest); err != nil {
			t.Fatalf("replaying the OVMF log: PCR %d: %v", ev.Index, err)
		}
	}
	v := t.TempDir()
	n.node, n.pub, n.caFile, n.approved = filepath.Join(v, "node.json"), filepath.Join(v, "node.pub"), filepath.Join(v, "ek-ca.pem"), "../../attest/testdata/ovmf-secureboot.approved.json"
	os.WriteFile(n.caFile, ca.PEM(t), 0o600)
	n.write(t, k, 1)
	rec, _ := verifiertest.Enrol(t, k.Transport(), ca, n.collect(t, k, nil))
	if err := writeJSON(n.node, rec); err != nil {
		t.Fatal(err)
	}
	pemBytes, err := rec.SigningKeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(n.pub, pemBytes, 0o600)
	return n, k
}

func extend(tpm transport.TPM, pcr int, digest []byte) error {
	_, err := tpm2.PCRExtend{
		PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(pcr), Auth: tpm2.PasswordAuth(nil)},
		Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: digest}}},
	}.Execute(tpm)
	return err
}

// write signs generation gen (measured into PCR 13 and logged) and keeps a copy of its
// envelope: the path verify reads.
func (n *firmwareNode) write(t *testing.T, k *tpmkey.TPM, gen uint64) string {
	t.Helper()
	if _, err := manifest.WriteSigned(context.Background(), manifesttest.B300(gen), n.dir, "manifest.dsse.json", k, k); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(n.dir, "manifest.dsse.json"))
	if err != nil {
		t.Fatal(err)
	}
	env := filepath.Join(t.TempDir(), fmt.Sprintf("gen%d.dsse.json", gen))
	os.WriteFile(env, b, 0o600)
	return env
}

// collect is the node's attestation now, over nonce (nil: the newest manifest's
// payload digest), with the OVMF firmware log.
func (n *firmwareNode) collect(t *testing.T, k *tpmkey.TPM, nonce []byte) *attest.Attestation {
	t.Helper()
	fw, _ := os.ReadFile("../../attest/testdata/ovmf-secureboot.log")
	pl, err := os.ReadFile(filepath.Join(n.dir, "manifest.dsse.json"+manifest.EventLogSuffix))
	if err != nil {
		t.Fatal(err)
	}
	if nonce == nil {
		var env struct{ Payload []byte }
		b, _ := os.ReadFile(filepath.Join(n.dir, "manifest.dsse.json"))
		if err := json.Unmarshal(b, &env); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(env.Payload)
		nonce = sum[:]
	}
	a, err := attest.Collect(k.Transport(), tpmkey.Template(), nonce, attest.Evidence{FirmwareLog: fw, PassageLog: pl})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func (n *firmwareNode) save(t *testing.T, a *attest.Attestation) string {
	t.Helper()
	b, err := a.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "a"+attest.Suffix)
	os.WriteFile(p, b, 0o600)
	return p
}

func (n *firmwareNode) verify(env, att string, more ...string) (int, string, string) {
	args := append([]string{"verify", "--tpm-pub", n.pub, "--attest", att, "--node", n.node, "--ek-ca", n.caFile, "--approved", n.approved}, more...)
	var out, errs strings.Builder
	code := run(append(args, env), &out, &errs)
	return code, out.String(), errs.String()
}

// TestVerifyUpdateNodeConcurrent: two verify --update-node of one node at once, of
// generations 2 and 3 (both read the record at generation 1 before either writes), leave
// the record at 3 every time: the one that would roll it back to 2 is refused, naming
// the generations. Repeated, since before the record was locked about half the runs
// rolled it back.
func TestVerifyUpdateNodeConcurrent(t *testing.T) {
	n, k := bootFirmwareNode(t)
	env2 := n.write(t, k, 2)
	att2 := n.save(t, n.collect(t, k, nil))
	env3 := n.write(t, k, 3)
	att3 := n.save(t, n.collect(t, k, nil))
	k.Close()
	if code, out, errs := n.verify(env3, att3); code != 0 || !strings.Contains(out, "Secure Boot by") {
		t.Fatalf("verify --attest of generation 3: exit %d\n%s%s", code, out, errs)
	}
	start, err := os.ReadFile(n.node)
	if err != nil {
		t.Fatal(err)
	}
	refused, locked := 0, 0
	for i := 0; i < 10; i++ {
		if err := os.WriteFile(n.node, start, 0o600); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		codes, errs := make([]int, 2), make([]string, 2)
		for j, c := range [][2]string{{env3, att3}, {env2, att2}} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				codes[j], _, errs[j] = n.verify(c[0], c[1], "--update-node")
			}()
		}
		wg.Wait()
		var rec attest.NodeRecord
		if err := attest.ReadJSON(n.node, attest.NodeFormat, &rec); err != nil {
			t.Fatal(err)
		}
		if rec.Seen.Generation != 3 || codes[0] != 0 {
			t.Fatalf("run %d: record at generation %d after verifies of 3 (exit %d) and 2 (exit %d)\n%s%s", i, rec.Seen.Generation, codes[0], codes[1], errs[0], errs[1])
		}
		switch codes[1] {
		case 0: // generation 2 recorded first, then 3
		case 1:
			refused++
			if strings.Contains(errs[1], "REFUSED: --update-node") {
				locked++
			}
			// Refused by the record read after 3's write: at the start (the attestation's
			// own check) or under the lock (--update-node).
			if !strings.Contains(errs[1], "REFUSED: ") || !strings.Contains(errs[1], "generation 2 is older than 3") {
				t.Errorf("run %d: generation 2 refused without saying why: %s", i, errs[1])
			}
		default:
			t.Fatalf("run %d: verify of generation 2: exit %d %s", i, codes[1], errs[1])
		}
	}
	t.Logf("10 runs: generation 2 refused in %d (%d of them by the record read again under its lock), recorded before 3 in the others", refused, locked)
}

// TestVerifyNonceFutureDated: through verify --attest --nonces, an attestation over a
// nonce the store issued while its clock ran a day ahead is refused once the clock is
// back (before, it stayed good until the clock caught up); the store's other nonces
// stay good.
func TestVerifyNonceFutureDated(t *testing.T) {
	n, k := bootFirmwareNode(t)
	env := n.write(t, k, 2)
	store := filepath.Join(t.TempDir(), "nonces.json")
	ahead, err := (&attest.NonceStore{Path: store, Now: func() time.Time { return time.Now().Add(23 * time.Hour) }}).Issue()
	if err != nil {
		t.Fatal(err)
	}
	code, out, _ := runCmd(t, run, "attest", "nonce", "--nonces", store)
	good, err := hex.DecodeString(strings.TrimSpace(out))
	if code != 0 || err != nil {
		t.Fatalf("attest nonce: exit %d %q", code, out)
	}
	attAhead := n.save(t, n.collect(t, k, ahead))
	attGood := n.save(t, n.collect(t, k, good))
	k.Close()
	code, _, errs := n.verify(env, attAhead, "--nonces", store)
	if code != 1 || !strings.Contains(errs, "nonce: "+hex.EncodeToString(ahead)) || !strings.Contains(errs, "ahead of this verifier's clock") {
		t.Errorf("a nonce dated 23h ahead: exit %d %s, want refused naming it", code, errs)
	}
	if code, out, errs := n.verify(env, attGood, "--nonces", store); code != 0 {
		t.Errorf("an issued nonce: exit %d\n%s%s", code, out, errs)
	}
}
