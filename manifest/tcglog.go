package manifest

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
)

// The event log is written in the TCG PC Client Platform Firmware Profile's crypto-agile
// format (section 10.2, "Event Logging"), the format of the firmware's own log
// (/sys/kernel/security/tpm0/binary_bios_measurements), so a verifier that replays
// firmware logs (go-attestation) replays passage's too: a TCG_PCR_EVENT
// header carrying the Spec ID Event (TCG_EfiSpecIDEvent, "Spec ID Event03"), then one
// TCG_PCR_EVENT2 per manifest measured. All integers little-endian.

const (
	evNoAction = 0x00000003 // EV_NO_ACTION: the Spec ID Event, extends nothing
	// evIPL is EV_IPL, "used by the OS loader" (section 10.4.1): the digests are of the
	// measured data (the manifest payload), the event data only describes it, as
	// systemd-stub's PCR 11 events do.
	evIPL = 0x0000000D
)

var specIDSignature = [16]byte{'S', 'p', 'e', 'c', ' ', 'I', 'D', ' ', 'E', 'v', 'e', 'n', 't', '0', '3', 0}

// tpmAlgs are the TPM_ALG_IDs of the banks (TCG Algorithm Registry).
var tpmAlgs = map[string]uint16{"sha1": 0x0004, "sha256": 0x000B, "sha384": 0x000C, "sha512": 0x000D}

// eventData is an event's data: which manifest was measured, in which boot.
type eventData struct {
	BootID        string `json:"boot_id"`
	Generation    uint64 `json:"generation"`
	Manifest      string `json:"manifest"`
	PayloadDigest string `json:"payload_digest"`
}

// maxEvents bounds what a parser accepts: one event per manifest of a boot.
const maxEvents = 1 << 16

func le32(b *bytes.Buffer, v uint32) { binary.Write(b, binary.LittleEndian, v) }
func le16(b *bytes.Buffer, v uint16) { binary.Write(b, binary.LittleEndian, v) }

// Marshal is the log as WriteSigned writes it to its file, for a caller that keeps it in
// memory (attest/softtpm's load generator, which measures thousands of manifests).
func (l *EventLog) Marshal() ([]byte, error) { return l.marshalTCG() }

// marshalTCG writes l in the crypto-agile format; its banks are the first event's.
func (l *EventLog) marshalTCG() ([]byte, error) {
	var banks []string
	if len(l.Events) > 0 {
		for b := range l.Events[0].Digests {
			if _, ok := tpmAlgs[b]; !ok {
				return nil, fmt.Errorf("event log: unknown PCR bank %q", b)
			}
			banks = append(banks, b)
		}
	}
	sort.Slice(banks, func(i, j int) bool { return tpmAlgs[banks[i]] < tpmAlgs[banks[j]] })
	var spec bytes.Buffer
	spec.Write(specIDSignature[:])
	le32(&spec, 0)                  // platformClass: client
	spec.Write([]byte{0, 2, 0, 2})  // specVersionMinor 0, Major 2, errata 0, uintnSize 2 (64-bit)
	le32(&spec, uint32(len(banks))) // numberOfAlgorithms
	for _, b := range banks {
		le16(&spec, tpmAlgs[b])
		le16(&spec, uint16(bankHashes[b].Size()))
	}
	spec.WriteByte(0) // vendorInfoSize
	var out bytes.Buffer
	le32(&out, 0) // PCRIndex
	le32(&out, evNoAction)
	out.Write(make([]byte, 20)) // SHA-1 digest field, zero
	le32(&out, uint32(spec.Len()))
	out.Write(spec.Bytes())
	for i, ev := range l.Events {
		if len(ev.Digests) != len(banks) {
			return nil, fmt.Errorf("event log: event %d: %d banks, first event had %d", i, len(ev.Digests), len(banks))
		}
		data, err := json.Marshal(eventData{BootID: l.BootID, Generation: ev.Generation, Manifest: ev.Manifest, PayloadDigest: ev.PayloadDigest})
		if err != nil {
			return nil, err
		}
		le32(&out, uint32(l.PCR))
		le32(&out, evIPL)
		le32(&out, uint32(len(banks)))
		for _, b := range banks {
			d, err := hex.DecodeString(ev.Digests[b])
			if err != nil || len(d) != bankHashes[b].Size() {
				return nil, fmt.Errorf("event log: event %d: bad %s digest %q", i, b, ev.Digests[b])
			}
			le16(&out, tpmAlgs[b])
			out.Write(d)
		}
		le32(&out, uint32(len(data)))
		out.Write(data)
	}
	return out.Bytes(), nil
}

// reader reads little-endian fields, failing once past the end.
type reader struct {
	b   []byte
	err error
}

func (r *reader) next(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b) {
		r.err = errors.New("truncated")
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u32() uint32 {
	if v := r.next(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}

func (r *reader) u16() uint16 {
	if v := r.next(2); v != nil {
		return binary.LittleEndian.Uint16(v)
	}
	return 0
}

// parseTCG reads a log marshalTCG wrote: the Spec ID Event, then EV_IPL events of one PCR
// and one boot whose data passage wrote.
func parseTCG(b []byte) (*EventLog, error) {
	r := &reader{b: b}
	if pcr, typ := r.u32(), r.u32(); r.err == nil && (pcr != 0 || typ != evNoAction) {
		return nil, errors.New("event log: does not start with the Spec ID Event")
	}
	r.next(20)
	spec := &reader{b: r.next(int(r.u32()))}
	if r.err != nil {
		return nil, fmt.Errorf("event log: Spec ID Event: %v", r.err)
	}
	if sig := spec.next(16); spec.err != nil || !bytes.Equal(sig, specIDSignature[:]) {
		return nil, errors.New("event log: not a crypto-agile log (no \"Spec ID Event03\")")
	}
	spec.next(8) // platformClass, version, errata, uintnSize
	n := spec.u32()
	if spec.err != nil || n > 8 {
		return nil, fmt.Errorf("event log: Spec ID Event lists %d algorithms", n)
	}
	sizes := map[uint16]int{}
	names := map[uint16]string{}
	for range n {
		id, size := spec.u16(), spec.u16()
		for name, a := range tpmAlgs {
			if a == id && bankHashes[name].Size() == int(size) {
				names[id], sizes[id] = name, int(size)
			}
		}
		if _, ok := names[id]; !ok && spec.err == nil {
			return nil, fmt.Errorf("event log: algorithm %#04x of %d bytes is not a PCR bank passage extends", id, size)
		}
	}
	if spec.err != nil {
		return nil, fmt.Errorf("event log: Spec ID Event: %v", spec.err)
	}
	l := &EventLog{Format: EventLogFormat}
	for i := 0; len(r.b) > 0; i++ {
		if i >= maxEvents {
			return nil, fmt.Errorf("event log: more than %d events", maxEvents)
		}
		pcr, typ, count := r.u32(), r.u32(), r.u32()
		if r.err == nil && (typ != evIPL || count != uint32(len(sizes))) {
			return nil, fmt.Errorf("event log: event %d: type %#x with %d digests, want EV_IPL with %d", i, typ, count, len(sizes))
		}
		ev := Event{Digests: map[string]string{}}
		for range count {
			id := r.u16()
			size, ok := sizes[id]
			if r.err == nil && !ok {
				return nil, fmt.Errorf("event log: event %d: algorithm %#04x not in the Spec ID Event", i, id)
			}
			ev.Digests[names[id]] = hex.EncodeToString(r.next(size))
		}
		data := r.next(int(r.u32()))
		if r.err != nil {
			return nil, fmt.Errorf("event log: event %d: %v", i, r.err)
		}
		var d eventData
		if err := json.Unmarshal(data, &d); err != nil {
			return nil, fmt.Errorf("event log: event %d: data: %v", i, err)
		}
		if i == 0 {
			l.PCR, l.BootID = int(pcr), d.BootID
		} else if int(pcr) != l.PCR || d.BootID != l.BootID {
			return nil, fmt.Errorf("event log: event %d: PCR %d of boot %s after PCR %d of boot %s", i, pcr, d.BootID, l.PCR, l.BootID)
		}
		ev.Generation, ev.Manifest, ev.PayloadDigest = d.Generation, d.Manifest, d.PayloadDigest
		l.Events = append(l.Events, ev)
	}
	return l, nil
}
