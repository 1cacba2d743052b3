package manifest_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

var updateSeeds = flag.Bool("update-seeds", false, "rewrite testdata/fuzz/FuzzVerify seeds")

// fuzzSeeds are envelopes signed by testKey(1): valid ones and the rejections of
// TestVerifyRejects, each a starting point for mutation.
func fuzzSeeds(t testing.TB) map[string][]byte {
	m := manifesttest.B300Fabric(4)
	m.Units = m.Units[:2]
	m.Units[1].ModuleID, m.Units[1].ModuleSource = 0, "" // one known, one unknown
	m.Node.KubeletKey = manifesttest.KubeletKey
	signed, err := Sign(context.Background(), m, testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	good := signed.Envelope
	sign := func(p []byte) []byte {
		s, err := SignPayload(context.Background(), p, testSigner(t, 1))
		if err != nil {
			t.Fatal(err)
		}
		return s.Envelope
	}
	other, _ := Sign(context.Background(), m, testSigner(t, 2))
	return map[string][]byte{
		"valid":           good,
		"wrong-key":       other.Envelope,
		"unknown-schema":  sign(bytes.Replace(signed.Payload, []byte(fmt.Sprintf(`"schema_version":%d`, SchemaVersion)), []byte(fmt.Sprintf(`"schema_version":%d`, SchemaVersion+1)), 1)),
		"previous-schema": sign(schema2(t, signed.Payload)),
		"edited":          bytes.Replace(good, []byte(`"payload": "eyJ`), []byte(`"payload": "eyK`), 1),
		"truncated":       good[:len(good)/2],
		"empty-object":    []byte(`{}`),
		"null-sigs":       []byte(`{"payloadType":"application/vnd.passage.manifest+json","payload":"e30=","signatures":null}`),
	}
}

// schema2 is payload as the previous image signs it: schema 2, no build.
func schema2(t testing.TB, payload []byte) []byte {
	t.Helper()
	return older(t, payload, func(m *Manifest) {
		m.SchemaVersion, m.Build = 2, nil
		stripBARs(m)
	})
}

// schema3 is a payload as the release before the previous one signed it: no
// functions' bars.
func schema3(t testing.TB, payload []byte) []byte {
	t.Helper()
	return older(t, payload, func(m *Manifest) {
		m.SchemaVersion = 3
		stripBARs(m)
	})
}

// schema5 is a payload as the previous release signed it: no kubelet key.
func schema5(t testing.TB, payload []byte) []byte {
	t.Helper()
	return older(t, payload, func(m *Manifest) {
		m.SchemaVersion, m.Node.KubeletKey = 5, ""
	})
}

// schema4 is a payload as the release before schema 5 signed it: no Module IDs, no
// nvlink.
func schema4(t testing.TB, payload []byte) []byte {
	t.Helper()
	return older(t, payload, func(m *Manifest) {
		m.SchemaVersion, m.NVLink, m.Node.KubeletKey = 4, nil, ""
		for i := range m.Units {
			m.Units[i].ModuleID, m.Units[i].ModuleSource = 0, ""
		}
	})
}

func older(t testing.TB, payload []byte, edit func(*Manifest)) []byte {
	t.Helper()
	m, err := Unmarshal(payload)
	if err != nil {
		t.Fatal(err)
	}
	edit(m)
	p, err := Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func stripBARs(m *Manifest) {
	for i := range m.Units {
		for k := range m.Units[i].Functions {
			m.Units[i].Functions[k].BARs = nil
		}
	}
}

// TestFuzzSeedsCurrent keeps the committed seeds in step with the schema and key: the
// "valid" seed must still verify, or the fuzzer would start from rejections only.
func TestFuzzSeedsCurrent(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzVerify")
	seeds := fuzzSeeds(t)
	if *updateSeeds {
		os.MkdirAll(dir, 0o755)
		for name, b := range seeds {
			content := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", b)
			if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for name, b := range seeds {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("%v (run go test -run TestFuzzSeedsCurrent -update-seeds)", err)
		}
		if want := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", b); string(got) != want {
			t.Errorf("seed %s is stale (run go test -run TestFuzzSeedsCurrent -update-seeds)", name)
		}
	}
	if _, err := Verify(seeds["valid"], testVerifier(t, 1), VerifyOptions{}); err != nil {
		t.Errorf("valid seed: %v", err)
	}
}

// FuzzVerify feeds mutated envelopes to Verify. Whatever the bytes, it returns a
// *VerifyError or a manifest; an accepted payload is canonical (every payload passage
// signs is Marshal output), so acceptance of anything else means a forged or
// mis-decoded envelope got through.
func FuzzVerify(f *testing.F) {
	for _, b := range fuzzSeeds(f) {
		f.Add(b)
	}
	v := testVerifier(f, 1)
	f.Fuzz(func(t *testing.T, env []byte) {
		got, err := Verify(env, v, VerifyOptions{})
		if err != nil {
			var ve *VerifyError
			if !errors.As(err, &ve) {
				t.Fatalf("error %v is not a *VerifyError", err)
			}
			return
		}
		again, err := Marshal(got.Manifest)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, got.Payload) {
			t.Fatalf("accepted a non-canonical payload:\n%s\n%s", got.Payload, again)
		}
		if got.Digest != Digest(got.Payload) {
			t.Fatal("digest does not match the payload")
		}
	})
}
