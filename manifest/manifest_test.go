package manifest_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/entropy/entropytest"
	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

func TestBuildReadsNodeIdentity(t *testing.T) {
	root := writeRoot(t, defaultRootFiles())
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("CET", 3600))
	m, err := Build(root, now)
	if err != nil {
		t.Fatal(err)
	}
	want := Node{Hostname: "b300-r07-n3", DMISerial: "S3R1AL-0042", DMIUUID: "4c4c4544-0042-3810-8057-b3c04f4b4d32",
		BoardName: "X14DBG-AP", Vendor: "Supermicro", Product: "SYS-A22GA-NBRT"}
	if m.Node != want {
		t.Errorf("node = %+v, want %+v", m.Node, want)
	}
	if m.BootID != testBootID || m.KernelRelease != "6.12.48" || !strings.Contains(m.KernelCmdline, "passage.tpm=on") {
		t.Errorf("boot/kernel = %q %q %q", m.BootID, m.KernelRelease, m.KernelCmdline)
	}
	if m.SchemaVersion != SchemaVersion || m.GenerationSource != GenerationNone {
		t.Errorf("schema %d source %q", m.SchemaVersion, m.GenerationSource)
	}
	if m.Time.Location() != time.UTC || !m.Time.Equal(now) {
		t.Errorf("time = %v, want %v in UTC", m.Time, now)
	}
}

func TestBuildWithoutDMI(t *testing.T) {
	files := defaultRootFiles()
	for k := range files {
		if strings.HasPrefix(k, "sys/") {
			delete(files, k)
		}
	}
	m, err := Build(writeRoot(t, files), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if m.Node.DMISerial != "" || m.Node.DMIUUID != "" || m.Node.Hostname != "b300-r07-n3" {
		t.Errorf("node = %+v", m.Node)
	}
}

func TestBuildNeedsBootID(t *testing.T) {
	for name, content := range map[string]*string{"missing": nil, "empty": new(string)} {
		t.Run(name, func(t *testing.T) {
			files := defaultRootFiles()
			delete(files, "proc/sys/kernel/random/boot_id")
			if content != nil {
				files["proc/sys/kernel/random/boot_id"] = *content
			}
			m, err := Build(writeRoot(t, files), time.Now())
			if err == nil || !strings.Contains(err.Error(), "boot_id") {
				t.Fatalf("err = %v, want one naming boot_id", err)
			}
			// What was read stays: the DMI identity and the hostname still name the node.
			if m == nil || m.Node.DMISerial != "S3R1AL-0042" || m.Node.DMIUUID != "4c4c4544-0042-3810-8057-b3c04f4b4d32" || m.Node.Hostname != "b300-r07-n3" || m.KernelRelease != "6.12.48" {
				t.Fatalf("manifest without a boot id: %+v", m)
			}
			if _, err := Sign(context.Background(), m, testSigner(t, 1)); err != nil {
				t.Errorf("a manifest that names its node by DMI and hostname: %v", err)
			}
		})
	}
}

// TestSignNeedsIdentity: a manifest that names no node (no boot id, hostname, DMI serial
// or UUID could be read) is refused at signing, by Sign and by WriteSigned, which then
// writes no envelope; any one of the four is enough.
func TestSignNeedsIdentity(t *testing.T) {
	files := defaultRootFiles()
	for _, f := range []string{"proc/sys/kernel/random/boot_id", "proc/sys/kernel/hostname", "sys/class/dmi/id/product_serial", "sys/class/dmi/id/product_uuid"} {
		delete(files, f)
	}
	m, err := Build(writeRoot(t, files), time.Now())
	if m == nil || err == nil {
		t.Fatalf("Build: %+v, %v", m, err)
	}
	if s, err := Sign(context.Background(), m, testSigner(t, 1)); s != nil || err == nil || !strings.Contains(err.Error(), "no node identity") {
		t.Fatalf("Sign: %+v, %v; want refused for no node identity", s, err)
	}
	unset := *m
	unset.Node.Hostname = "(none)" // the kernel's before anything sets one
	if s, err := Sign(context.Background(), &unset, testSigner(t, 1)); s != nil || err == nil {
		t.Fatalf("Sign with hostname (none): %+v, %v; want refused", s, err)
	}
	dir := t.TempDir()
	if s, err := WriteSigned(context.Background(), m, dir, "m.dsse.json", nil, testSigner(t, 1)); s != nil || err == nil {
		t.Fatalf("WriteSigned: %+v, %v", s, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "m.dsse.json")); !os.IsNotExist(err) {
		t.Errorf("an envelope was written: %v", err)
	}
	for name, set := range map[string]func(m *Manifest){
		"boot id":    func(m *Manifest) { m.BootID = testBootID },
		"hostname":   func(m *Manifest) { m.Node.Hostname = "n3" },
		"dmi serial": func(m *Manifest) { m.Node.DMISerial = "S3R1AL-0042" },
		"dmi uuid":   func(m *Manifest) { m.Node.DMIUUID = "4c4c4544-0042-3810-8057-b3c04f4b4d32" },
	} {
		c := *m
		set(&c)
		if _, err := Sign(context.Background(), &c, testSigner(t, 1)); err != nil {
			t.Errorf("with only a %s: %v", name, err)
		}
	}
}

func TestMarshalCanonical(t *testing.T) {
	m := manifesttest.B300(7)
	a, err := Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Marshal(m)
	if !bytes.Equal(a, b) {
		t.Fatal("two marshals of one manifest differ")
	}
	if !bytes.HasPrefix(a, []byte(fmt.Sprintf(`{"schema_version":%d,"build":{"version":"v1.4.0","revision":"3f2a9c1d5e7b8a604f1c2d3e4b5a69788c9d0e1f","modified":false,"go_version":"go1.26.0"},"node":{"hostname":`, SchemaVersion))) {
		t.Errorf("key order: payload starts %q", a[:60])
	}
	back, err := Unmarshal(a)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := Marshal(back)
	if !bytes.Equal(a, c) {
		t.Errorf("marshal(unmarshal(p)) != p:\n%s\n%s", a, c)
	}
	// nil slices are [] so consumers never see null, and the caller's manifest is untouched.
	empty := &Manifest{SchemaVersion: 1, Units: []Unit{{ID: "gpu0"}}}
	p, _ := Marshal(empty)
	for _, key := range []string{`"units":[{`, `"reasons":[]`, `"functions":[]`, `"stages":[]`, `"errors":[]`} {
		if !bytes.Contains(p, []byte(key)) {
			t.Errorf("payload %s lacks %s", p, key)
		}
	}
	if empty.Units[0].Reasons != nil {
		t.Error("Marshal wrote into the caller's manifest")
	}
	if Digest(a) == Digest(p) || !strings.HasPrefix(Digest(a), "sha256:") || len(Digest(a)) != 71 {
		t.Errorf("digest %q", Digest(a))
	}
}

func TestRoundTripEd25519(t *testing.T) {
	m := manifesttest.B300(42)
	signed, err := Sign(context.Background(), m, testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	v, err := Verify(signed.Envelope, testVerifier(t, 1), VerifyOptions{MinGeneration: 42, BootID: testBootID})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(v.Payload, signed.Payload) || v.Digest != signed.Digest {
		t.Error("verified payload differs from the signed one")
	}
	if v.Manifest.Generation != 42 || len(v.Manifest.Units) != 8 || len(v.Manifest.Units[3].Functions) != 4 {
		t.Errorf("manifest = gen %d, %d units", v.Manifest.Generation, len(v.Manifest.Units))
	}
	// The envelope is plain DSSE: keyid and payloadType as the spec names them.
	var raw map[string]any
	if err := json.Unmarshal(signed.Envelope, &raw); err != nil {
		t.Fatal(err)
	}
	if raw["payloadType"] != PayloadType {
		t.Errorf("payloadType = %v", raw["payloadType"])
	}
	kid, _ := testSigner(t, 1).KeyID()
	if !strings.HasPrefix(kid, "SHA256:") || !bytes.Contains(signed.Envelope, []byte(kid)) {
		t.Errorf("keyid %q not in envelope", kid)
	}
}

// resign signs arbitrary payload bytes with the test key, for cases Marshal cannot produce.
func resign(t *testing.T, payload []byte) []byte {
	t.Helper()
	s, err := SignPayload(context.Background(), payload, testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	return s.Envelope
}

func editEnvelope(t *testing.T, env []byte, edit func(e *Envelope)) []byte {
	t.Helper()
	var e Envelope
	if err := json.Unmarshal(env, &e); err != nil {
		t.Fatal(err)
	}
	edit(&e)
	b, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestVerifyRejects(t *testing.T) {
	m := manifesttest.B300(10)
	signed, err := Sign(context.Background(), m, testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	good := signed.Envelope
	editedPayload := bytes.Replace(signed.Payload, []byte(`"driver_after":"vfio-pci"`), []byte(`"driver_after":"nvidia"`), 1)
	if bytes.Equal(editedPayload, signed.Payload) {
		t.Fatal("edit did not change the payload")
	}
	v2 := bytes.Replace(signed.Payload, []byte(fmt.Sprintf(`"schema_version":%d`, SchemaVersion)), []byte(fmt.Sprintf(`"schema_version":%d`, SchemaVersion+1)), 1)
	noVersion := bytes.Replace(signed.Payload, []byte(fmt.Sprintf(`"schema_version":%d,`, SchemaVersion)), nil, 1)
	extraField := bytes.Replace(signed.Payload, []byte(`"errors":[]`), []byte(`"errors":[],"injected":true`), 1)

	cases := []struct {
		name string
		env  []byte
		opts VerifyOptions
		want error
	}{
		{"wrong key", good, VerifyOptions{}, ErrWrongKey},
		{"bad signature", editEnvelope(t, good, func(e *Envelope) {
			sig, _ := base64.StdEncoding.DecodeString(e.Signatures[0].Sig)
			sig[5] ^= 0x40
			e.Signatures[0].Sig = base64.StdEncoding.EncodeToString(sig)
		}), VerifyOptions{}, ErrBadSignature},
		{"payload edited", editEnvelope(t, good, func(e *Envelope) {
			e.Payload = base64.StdEncoding.EncodeToString(editedPayload)
		}), VerifyOptions{}, ErrPayloadEdited},
		{"payload edited, hint recomputed", editEnvelope(t, good, func(e *Envelope) {
			e.Payload = base64.StdEncoding.EncodeToString(editedPayload)
			e.PayloadDigest = Digest(editedPayload)
		}), VerifyOptions{}, ErrBadSignature},
		{"payload edited, hint dropped", editEnvelope(t, good, func(e *Envelope) {
			e.Payload = base64.StdEncoding.EncodeToString(editedPayload)
			e.PayloadDigest = ""
		}), VerifyOptions{}, ErrBadSignature},
		{"keyid cleared, other key", editEnvelope(t, good, func(e *Envelope) { e.Signatures[0].KeyID = "" }), VerifyOptions{}, ErrBadSignature},
		{"no signatures", editEnvelope(t, good, func(e *Envelope) { e.Signatures = nil }), VerifyOptions{}, ErrBadSignature},
		{"payload type", editEnvelope(t, good, func(e *Envelope) { e.PayloadType = "application/vnd.in-toto+json" }), VerifyOptions{}, ErrMalformed},
		{"not base64", editEnvelope(t, good, func(e *Envelope) { e.Payload = "!!" + e.Payload }), VerifyOptions{}, ErrMalformed},
		{"not json", []byte("{\"payloadType\":"), VerifyOptions{}, ErrMalformed},
		{"trailing data", append(append([]byte{}, good...), "{}"...), VerifyOptions{}, ErrMalformed},
		{"unknown schema", resign(t, v2), VerifyOptions{}, ErrUnknownSchema},
		{"no schema version", resign(t, noVersion), VerifyOptions{}, ErrUnknownSchema},
		{"unknown field", resign(t, extraField), VerifyOptions{}, ErrMalformed},
		{"replay", good, VerifyOptions{MinGeneration: 11}, ErrStaleGeneration},
		{"boot id", good, VerifyOptions{BootID: "00000000-0000-0000-0000-000000000000"}, ErrBootIDMismatch},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			seed := byte(1)
			if c.name == "wrong key" || c.name == "keyid cleared, other key" {
				seed = 2
			}
			_, err := Verify(c.env, testVerifier(t, seed), c.opts)
			if !errors.Is(err, c.want) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
			var ve *VerifyError
			if !errors.As(err, &ve) || !strings.HasPrefix(err.Error(), "manifest: ") {
				t.Errorf("err %v is not a *VerifyError", err)
			}
		})
	}
	// The same envelope passes when the expectations are met, so the failures above come
	// from the cases, not from the envelope.
	if _, err := Verify(good, testVerifier(t, 1), VerifyOptions{MinGeneration: 10, BootID: testBootID}); err != nil {
		t.Fatal(err)
	}
}

func TestVerifyTwoSignatures(t *testing.T) {
	// An envelope signed by another key and by ours verifies with ours.
	signed, err := Sign(context.Background(), manifesttest.B300(1), testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	other, _ := Sign(context.Background(), manifesttest.B300(1), testSigner(t, 3))
	var o Envelope
	json.Unmarshal(other.Envelope, &o)
	env := editEnvelope(t, signed.Envelope, func(e *Envelope) {
		e.Signatures = append(o.Signatures, e.Signatures...)
	})
	if _, err := Verify(env, testVerifier(t, 1), VerifyOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(env, testVerifier(t, 2), VerifyOptions{}); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("err = %v, want wrong key", err)
	}
}

// failingSigner is a signer whose key is gone (a TPM that stops answering).
type failingSigner struct{}

func (failingSigner) Sign(context.Context, []byte) ([]byte, error) {
	return nil, errors.New("tpm: no response")
}
func (failingSigner) KeyID() (string, error) { return "SHA256:gone", nil }

// TestSignSeveral: one envelope carries a signature per signer, each key verifies it on
// its own; a signer that fails is left out and named, and with none left there is no
// envelope.
func TestSignSeveral(t *testing.T) {
	ctx := context.Background()
	m := manifesttest.B300(1)
	signed, err := Sign(ctx, m, testSigner(t, 1), testSigner(t, 2))
	id1, _ := testSigner(t, 1).KeyID()
	id2, _ := testSigner(t, 2).KeyID()
	if err != nil || !slices.Equal(signed.KeyIDs, []string{id1, id2}) {
		t.Fatalf("two signers: %v, signed by %q", err, signed.KeyIDs)
	}
	for _, seed := range []byte{1, 2} {
		if _, err := Verify(signed.Envelope, testVerifier(t, seed), VerifyOptions{}); err != nil {
			t.Errorf("key %d: %v", seed, err)
		}
	}
	one, err := Sign(ctx, m, failingSigner{}, testSigner(t, 2))
	if one == nil || !slices.Equal(one.KeyIDs, []string{id2}) || err == nil || !strings.Contains(err.Error(), "SHA256:gone") || !strings.Contains(err.Error(), "no response") {
		t.Fatalf("a failing signer: %+v, %v; want one signature and an error naming the key", one, err)
	}
	if _, err := Verify(one.Envelope, testVerifier(t, 2), VerifyOptions{}); err != nil {
		t.Errorf("the signature that was made: %v", err)
	}
	if !bytes.Equal(one.Payload, signed.Payload) || one.Digest != signed.Digest {
		t.Error("the payload depends on who signed")
	}
	if none, err := Sign(ctx, m, failingSigner{}); none != nil || err == nil {
		t.Errorf("no signer left: %+v, %v; want no envelope", none, err)
	}
	if none, err := Sign(ctx, m); none != nil || err == nil {
		t.Errorf("no signer given: %+v, %v; want an error", none, err)
	}
}

// Flipping any bit of a valid envelope either breaks verification or leaves the same
// signed payload: no single-bit change produces a different accepted manifest. A
// one-unit manifest keeps the exhaustive walk short.
func TestVerifyBitFlips(t *testing.T) {
	m := manifesttest.B300(5)
	m.Units = m.Units[:1]
	m.Units[0].Functions = m.Units[0].Functions[:1]
	m.Units[0].ACSChanges = m.Units[0].ACSChanges[:1]
	m.GuestPlan = nil
	m.Stages = m.Stages[:1]
	signed, err := Sign(context.Background(), m, testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	v := testVerifier(t, 1)
	accepted := 0
	for i := 0; i < len(signed.Envelope); i++ {
		// Low bit and case bit, alternating: either changes a base64 or JSON character.
		for _, bit := range []byte{0x01 << (5 * (i % 2))} {
			env := append([]byte(nil), signed.Envelope...)
			env[i] ^= bit
			got, err := Verify(env, v, VerifyOptions{})
			if err != nil {
				var ve *VerifyError
				if !errors.As(err, &ve) {
					t.Fatalf("byte %d: %v is not a *VerifyError", i, err)
				}
				continue
			}
			accepted++
			if !bytes.Equal(got.Payload, signed.Payload) {
				t.Fatalf("byte %d bit %#x: accepted a different payload", i, bit)
			}
		}
	}
	// Flips in whitespace and in the unsigned hint are harmless; most flips are not.
	if accepted == 0 || accepted > len(signed.Envelope)/4 {
		t.Errorf("%d of %d flipped envelopes accepted", accepted, len(signed.Envelope))
	}
}

func TestKeygenAndLoad(t *testing.T) {
	dir := t.TempDir()
	priv, pub, err := GenerateKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(priv)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("%s mode %v, want 0600", priv, st.Mode().Perm())
	}
	s, err := LoadSigner(priv)
	if err != nil {
		t.Fatal(err)
	}
	v, err := LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	signed, err := Sign(context.Background(), manifesttest.B300(1), s)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(signed.Envelope, v, VerifyOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := GenerateKey(dir); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second keygen: err = %v, want already exists", err)
	}
	// A public key where a private key belongs, and garbage, are named errors.
	if _, err := LoadSigner(pub); err == nil || !strings.Contains(err.Error(), pub) {
		t.Errorf("LoadSigner(pub): %v", err)
	}
	junk := filepath.Join(dir, "junk.pub")
	os.WriteFile(junk, []byte("not a key"), 0o644)
	if _, err := LoadVerifier(junk); err == nil || !strings.Contains(err.Error(), junk) {
		t.Errorf("LoadVerifier(junk): %v", err)
	}
}

func TestWriteAtomic(t *testing.T) {
	dir := t.TempDir()
	for _, content := range []string{"first", "second, longer"} {
		if err := WriteAtomic(dir, "m.json", []byte(content)); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(dir, "m.json"))
		if err != nil || string(got) != content {
			t.Fatalf("read %q, %v; want %q", got, err, content)
		}
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("dir holds %d entries, want only m.json", len(ents))
	}
	for _, bad := range []string{"", "../x", "a/b"} {
		if err := WriteAtomic(dir, bad, nil); err == nil {
			t.Errorf("WriteAtomic(%q) succeeded", bad)
		}
	}
	if err := WriteAtomic(filepath.Join(dir, "missing"), "m.json", nil); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("missing dir: %v", err)
	}
}

type failingCounter struct{}

func (failingCounter) Next() (uint64, error)    { return 0, errors.New("NV index not defined") }
func (failingCounter) Source() GenerationSource { return GenerationTPMNV }

func TestGeneration(t *testing.T) {
	dir := t.TempDir()
	fc := FileCounter{Path: filepath.Join(dir, "generation")}
	var last uint64
	for i := 0; i < 3; i++ {
		n, src, err := NextGeneration(failingCounter{}, fc)
		if err != nil || src != GenerationFile || n != last+1 {
			t.Fatalf("next = %d %q %v, want %d from file", n, src, err, last+1)
		}
		last = n
	}
	n, src, err := NextGeneration(failingCounter{})
	if n != 0 || src != GenerationNone || err == nil || !strings.Contains(err.Error(), "NV index") {
		t.Errorf("no counter: %d %q %v", n, src, err)
	}
	if n, src, err := NextGeneration(); n != 0 || src != GenerationNone || err != nil {
		t.Errorf("no counters at all: %d %q %v", n, src, err)
	}
	os.WriteFile(fc.Path, []byte("seven\n"), 0o644)
	if _, err := fc.Next(); err == nil || !strings.Contains(err.Error(), fc.Path) {
		t.Errorf("corrupt counter: %v", err)
	}
}

// A key is a secret: with the pool never ready, GenerateKeyContext waits until its
// deadline, says it is waiting for the kernel's random pool, and writes nothing; with
// every process random source blocked too, it never reaches them.
func TestGenerateKeyWaitsForThePool(t *testing.T) {
	dir := t.TempDir()
	blk := entropytest.Block(t)
	pool := &entropytest.NotReady{}
	var notes []string
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	_, _, err := GenerateKeyContext(ctx, dir, pool, func(s string) { notes = append(notes, s) })
	if err == nil || !strings.Contains(err.Error(), "keygen: waiting for the kernel's random pool") || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v", err)
	}
	if len(notes) != 1 || !strings.Contains(notes[0], "waiting for the kernel's random pool") {
		t.Errorf("notes %q", notes)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 || blk.Calls() != 0 {
		t.Errorf("%d files written, %d reads from the blocked source", len(ents), blk.Calls())
	}
}

// TestVerifySchemaVersions: a verifier accepts what this release signs and what the
// releases before it signed (schema 5: no kubelet key; schema 4: no Module IDs or
// nvlink either; schema 3: no bars either; schema 2: no build either); a payload whose
// fields do not match its version is refused.
func TestVerifySchemaVersions(t *testing.T) {
	fabric := manifesttest.B300Fabric(3)
	fabric.Node.KubeletKey = manifesttest.KubeletKey
	signed, err := Sign(context.Background(), fabric, testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	v6 := signed.Payload
	v5 := schema5(t, v6)
	v4 := schema4(t, v5)
	v3 := schema3(t, v4)
	v2 := schema2(t, v3)
	retag := func(p []byte, from, to int) []byte {
		return bytes.Replace(p, []byte(fmt.Sprintf(`"schema_version":%d`, from)), []byte(fmt.Sprintf(`"schema_version":%d`, to)), 1)
	}
	if !bytes.Contains(v4, []byte(`"bars":[`)) || bytes.Contains(v3, []byte(`"bars"`)) {
		t.Fatalf("the example's schema 4 payload carries no bars, or its schema 3 copy does")
	}
	if !bytes.Contains(v5, []byte(`"module_id":5,"module_source":"profile b300: modules[0000:22:00.0]"`)) || !bytes.Contains(v5, []byte(`"nvlink":{"partitions":[[1,2,3,4,5,6,7,8],`)) ||
		bytes.Contains(v4, []byte(`"module_`)) || bytes.Contains(v4, []byte(`"nvlink"`)) {
		t.Fatalf("the schema 5 payload lacks Module IDs or nvlink, or its schema 4 copy has them:\n%s", v5)
	}
	nvStart, nvEnd := bytes.Index(v5, []byte(`"nvlink":{`)), bytes.Index(v5, []byte(`nvlink_partitions"}`))
	if nvStart < 0 || nvEnd < nvStart {
		t.Fatalf("no nvlink object in %s", v5)
	}
	nullNVLink := append(append(append([]byte{}, v5[:nvStart]...), `"nvlink":null`...), v5[nvEnd+len(`nvlink_partitions"}`):]...)
	unknown := bytes.ReplaceAll(v5, []byte(`"module_id":5,"module_source":"profile b300: modules[0000:22:00.0]"`), []byte(`"module_id":0,"module_source":""`))
	key := []byte(`,"kubelet_key":"` + manifesttest.KubeletKey + `"`)
	if !bytes.Contains(v6, key) || bytes.Contains(v5, []byte(`kubelet_key`)) {
		t.Fatalf("the schema 6 payload lacks its kubelet key, or its schema 5 copy has one:\n%s", v6)
	}
	withKey := func(v string) []byte { return bytes.Replace(v6, key, []byte(`,"kubelet_key":`+v), 1) }
	for name, tc := range map[string]struct {
		payload []byte
		want    error // nil: accepted
	}{
		"current":                           {v6, nil},
		"current without a kubelet key":     {retag(v5, 5, 6), nil},
		"current, an empty kubelet key":     {withKey(`""`), ErrMalformed},
		"current, a null kubelet key":       {withKey(`null`), ErrMalformed},
		"current, a kubelet key not sha256": {withKey(`"sha1:` + strings.Repeat("ab", 20) + `"`), ErrMalformed},
		"current, a kubelet key upper-case": {withKey(`"sha256:` + strings.ToUpper(strings.TrimPrefix(manifesttest.KubeletKey, "sha256:")) + `"`), ErrMalformed},
		"previous":                          {v5, nil},
		"previous with a kubelet key":       {retag(v6, 6, 5), ErrMalformed},
		"schema 5, a Module ID unknown":     {unknown, nil},
		"schema 5 without Module IDs":       {retag(v4, 4, 5), ErrMalformed}, // absent is not unknown
		"schema 5 without module_source":    {bytes.Replace(unknown, []byte(`,"module_source":""`), nil, 1), ErrMalformed},
		"schema 5 with a null module_id":    {bytes.Replace(unknown, []byte(`"module_id":0`), []byte(`"module_id":null`), 1), ErrMalformed},
		"schema 5 with a null nvlink":       {nullNVLink, ErrMalformed},
		"schema 4":                          {v4, nil},
		"schema 4 with Module IDs":          {retag(unknown, 5, 4), ErrMalformed},
		"schema 3 without bars":             {v3, nil},
		"schema 3 with bars":                {retag(v4, 4, 3), ErrMalformed},
		"schema 4 without bars":             {retag(v3, 3, 4), nil}, // a node without BARs read (an older kernel's tree)
		"schema 2 without build":            {v2, nil},
		"schema 2 with build":               {retag(v3, 3, 2), ErrMalformed},
		"schema 3 without build":            {retag(v2, 2, 3), ErrMalformed},
		"older than the oldest":             {retag(v2, 2, 1), ErrUnknownSchema},
		"newer than this":                   {retag(v6, 6, 7), ErrUnknownSchema},
		"a Module ID twice":                 {bytes.Replace(v5, []byte(`"module_id":6,`), []byte(`"module_id":5,`), 1), ErrContradiction},
		"a Module ID without its source":    {bytes.Replace(v5, []byte(`"module_source":"profile b300: modules[0000:22:00.0]"`), []byte(`"module_source":""`), 1), ErrContradiction},
		"a source without a Module ID":      {bytes.Replace(v5, []byte(`"module_id":5,`), []byte(`"module_id":0,`), 1), ErrContradiction},
		"a negative Module ID":              {bytes.Replace(unknown, []byte(`"module_id":0,"module_source":""`), []byte(`"module_id":-1,"module_source":""`), 1), ErrContradiction},
		"a partition naming a module twice": {bytes.Replace(v5, []byte(`[1,2],`), []byte(`[1,1],`), 1), ErrContradiction},
		"an empty partition":                {bytes.Replace(v5, []byte(`[1,2],`), []byte(`[],`), 1), ErrContradiction},
	} {
		t.Run(name, func(t *testing.T) {
			s, err := SignPayload(context.Background(), tc.payload, testSigner(t, 1))
			if err != nil {
				t.Fatal(err)
			}
			got, err := Verify(s.Envelope, testVerifier(t, 1), VerifyOptions{})
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				if (got.Manifest.SchemaVersion >= 3) != (got.Manifest.Build != nil) {
					t.Errorf("schema %d, build %+v", got.Manifest.SchemaVersion, got.Manifest.Build)
				}
				// Whatever its schema, an accepted payload marshals back to its own bytes.
				if again, err := Marshal(got.Manifest); err != nil || !bytes.Equal(again, got.Payload) {
					t.Errorf("marshals back to other bytes (%v):\n%s\n%s", err, again, got.Payload)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
		})
	}
	m5, err := Unmarshal(v5)
	if err != nil {
		t.Fatal(err)
	}
	if m6, err := Unmarshal(v6); err != nil || m6.Node.KubeletKey != manifesttest.KubeletKey {
		t.Errorf("node.kubelet_key after signing and decoding: %v %+v", err, m6)
	}
	if u := m5.Units[0]; u.ModuleID != 5 || u.ModuleSource != "profile b300: modules[0000:22:00.0]" ||
		m5.NVLink == nil || len(m5.NVLink.Partitions) != 15 || m5.NVLink.Source != "profile b300: nvlink_partitions" {
		t.Errorf("gpu0 %+v, nvlink %+v after signing and decoding", u, m5.NVLink)
	}
	gpu, err := Unmarshal(v4)
	if err != nil {
		t.Fatal(err)
	}
	if b := gpu.Units[0].Functions[0].BARs; len(b) != 3 || b[1] != (BAR{Index: 1, Size: 512 << 30, Is64: true, Prefetchable: true}) {
		t.Errorf("gpu0's BARs after signing and decoding: %+v", b)
	}
	m, err := Unmarshal(v3)
	if err != nil {
		t.Fatal(err)
	}
	if *m.Build != manifesttest.Build {
		t.Errorf("build %+v, want %+v", *m.Build, manifesttest.Build)
	}
}
