package manifest_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// insertAfter puts extra right after the first occurrence of at in b (a copy).
func insertAfter(t *testing.T, b []byte, at, extra string) []byte {
	t.Helper()
	i := bytes.Index(b, []byte(at))
	if i < 0 {
		t.Fatalf("%q not found", at)
	}
	i += len(at)
	out := append([]byte(nil), b[:i]...)
	out = append(out, extra...)
	return append(out, b[i:]...)
}

// A key given twice is read differently by different JSON parsers (first wins, last
// wins, error), so a verifier in another language could see another payload, signature
// or key id than this one verified. Verify refuses duplicates, exact or differing only
// in case (encoding/json matches keys case-insensitively), at any depth of the envelope
// and of the signed payload, and names the key.
func TestVerifyRefusesDuplicateKeys(t *testing.T) {
	m := manifesttest.B300(10)
	signed, err := Sign(context.Background(), m, testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	good := signed.Envelope
	otherBoot := `"boot_id":"00000000-0000-0000-0000-000000000000",`
	cases := []struct {
		name string
		env  []byte
		key  string
	}{
		// Go takes the last payload (the signed one); a first-wins parser reads "{}".
		{"payload twice", insertAfter(t, good, "{", `"payload":"e30=",`), "payload"},
		{"payload twice, once escaped", insertAfter(t, good, "{", `"p\u0061yload":"e30=",`), "payload"},
		{"payloadType twice", insertAfter(t, good, "{", `"payloadType":"application/json",`), "payloadType"},
		{"payload in another case", insertAfter(t, good, "{", `"Payload":"e30=",`), "Payload"},
		{"signature keyid twice", insertAfter(t, good, `"signatures": [`+"\n    {", `"keyid":"SHA256:someone-else",`), "keyid"},
		{"unknown envelope field with a duplicate inside", insertAfter(t, good, "{", `"x":{"a":1,"a":2},`), "a"},
		{"payload boot_id twice", resign(t, insertAfter(t, signed.Payload, "{", otherBoot)), "boot_id"},
		{"payload boot_id in another case", resign(t, insertAfter(t, signed.Payload, "{", strings.Replace(otherBoot, "boot_id", "Boot_ID", 1))), "Boot_ID"},
		{"payload nested key twice", resign(t, insertAfter(t, signed.Payload, `"node":{`, `"hostname":"elsewhere",`)), "hostname"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Verify(c.env, testVerifier(t, 1), VerifyOptions{})
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want %v", err, ErrMalformed)
			}
			if !strings.Contains(err.Error(), "duplicate key") || !strings.Contains(err.Error(), `"`+c.key+`"`) {
				t.Errorf("err %q does not name the duplicate key %q", err, c.key)
			}
		})
	}
	if _, err := Verify(good, testVerifier(t, 1), VerifyOptions{}); err != nil {
		t.Fatalf("the unedited envelope: %v", err)
	}
}

// A real envelope is tens of KB. Anything beyond MaxEnvelopeSize is refused before it
// is parsed, in memory and when read from a file, without reading the whole file.
func TestVerifyRefusesOversize(t *testing.T) {
	signed, err := Sign(context.Background(), manifesttest.B300(10), testSigner(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	if MaxEnvelopeSize != 16<<20 {
		t.Fatalf("MaxEnvelopeSize = %d", MaxEnvelopeSize)
	}
	pad := func(n int) []byte {
		b := append([]byte(nil), signed.Envelope...)
		return append(b, bytes.Repeat([]byte(" "), n-len(b))...)
	}
	v := testVerifier(t, 1)
	// Trailing whitespace is valid JSON: the size alone decides.
	if _, err := Verify(pad(MaxEnvelopeSize), v, VerifyOptions{}); err != nil {
		t.Fatalf("envelope of exactly the limit: %v", err)
	}
	_, err = Verify(pad(MaxEnvelopeSize+1), v, VerifyOptions{})
	if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "16 MiB") {
		t.Fatalf("envelope one byte over the limit: %v, want %v naming the 16 MiB limit", err, ErrMalformed)
	}

	dir := t.TempDir()
	ok := filepath.Join(dir, "manifest.dsse.json")
	if err := os.WriteFile(ok, signed.Envelope, 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := ReadEnvelope(ok)
	if err != nil || !bytes.Equal(b, signed.Envelope) {
		t.Fatalf("ReadEnvelope of a real envelope: %v", err)
	}
	// A 300 MB file (sparse: no disk used) is refused by its size.
	huge := filepath.Join(dir, "huge.dsse.json")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(f.Truncate(300<<20), f.Close()); err != nil {
		t.Fatal(err)
	}
	b, err = ReadEnvelope(huge)
	if err == nil || b != nil || !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), huge) || !strings.Contains(err.Error(), "16 MiB") {
		t.Fatalf("ReadEnvelope of 300 MB: %d bytes, err %v; want a refusal naming the file and the limit", len(b), err)
	}
	if _, err := ReadEnvelope(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}
