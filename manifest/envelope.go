package manifest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/secure-systems-lab/go-securesystemslib/dsse"
)

// Envelope is the file passage writes: a DSSE envelope (payloadType, payload,
// signatures, as dsse.Envelope) plus one unsigned field, payloadDigest, the sha256 of the
// payload as it was signed. The signature alone cannot say whether the payload or the
// signature was altered; the hint lets Verify report "payload edited" instead of a bare
// "bad signature". It is never trusted: a forged hint only changes which error is
// reported, and DSSE readers that do not know it ignore it.
type Envelope struct {
	PayloadType   string           `json:"payloadType"`
	Payload       string           `json:"payload"`
	Signatures    []dsse.Signature `json:"signatures"`
	PayloadDigest string           `json:"payloadDigest,omitempty"`
}

// Signed is the result of Sign: the envelope bytes to write, the canonical payload inside
// it and the payload's digest (what a TPM PCR is extended with).
type Signed struct {
	Envelope []byte
	Payload  []byte
	Digest   string   // "sha256:<hex>"
	KeyIDs   []string // the keys that signed it, in signer order
}

// Sign marshals m canonically and wraps it in a DSSE envelope signed by each of signers
// (see SignPayload). A manifest that names no node (Identified) is refused: a signature
// over it would vouch for whichever node showed it.
func Sign(ctx context.Context, m *Manifest, signers ...Signer) (*Signed, error) {
	if m != nil {
		if err := m.Identified(); err != nil {
			return nil, fmt.Errorf("%w: refused to sign", err)
		}
	}
	payload, err := Marshal(m)
	if err != nil {
		return nil, err
	}
	return SignPayload(ctx, payload, signers...)
}

// SignPayload wraps already-canonical payload bytes in one DSSE envelope signed by each of
// signers in turn (the TPM key and a key file, so a hypervisor that enrolled either
// verifies it). A signer that fails is left out and named in the error: the envelope
// comes back while at least one signature is in it, nil when none is.
func SignPayload(ctx context.Context, payload []byte, signers ...Signer) (*Signed, error) {
	if len(signers) == 0 {
		return nil, errors.New("manifest: sign: no signer")
	}
	var sigs []dsse.Signature
	var ids []string
	var errs []error
	var env *dsse.Envelope
	for i, s := range signers {
		es, err := dsse.NewEnvelopeSigner(s)
		if err == nil {
			env, err = es.SignPayload(ctx, PayloadType, payload)
		}
		if err != nil {
			id, _ := s.KeyID()
			errs = append(errs, fmt.Errorf("manifest: sign with signer %d (key %q): %w", i+1, id, err))
			continue
		}
		sigs = append(sigs, env.Signatures...)
		for _, sig := range env.Signatures {
			ids = append(ids, sig.KeyID)
		}
	}
	if len(sigs) == 0 {
		return nil, errors.Join(errs...)
	}
	digest := Digest(payload)
	out := Envelope{
		PayloadType:   PayloadType,
		Payload:       base64.StdEncoding.EncodeToString(payload),
		Signatures:    sigs,
		PayloadDigest: digest,
	}
	b, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("manifest: sign: %w", err)
	}
	return &Signed{Envelope: append(b, '\n'), Payload: payload, Digest: digest, KeyIDs: ids}, errors.Join(errs...)
}

// Verification failures. Verify returns a *VerifyError whose Kind is one of these, so
// callers test with errors.Is.
var (
	ErrMalformed       = errors.New("malformed envelope")
	ErrBadSignature    = errors.New("bad signature")
	ErrWrongKey        = errors.New("signed by another key")
	ErrPayloadEdited   = errors.New("payload edited after signing")
	ErrUnknownSchema   = errors.New("unknown schema version")
	ErrStaleGeneration = errors.New("generation older than required (replay?)")
	ErrBootIDMismatch  = errors.New("boot id mismatch")
	ErrContradiction   = errors.New("payload contradicts itself")
)

// VerifyError says why a manifest was rejected.
type VerifyError struct {
	Kind   error
	Detail string
}

func (e *VerifyError) Error() string {
	if e.Detail == "" {
		return "manifest: " + e.Kind.Error()
	}
	return "manifest: " + e.Kind.Error() + ": " + e.Detail
}

func (e *VerifyError) Unwrap() error { return e.Kind }

func verr(kind error, format string, a ...any) error {
	return &VerifyError{Kind: kind, Detail: fmt.Sprintf(format, a...)}
}

// VerifyOptions are the hypervisor's expectations beyond a good signature.
type VerifyOptions struct {
	// MinGeneration rejects manifests whose generation is lower: an old manifest
	// replayed after a newer one was seen. 0 accepts any.
	MinGeneration uint64
	// BootID, when set, must equal the manifest's boot_id.
	BootID string
}

// Verified is an accepted manifest.
type Verified struct {
	Manifest *Manifest
	Payload  []byte // the signed bytes, exactly as signed
	Digest   string
	KeyID    string
}

// Verify checks envelope against v and opts and returns the manifest it carries. The
// order of checks decides which reason is reported: envelope shape, key, signature (or
// edited payload), schema version, the payload's own consistency (Check), then
// generation and boot id. The shape includes the
// size (at most MaxEnvelopeSize) and that no object gives a key twice, in the envelope
// or in the signed payload: JSON parsers disagree on which of two the document means.
func Verify(envelope []byte, v Verifier, opts VerifyOptions) (*Verified, error) {
	if len(envelope) > MaxEnvelopeSize {
		return nil, verr(ErrMalformed, "envelope is %d bytes, over the %s limit", len(envelope), sizeLimit)
	}
	// Before any decoding: a key given twice means one thing here and maybe another to
	// the next verifier.
	if err := checkUniqueKeys(envelope); err != nil {
		return nil, verr(ErrMalformed, "%v", err)
	}
	var env Envelope
	dec := json.NewDecoder(bytes.NewReader(envelope))
	if err := dec.Decode(&env); err != nil {
		return nil, verr(ErrMalformed, "%v", err)
	}
	if dec.More() {
		return nil, verr(ErrMalformed, "trailing data after the envelope")
	}
	if env.PayloadType != PayloadType {
		return nil, verr(ErrMalformed, "payloadType %q, want %q", env.PayloadType, PayloadType)
	}
	payload, err := base64.StdEncoding.DecodeString(env.Payload)
	if err != nil {
		return nil, verr(ErrMalformed, "payload: %v", err)
	}
	if len(env.Signatures) == 0 {
		return nil, verr(ErrBadSignature, "envelope has no signatures")
	}
	if len(env.Signatures) > MaxSignatures {
		// Each candidate costs a signature check: a padded envelope must not cost minutes.
		return nil, verr(ErrMalformed, "envelope has %d signatures, over the limit of %d", len(env.Signatures), MaxSignatures)
	}
	keyID, err := v.KeyID()
	if err != nil {
		return nil, fmt.Errorf("manifest: verifier key id: %w", err)
	}
	var candidates []dsse.Signature
	var others []string
	for _, s := range env.Signatures {
		if s.KeyID == "" || s.KeyID == keyID {
			candidates = append(candidates, s)
		} else {
			others = append(others, s.KeyID)
		}
	}
	if len(candidates) == 0 {
		return nil, verr(ErrWrongKey, "envelope signed by %s, verifying with %s", strings.Join(others, ", "), keyID)
	}
	ev, err := dsse.NewEnvelopeVerifier(v)
	if err != nil {
		return nil, fmt.Errorf("manifest: verifier: %w", err)
	}
	digest := Digest(payload)
	if _, _, err := ev.VerifyAndDecode(context.Background(), &dsse.Envelope{
		PayloadType: env.PayloadType,
		Payload:     env.Payload,
		Signatures:  candidates,
	}); err != nil {
		if env.PayloadDigest != "" && env.PayloadDigest != digest && validDigest(env.PayloadDigest) {
			return nil, verr(ErrPayloadEdited, "payload is %s, signed payload was %s", digest, env.PayloadDigest)
		}
		return nil, verr(ErrBadSignature, "key %s: %v", keyID, err)
	}

	if err := checkUniqueKeys(payload); err != nil {
		return nil, verr(ErrMalformed, "payload: %v", err)
	}
	var head struct {
		SchemaVersion *int `json:"schema_version"`
	}
	if err := json.Unmarshal(payload, &head); err != nil {
		return nil, verr(ErrMalformed, "payload: %v", err)
	}
	if head.SchemaVersion == nil {
		return nil, verr(ErrUnknownSchema, "payload has no schema_version")
	}
	if *head.SchemaVersion < OldestSchemaVersion || *head.SchemaVersion > SchemaVersion {
		return nil, verr(ErrUnknownSchema, "schema_version %d, this verifier knows %d to %d", *head.SchemaVersion, OldestSchemaVersion, SchemaVersion)
	}
	m, err := unmarshal(payload)
	if err != nil {
		return nil, verr(ErrMalformed, "payload: %v", err)
	}
	if err := Check(m); err != nil {
		return nil, verr(ErrContradiction, "%s", strings.ReplaceAll(err.Error(), "\n", "; "))
	}
	if m.Generation < opts.MinGeneration {
		return nil, verr(ErrStaleGeneration, "generation %d (%s), required at least %d", m.Generation, m.GenerationSource, opts.MinGeneration)
	}
	if opts.BootID != "" && m.BootID != opts.BootID {
		return nil, verr(ErrBootIDMismatch, "manifest is for boot %s, expected %s", m.BootID, opts.BootID)
	}
	return &Verified{Manifest: m, Payload: payload, Digest: digest, KeyID: keyID}, nil
}

// Unmarshal decodes a payload of a schema Verify accepts strictly: unknown fields are an
// error, since any new field comes with a new SchemaVersion, and so is a key given twice
// in one object (see Verify), or a field its schema version does not have.
func Unmarshal(payload []byte) (*Manifest, error) {
	if err := checkUniqueKeys(payload); err != nil {
		return nil, err
	}
	return unmarshal(payload)
}

// unmarshal is Unmarshal without the duplicate-key walk, for a payload already walked.
func unmarshal(payload []byte) (*Manifest, error) {
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	var m Manifest
	if err := dec.Decode(&m); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("trailing data after the manifest")
	}
	switch {
	case m.SchemaVersion < OldestSchemaVersion || m.SchemaVersion > SchemaVersion:
		return nil, fmt.Errorf("schema_version %d, want %d to %d", m.SchemaVersion, OldestSchemaVersion, SchemaVersion)
	case m.SchemaVersion >= 3 && m.Build == nil:
		return nil, fmt.Errorf("schema_version %d has no build", m.SchemaVersion)
	case m.SchemaVersion < 3 && m.Build != nil:
		return nil, fmt.Errorf("schema_version %d has no build field, the payload gives one", m.SchemaVersion)
	case m.SchemaVersion < 4:
		for _, u := range m.Units {
			for _, f := range u.Functions {
				if f.BARs != nil {
					return nil, fmt.Errorf("schema_version %d has no bars field, the payload gives one for %s", m.SchemaVersion, f.BDF)
				}
			}
		}
	}
	if err := checkModuleFields(payload, &m); err != nil {
		return nil, err
	}
	if err := checkKubeletKey(payload, &m); err != nil {
		return nil, err
	}
	return &m, nil
}

// checkKubeletKey holds node.kubelet_key to its schema: absent before schema 6; from
// schema 6 absent (no key made) or a digest "sha256:<64 lower-case hex>". An empty or
// null one is refused: it would marshal back without the field, to other bytes.
func checkKubeletKey(payload []byte, m *Manifest) error {
	var raw struct {
		Node struct {
			KubeletKey json.RawMessage `json:"kubelet_key"`
		} `json:"node"`
	}
	if err := json.Unmarshal(payload, &raw); err != nil {
		return err
	}
	switch k := m.Node.KubeletKey; {
	case raw.Node.KubeletKey == nil:
		return nil
	case m.SchemaVersion < 6:
		return fmt.Errorf("schema_version %d has no node.kubelet_key, the payload gives one", m.SchemaVersion)
	case !canonicalDigest(k):
		return fmt.Errorf("node.kubelet_key %s: want sha256:<64 lower-case hex digits>", Printable(string(raw.Node.KubeletKey)))
	}
	return nil
}

// canonicalDigest says whether s is "sha256:" and 64 lower-case hex digits, the one
// spelling Digest and the kubelet key's digest write.
func canonicalDigest(s string) bool {
	return validDigest(s) && strings.ToLower(s) == s
}

// checkModuleFields holds the payload's Module ID fields to its schema, which decoding
// into Manifest cannot tell (an absent module_id decodes as 0): from schema 5 every unit
// gives module_id and module_source (0 and "" when the Module ID is unknown: an absent
// one is not "unknown", it is another schema's unit), and nvlink is absent or an object;
// before schema 5 none of them is there.
func checkModuleFields(payload []byte, m *Manifest) error {
	var raw struct {
		Units []struct {
			ModuleID     *int    `json:"module_id"`
			ModuleSource *string `json:"module_source"`
		} `json:"units"`
		NVLink json.RawMessage `json:"nvlink"`
	}
	if err := json.Unmarshal(payload, &raw); err != nil {
		return err
	}
	v := m.SchemaVersion
	if raw.NVLink != nil && (v < 5 || m.NVLink == nil) {
		if v < 5 {
			return fmt.Errorf("schema_version %d has no nvlink field, the payload gives one", v)
		}
		return fmt.Errorf("nvlink is %s: absent or an object", raw.NVLink)
	}
	for i, u := range raw.Units {
		id := fmt.Sprintf("#%d", i)
		if i < len(m.Units) && m.Units[i].ID != "" {
			id = fmt.Sprintf("%q", m.Units[i].ID)
		}
		switch {
		case v < 5 && (u.ModuleID != nil || u.ModuleSource != nil):
			return fmt.Errorf("schema_version %d has no module_id or module_source, the payload gives one for unit %s", v, id)
		case v >= 5 && (u.ModuleID == nil || u.ModuleSource == nil):
			return fmt.Errorf("schema_version %d: unit %s lacks module_id or module_source (0 and \"\" when the Module ID is unknown)", v, id)
		}
	}
	return nil
}

func validDigest(s string) bool {
	h, ok := strings.CutPrefix(s, "sha256:")
	if !ok || len(h) != 2*sha256.Size {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil
}

// MaxEnvelopeSize is the largest envelope Verify and ReadEnvelope accept. A real one is
// tens of KB (an eight-unit B300 node's is about 28 KB); the bound keeps a hostile or
// mistaken file from costing the verifier gigabytes of memory (decoding holds the
// envelope, the base64 payload and its decoding at once).
const MaxEnvelopeSize = 16 << 20

const sizeLimit = "16 MiB" // MaxEnvelopeSize, for messages

// MaxSignatures is the most signatures Verify looks at in one envelope. The boot signs
// with at most two keys (the TPM key and a key file); a few more leave room for
// re-signing, none for an envelope padded to make the verifier spin.
const MaxSignatures = 8

// ReadEnvelope reads an envelope file for Verify, refusing one larger than
// MaxEnvelopeSize without reading it whole, and anything but a regular file (a FIFO, a
// device) without blocking on it (readRegular). A file over the limit is a *VerifyError
// of kind ErrMalformed naming the file; a file that cannot be read, or is not a regular
// file, is an error naming it.
func ReadEnvelope(path string) ([]byte, error) {
	b, err := ReadRegular(path, MaxEnvelopeSize)
	var big *errTooLarge
	if errors.As(err, &big) {
		return nil, verr(ErrMalformed, "%s: envelope is %s bytes, over the %s limit", path, big.size, sizeLimit)
	}
	return b, err
}
