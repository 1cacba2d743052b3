package tpmkey

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"path/filepath"
	"testing"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// openSim starts the (process-global) simulator; a test that needs a reboot calls
// sim.Reset and then New again.
func openSim(t testing.TB) (*simulator.Simulator, *TPM) {
	t.Helper()
	sim, err := simulator.Get()
	if err != nil {
		t.Fatal(err)
	}
	k, err := New(transport.FromReadWriteCloser(sim))
	if err != nil {
		sim.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { k.Close() })
	return sim, k
}

// reboot resets the simulator as a power cycle would and loads the key again.
func reboot(t *testing.T, sim *simulator.Simulator, k *TPM) *TPM {
	t.Helper()
	if err := sim.Reset(); err != nil {
		t.Fatal(err)
	}
	k2, err := New(transport.FromReadWriteCloser(sim))
	if err != nil {
		t.Fatal(err)
	}
	*k = *k2 // the cleanup registered by openSim closes whichever is current
	return k
}

func TestRoundTripTPM(t *testing.T) {
	_, k := openSim(t)
	signed, err := manifest.Sign(context.Background(), manifesttest.B300(3), k)
	if err != nil {
		t.Fatal(err)
	}
	// The verifier gets the key the way a hypervisor does: from tpm-pubkey's PEM.
	pemBytes, err := k.PublicKeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	v, err := manifest.ParsePublicKey(pemBytes)
	if err != nil {
		t.Fatal(err)
	}
	got, err := manifest.Verify(signed.Envelope, v, manifest.VerifyOptions{MinGeneration: 3, BootID: manifesttest.BootID})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Payload, signed.Payload) || len(got.Manifest.Units) != 8 {
		t.Error("verified payload differs from the signed one")
	}

	// The same envelope fails against an ed25519 key, and with an edited payload.
	other, _ := manifest.NewVerifier(ed25519.NewKeyFromSeed(make([]byte, 32)).Public())
	if _, err := manifest.Verify(signed.Envelope, other, manifest.VerifyOptions{}); !errors.Is(err, manifest.ErrWrongKey) {
		t.Errorf("other key: %v, want wrong key", err)
	}
	var env manifest.Envelope
	json.Unmarshal(signed.Envelope, &env)
	env.Payload = base64.StdEncoding.EncodeToString(bytes.Replace(signed.Payload, []byte(`"generation":3`), []byte(`"generation":9`), 1))
	edited, _ := json.Marshal(env)
	if _, err := manifest.Verify(edited, v, manifest.VerifyOptions{}); !errors.Is(err, manifest.ErrPayloadEdited) {
		t.Errorf("edited: %v, want payload edited", err)
	}
}

func TestSameKeyEveryBoot(t *testing.T) {
	sim, k := openSim(t)
	before := k.Public().(*ecdsa.PublicKey)
	idBefore, _ := k.KeyID()
	reboot(t, sim, k)
	after := k.Public().(*ecdsa.PublicKey)
	if !before.Equal(after) {
		t.Fatal("signing key changed across a reboot")
	}
	idAfter, _ := k.KeyID()
	if idBefore != idAfter || idAfter == "" {
		t.Errorf("key id %q -> %q", idBefore, idAfter)
	}
	// A key signed before the reboot verifies with the key loaded after it.
	signed, _ := manifest.Sign(context.Background(), manifesttest.B300(1), k)
	v, _ := manifest.NewVerifier(before)
	if _, err := manifest.Verify(signed.Envelope, v, manifest.VerifyOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestMeasureAndReplay(t *testing.T) {
	sim, k := openSim(t)
	if len(k.Banks()) == 0 {
		t.Fatal("no PCR banks")
	}
	dir := t.TempDir()
	const name = "manifest.dsse.json"
	check := func(wantEvents int) {
		t.Helper()
		l, err := manifest.ReadEventLog(filepath.Join(dir, name+manifest.EventLogSuffix))
		if err != nil {
			t.Fatal(err)
		}
		if len(l.Events) != wantEvents || l.PCR != PCR {
			t.Fatalf("log has %d events for PCR %d, want %d for %d", len(l.Events), l.PCR, wantEvents, PCR)
		}
		want, err := l.Replay()
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range k.Banks() {
			got, err := k.ReadPCR(b)
			if err != nil {
				t.Fatal(err)
			}
			if hex.EncodeToString(got) != want[b] {
				t.Errorf("PCR %d %s = %x, replay gives %s", PCR, b, got, want[b])
			}
		}
		// The log names the manifest now on disk.
		env, _ := manifest.ReadEventLog(filepath.Join(dir, name+manifest.EventLogSuffix))
		last := env.Events[len(env.Events)-1]
		if last.Manifest != name || last.PayloadDigest == "" {
			t.Errorf("last event %+v", last)
		}
	}
	m := manifesttest.B300(1)
	for i := 1; i <= 2; i++ {
		m.Generation = uint64(i)
		if _, err := manifest.WriteSigned(context.Background(), m, dir, name, k, k); err != nil {
			t.Fatal(err)
		}
		check(i)
	}
	// After a reboot the PCR is back to zero and the old boot's log must not be replayed.
	reboot(t, sim, k)
	m.BootID = "11111111-2222-3333-4444-555555555555"
	m.Generation = 3
	if _, err := manifest.WriteSigned(context.Background(), m, dir, name, k, k); err != nil {
		t.Fatal(err)
	}
	check(1)
}

func TestNVCounter(t *testing.T) {
	sim, k := openSim(t)
	var last uint64
	for i := 0; i < 3; i++ {
		n, err := k.Next()
		if err != nil {
			t.Fatal(err)
		}
		if i > 0 && n <= last {
			t.Fatalf("counter went %d -> %d", last, n)
		}
		last = n
	}
	reboot(t, sim, k)
	gen, src, err := manifest.NextGeneration(k, manifest.FileCounter{Path: filepath.Join(t.TempDir(), "generation")})
	if err != nil || src != manifest.GenerationTPMNV || gen <= last {
		t.Fatalf("after reboot: %d %q %v, want > %d from tpm-nv", gen, src, err, last)
	}
}

// BenchmarkSignWriteMeasureTPM is the TPM flavour of the boot stage's manifest step for a
// B300 node: generation from the NV counter, sign in the TPM, atomic write, event log,
// PCR extend. The simulator runs in-process, so this measures our overhead plus the
// reference TPM's crypto, not a discrete TPM's bus latency.
func BenchmarkSignWriteMeasureTPM(b *testing.B) {
	_, k := openSim(b)
	dir := b.TempDir()
	m := manifesttest.B300(1)
	for b.Loop() {
		gen, src, err := manifest.NextGeneration(k)
		if err != nil {
			b.Fatal(err)
		}
		m.Generation, m.GenerationSource = gen, src
		if _, err := manifest.WriteSigned(context.Background(), m, dir, "manifest.dsse.json", k, k); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkVerifyTPM(b *testing.B) {
	_, k := openSim(b)
	signed, err := manifest.Sign(context.Background(), manifesttest.B300(1), k)
	if err != nil {
		b.Fatal(err)
	}
	v, err := manifest.NewVerifier(k.Public())
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := manifest.Verify(signed.Envelope, v, manifest.VerifyOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}

// TestRandom: the TPM's generator answers as many bytes as asked, over several
// TPM2_GetRandom commands when one answer is not enough, and not the same twice.
func TestRandom(t *testing.T) {
	_, k := openSim(t)
	a, err := k.Random(200)
	if err != nil {
		t.Fatal(err)
	}
	b, err := k.Random(200)
	if err != nil {
		t.Fatal(err)
	}
	if len(a) != 200 || len(b) != 200 || bytes.Equal(a, b) {
		t.Errorf("%d and %d bytes, equal %v", len(a), len(b), bytes.Equal(a, b))
	}
}
