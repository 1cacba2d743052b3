package manifest_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	goattest "github.com/google/go-attestation/attest"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// fakePCR extends like a TPM (new = H(old || digest)) so the log can be checked without one.
type fakePCR struct {
	vals map[string][]byte
	fail bool
}

func (f *fakePCR) PCR() int        { return 13 }
func (f *fakePCR) Banks() []string { return []string{"sha256", "sha1"} }
func (f *fakePCR) Extend(d map[string][]byte) error {
	if f.fail {
		return errors.New("TPM_RC_LOCALITY")
	}
	if f.vals == nil {
		f.vals = map[string][]byte{"sha1": make([]byte, 20), "sha256": make([]byte, 32)}
	}
	s1 := sha1.Sum(append(append([]byte{}, f.vals["sha1"]...), d["sha1"]...))
	s256 := sha256.Sum256(append(append([]byte{}, f.vals["sha256"]...), d["sha256"]...))
	f.vals["sha1"], f.vals["sha256"] = s1[:], s256[:]
	return nil
}

func TestEventLogReplay(t *testing.T) {
	dir := t.TempDir()
	const name = "manifest.dsse.json"
	logPath := filepath.Join(dir, name+EventLogSuffix)
	pcr := &fakePCR{}
	m := manifesttest.B300(1)
	var digests []string
	for gen := uint64(1); gen <= 3; gen++ {
		m.Generation = gen
		s, err := WriteSigned(context.Background(), m, dir, name, pcr, testSigner(t, 1))
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, s.Digest)
	}
	l, err := ReadEventLog(logPath)
	if err != nil {
		t.Fatal(err)
	}
	if l.BootID != testBootID || l.PCR != 13 || len(l.Events) != 3 {
		t.Fatalf("log = boot %s pcr %d, %d events", l.BootID, l.PCR, len(l.Events))
	}
	for i, ev := range l.Events {
		if ev.Generation != uint64(i+1) || ev.PayloadDigest != digests[i] || ev.Manifest != name {
			t.Errorf("event %d = %+v", i, ev)
		}
	}
	got, err := l.Replay()
	if err != nil {
		t.Fatal(err)
	}
	for bank, v := range pcr.vals {
		if got[bank] != hex.EncodeToString(v) {
			t.Errorf("%s: replay %s, PCR %x", bank, got[bank], v)
		}
	}
	// The envelope on disk is the one the last event names.
	env, _ := os.ReadFile(filepath.Join(dir, name))
	v, err := Verify(env, testVerifier(t, 1), VerifyOptions{})
	if err != nil || v.Digest != l.Events[2].PayloadDigest {
		t.Fatalf("on-disk manifest %v, digest %v vs %s", err, v, l.Events[2].PayloadDigest)
	}

	// A failed extend leaves the log one event ahead; the previous prefix still matches.
	pcr.fail = true
	m.Generation = 4
	if _, err := WriteSigned(context.Background(), m, dir, name, pcr, testSigner(t, 1)); err == nil || !strings.Contains(err.Error(), "PCR 13") {
		t.Fatalf("failed extend: err = %v", err)
	}
	l, _ = ReadEventLog(logPath)
	full, _ := l.Replay()
	prefix, _ := l.ReplayPrefix(3)
	if len(l.Events) != 4 || full["sha256"] == hex.EncodeToString(pcr.vals["sha256"]) || prefix["sha256"] != hex.EncodeToString(pcr.vals["sha256"]) {
		t.Errorf("after a failed extend: %d events; prefix should match the PCR, full log should not", len(l.Events))
	}

	// A new boot starts a new log.
	pcr.fail = false
	m.BootID = "aaaaaaaa-0000-0000-0000-000000000000"
	if _, err := WriteSigned(context.Background(), m, dir, name, pcr, testSigner(t, 1)); err != nil {
		t.Fatal(err)
	}
	if l, _ = ReadEventLog(logPath); len(l.Events) != 1 || l.BootID != m.BootID {
		t.Errorf("new boot: %d events for boot %s", len(l.Events), l.BootID)
	}
}

func TestEventLogRejects(t *testing.T) {
	cases := map[string]*EventLog{
		"format":       {Format: "other/1", Events: []Event{{Digests: map[string]string{"sha256": strings.Repeat("00", 32)}}}},
		"unknown bank": {Format: EventLogFormat, Events: []Event{{Digests: map[string]string{"md5": strings.Repeat("00", 16)}}}},
		"short digest": {Format: EventLogFormat, Events: []Event{{Digests: map[string]string{"sha256": "00"}}}},
		"bank dropped": {Format: EventLogFormat, Events: []Event{
			{Digests: map[string]string{"sha256": strings.Repeat("00", 32), "sha1": strings.Repeat("00", 20)}},
			{Digests: map[string]string{"sha256": strings.Repeat("00", 32)}},
		}},
	}
	for name, l := range cases {
		if _, err := l.Replay(); err == nil || !strings.Contains(err.Error(), "event log") {
			t.Errorf("%s: err = %v", name, err)
		}
	}
	if _, err := (&EventLog{Format: EventLogFormat}).ReplayPrefix(1); err == nil {
		t.Error("prefix past the end accepted")
	}
}

// TestSchemaExample keeps SCHEMA.md's example a valid payload of the current schema.
func TestSchemaExample(t *testing.T) {
	doc, err := os.ReadFile("SCHEMA.md")
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := bytes.Cut(doc, []byte("## Example payload"))
	if !ok {
		t.Fatal("SCHEMA.md has no example section")
	}
	_, block, ok := bytes.Cut(after, []byte("```json\n"))
	block, _, ok2 := bytes.Cut(block, []byte("```"))
	if !ok || !ok2 {
		t.Fatal("SCHEMA.md example has no json block")
	}
	m, err := Unmarshal(block)
	if err != nil {
		t.Fatalf("SCHEMA.md example: %v", err)
	}
	if m.SchemaVersion != SchemaVersion || len(m.Units) == 0 || m.GuestPlan == nil || m.Units[0].ModuleID == 0 || m.NVLink == nil {
		t.Errorf("example decoded to %+v", m)
	}
}

// TestEventLogTCGFormat: the log on disk is a TCG PC Client crypto-agile log that
// another verifier reads: go-attestation (which replays firmware logs) parses it and
// replays it to the PCR in both banks, and its events' digests are the payloads'.
func TestEventLogTCGFormat(t *testing.T) {
	dir := t.TempDir()
	const name = "manifest.dsse.json"
	pcr := &fakePCR{}
	m := manifesttest.B300(1)
	var payloads [][]byte
	for gen := uint64(1); gen <= 3; gen++ {
		m.Generation = gen
		s, err := WriteSigned(context.Background(), m, dir, name, pcr, testSigner(t, 1))
		if err != nil {
			t.Fatal(err)
		}
		payloads = append(payloads, s.Payload)
	}
	raw, err := os.ReadFile(filepath.Join(dir, name+EventLogSuffix))
	if err != nil {
		t.Fatal(err)
	}
	el, err := goattest.ParseEventLog(raw)
	if err != nil {
		t.Fatalf("go-attestation cannot parse the log: %v", err)
	}
	for _, bank := range []struct {
		name string
		h    crypto.Hash
	}{{"sha256", crypto.SHA256}, {"sha1", crypto.SHA1}} {
		events, err := el.Verify([]goattest.PCR{{Index: 13, Digest: pcr.vals[bank.name], DigestAlg: bank.h}})
		if err != nil {
			t.Fatalf("%s: go-attestation does not replay the log to the PCR: %v", bank.name, err)
		}
		if len(events) != 3 {
			t.Fatalf("%s: %d events replayed, want 3", bank.name, len(events))
		}
		for i, e := range events {
			h := bank.h.New()
			h.Write(payloads[i])
			if e.Index != 13 || uint32(e.Type) != 0x0D || !bytes.Equal(e.Digest, h.Sum(nil)) {
				t.Errorf("%s: event %d: PCR %d type %#x digest %x, want PCR 13 EV_IPL of the payload", bank.name, i, e.Index, uint32(e.Type), e.Digest)
			}
		}
	}
	// A log that does not replay: go-attestation says so for PCR 13.
	other := append([]byte(nil), pcr.vals["sha256"]...)
	other[0] ^= 1
	if _, err := el.Verify([]goattest.PCR{{Index: 13, Digest: other, DigestAlg: crypto.SHA256}}); err == nil {
		t.Error("go-attestation replayed the log to another PCR value")
	}
}

// TestEventLogParseRejects: damaged logs are refused with the reason, never a panic.
func TestEventLogParseRejects(t *testing.T) {
	dir := t.TempDir()
	if _, err := WriteSigned(context.Background(), manifesttest.B300(1), dir, "m", &fakePCR{}, testSigner(t, 1)); err != nil {
		t.Fatal(err)
	}
	good, err := os.ReadFile(filepath.Join(dir, "m"+EventLogSuffix))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ParseEventLog(good); err != nil {
		t.Fatal(err)
	}
	// Cut anywhere but between events, the log is refused; cut between them it is the
	// shorter log (here: the header alone, no event), which replays to another PCR.
	for i := 0; i < len(good); i++ {
		if l, err := ParseEventLog(good[:i]); err == nil && len(l.Events) != 0 {
			t.Fatalf("a log cut at %d of %d bytes parsed with %d events", i, len(good), len(l.Events))
		}
	}
	for _, c := range []struct {
		name string
		b    []byte
	}{
		{"json", []byte(`{"format":"passage-eventlog/1"}`)},
		{"empty", nil},
	} {
		if _, err := ParseEventLog(c.b); err == nil || !strings.Contains(err.Error(), "event log") {
			t.Errorf("%s: %v", c.name, err)
		}
	}
}
