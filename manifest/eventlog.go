package manifest

import (
	"context"
	"crypto"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"os"
	"path/filepath"
	"sort"
)

// EventLogFormat names the event log's layout (tcglog.go): a replaying verifier checks it.
const EventLogFormat = "TCG PC Client crypto-agile event log"

// EventLogSuffix is appended to the manifest's file name to name its event log.
const EventLogSuffix = ".eventlog.bin"

// EventLog records every manifest measured into the PCR during one boot, in extend
// order, so a verifier holding a TPM quote of that PCR can replay it (see Replay) and
// tie the quote to the manifests. PCRs reset at reboot, so a log whose boot_id is not the
// current one is started afresh rather than appended to. On disk it is a TCG PC Client
// crypto-agile log (tcglog.go), which any verifier of firmware logs replays; EventLog is
// its decoded view.
type EventLog struct {
	Format string
	BootID string
	PCR    int
	Events []Event
}

// Event is one extend: the manifest's generation and file, its payload digest, and the
// digest extended into each PCR bank (the payload hashed with that bank's algorithm).
type Event struct {
	Generation    uint64
	Manifest      string
	PayloadDigest string
	Digests       map[string]string // bank ("sha256") -> hex
}

// Measurer extends a PCR; the TPM implementation is manifest/tpmkey.
type Measurer interface {
	// PCR is the index extended.
	PCR() int
	// Banks are the hash algorithms of the PCR banks to extend ("sha1", "sha256", ...).
	Banks() []string
	// Extend extends PCR() in each bank with the digest given for it.
	Extend(digests map[string][]byte) error
}

var bankHashes = map[string]crypto.Hash{
	"sha1":   crypto.SHA1,
	"sha256": crypto.SHA256,
	"sha384": crypto.SHA384,
	"sha512": crypto.SHA512,
}

func newHash(bank string) (hash.Hash, error) {
	switch bank {
	case "sha1":
		return sha1.New(), nil
	case "sha256":
		return sha256.New(), nil
	case "sha384":
		return sha512.New384(), nil
	case "sha512":
		return sha512.New(), nil
	}
	return nil, fmt.Errorf("unknown PCR bank %q", bank)
}

// BankDigests hashes payload with each bank's algorithm.
func BankDigests(payload []byte, banks []string) (map[string][]byte, error) {
	out := make(map[string][]byte, len(banks))
	for _, b := range banks {
		h, err := newHash(b)
		if err != nil {
			return nil, err
		}
		h.Write(payload)
		out[b] = h.Sum(nil)
	}
	return out, nil
}

// Replay computes the PCR value each bank must hold after the logged extends, starting
// from the all-zero reset value. Nothing else on passage's boot path extends the PCR
// (see SCHEMA.md), so a quote that differs means the log or the manifests are not what
// was measured. A log cut short by a crash has the last event logged but not extended:
// compare the quote with Replay of each prefix (ReplayPrefix).
func (l *EventLog) Replay() (map[string]string, error) {
	return l.ReplayPrefix(len(l.Events))
}

// ReplayPrefix replays the first n events.
func (l *EventLog) ReplayPrefix(n int) (map[string]string, error) {
	if l.Format != EventLogFormat {
		return nil, fmt.Errorf("event log: format %q, want %q", l.Format, EventLogFormat)
	}
	if n < 0 || n > len(l.Events) {
		return nil, fmt.Errorf("event log: prefix %d of %d events", n, len(l.Events))
	}
	banks := map[string][]byte{}
	for i, ev := range l.Events[:n] {
		if i == 0 {
			for b := range ev.Digests {
				h, ok := bankHashes[b]
				if !ok {
					return nil, fmt.Errorf("event log: event %d: unknown PCR bank %q", i, b)
				}
				banks[b] = make([]byte, h.Size())
			}
		}
		if len(ev.Digests) != len(banks) {
			return nil, fmt.Errorf("event log: event %d: %d banks, first event had %d", i, len(ev.Digests), len(banks))
		}
		for b, pcr := range banks {
			d, err := hex.DecodeString(ev.Digests[b])
			if err != nil || len(d) != len(pcr) {
				return nil, fmt.Errorf("event log: event %d: bad %s digest %q", i, b, ev.Digests[b])
			}
			h, _ := newHash(b)
			h.Write(pcr)
			h.Write(d)
			banks[b] = h.Sum(nil)
		}
	}
	out := make(map[string]string, len(banks))
	for b, v := range banks {
		out[b] = hex.EncodeToString(v)
	}
	return out, nil
}

// ReadEventLog reads an event log file.
func ReadEventLog(path string) (*EventLog, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("event log %s: %w", path, err)
	}
	l, err := ParseEventLog(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return l, nil
}

// ParseEventLog parses an event log's content (an attestation carries it).
func ParseEventLog(b []byte) (*EventLog, error) {
	return parseTCG(b)
}

// appendEvent adds ev to dir/name, starting a new log when the file is missing,
// unreadable, or from another boot (or PCR): a stale log cannot replay this boot's PCR.
func appendEvent(dir, name, bootID string, pcr int, ev Event) error {
	// A missing or unreadable log is replaced rather than fatal: the manifest is already
	// written, and a log that cannot be read could not replay this boot's PCR anyway.
	l, err := ReadEventLog(filepath.Join(dir, name))
	if err != nil || l.BootID != bootID || l.PCR != pcr || len(l.Events) == 0 {
		l = &EventLog{Format: EventLogFormat, BootID: bootID, PCR: pcr}
	}
	l.Events = append(l.Events, ev)
	b, err := l.marshalTCG()
	if err != nil {
		return fmt.Errorf("event log %s: %w", filepath.Join(dir, name), err)
	}
	return WriteAtomic(dir, name, b)
}

// WriteSigned is the boot stage's last step: sign m with each of signers (SignPayload),
// write the envelope atomically to dir/name and, when meas is not nil, log and extend the
// payload digest. The event is logged before the PCR is extended, so a crash in between
// leaves a log one event ahead of the PCR (a verifier matches a prefix) rather than a PCR
// nobody can explain. With a non-nil error the envelope may still have been written: the
// returned Signed says so (a signer that failed, a measurement that failed).
func WriteSigned(ctx context.Context, m *Manifest, dir, name string, meas Measurer, signers ...Signer) (*Signed, error) {
	signed, signErr := Sign(ctx, m, signers...)
	if signed == nil {
		return nil, signErr
	}
	if err := WriteAtomic(dir, name, signed.Envelope); err != nil {
		return nil, fmt.Errorf("manifest: %w", err)
	}
	if meas == nil {
		return signed, signErr
	}
	banks := append([]string(nil), meas.Banks()...)
	sort.Strings(banks)
	digests, err := BankDigests(signed.Payload, banks)
	if err != nil {
		return signed, errors.Join(signErr, fmt.Errorf("manifest: measure: %w", err))
	}
	ev := Event{Generation: m.Generation, Manifest: name, PayloadDigest: signed.Digest, Digests: map[string]string{}}
	for b, d := range digests {
		ev.Digests[b] = hex.EncodeToString(d)
	}
	if err := appendEvent(dir, name+EventLogSuffix, m.BootID, meas.PCR(), ev); err != nil {
		return signed, errors.Join(signErr, fmt.Errorf("manifest: measure: %w", err))
	}
	if err := meas.Extend(digests); err != nil {
		return signed, errors.Join(signErr, fmt.Errorf("manifest: measure: PCR %d: %w", meas.PCR(), err))
	}
	return signed, signErr
}
