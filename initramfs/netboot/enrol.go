package netboot

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"unicode"

	"github.com/passage-boot/passage/manifest"
)

// The enrolment exchange at passage.url (README, "Enrolment with no human step"): a
// control plane that has not enrolled the node's TPM answers the attestation POST with
// 428 Precondition Required and a challenge; the boot activates it with its TPM, POSTs
// the answer, then POSTs the same attestation again. The nonce is not used up by the 428.
const (
	// ChallengeType is the media type of the 428's body (EnrolChallenge).
	ChallengeType = "application/vnd.passage.challenge+json"
	// ActivationType is the media type of the boot's answer (EnrolAnswer).
	ActivationType = "application/vnd.passage.activation+json"
	// ChallengeFormat and AnswerFormat name the two bodies' shapes.
	ChallengeFormat = "passage-enrol-challenge/1"
	AnswerFormat    = "passage-enrol-answer/1"
	// MaxChallenge bounds the challenge body: a credential blob and an encrypted secret
	// for an RSA-2048 EK are under 1 KiB; anything past 16 KiB is not a challenge and is
	// refused without being read.
	MaxChallenge = 16 << 10
	// MaxRecordName bounds the record's name: a Kubernetes object name (a DNS subdomain,
	// RFC 1123) is at most 253 characters.
	MaxRecordName = 253
)

// EnrolChallenge is the body of the control plane's 428.
type EnrolChallenge struct {
	Format string `json:"format"`
	// Record names the node record the control plane keeps the enrolment in; the answer
	// names it back.
	Record string `json:"record"`
	// Challenge is an attest.Challenge (its JSON): package attest parses it, the TPM
	// answers it.
	Challenge json.RawMessage `json:"challenge"`
	// State is the control plane's half of the enrolment, sealed under its key: the
	// answer carries it back as it came, so no replica keeps it (base64 in JSON).
	State []byte `json:"state,omitempty"`
}

// ParseChallenge reads a 428's body (no key given twice in an object, nor in two cases:
// parsers disagree on which of two the document means, so manifest.CheckUniqueKeys
// refuses both, as for the manifest): the format, a record name of printable characters
// within MaxRecordName, and a challenge object. The body comes from the network: any
// other shape is refused naming what is wrong, and nothing in it is trusted beyond its
// shape (the TPM refuses a challenge not sealed to its EK).
func ParseChallenge(body []byte) (*EnrolChallenge, error) {
	if len(body) > MaxChallenge {
		return nil, fmt.Errorf("challenge: %d bytes, over %d", len(body), MaxChallenge)
	}
	if err := manifest.CheckUniqueKeys(body); err != nil {
		return nil, fmt.Errorf("challenge: %w", err)
	}
	var c EnrolChallenge
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("challenge: %w", err)
	}
	if dec.More() {
		return nil, errors.New("challenge: trailing data after the object")
	}
	if c.Format != ChallengeFormat {
		return nil, fmt.Errorf("challenge: format %q, want %q", c.Format, ChallengeFormat)
	}
	if err := checkRecordName(c.Record); err != nil {
		return nil, fmt.Errorf("challenge: %w", err)
	}
	if t := bytes.TrimSpace(c.Challenge); len(t) == 0 || t[0] != '{' {
		return nil, errors.New("challenge: no challenge object")
	}
	return &c, nil
}

func checkRecordName(s string) error {
	if s == "" {
		return errors.New("no record name")
	}
	if len(s) > MaxRecordName {
		return fmt.Errorf("record name of %d bytes, over %d", len(s), MaxRecordName)
	}
	for _, r := range s {
		if !unicode.IsPrint(r) || r == ' ' {
			return fmt.Errorf("record name %q: not printable", s)
		}
	}
	return nil
}

// EnrolAnswer is the boot's answer to a challenge.
type EnrolAnswer struct {
	Format string `json:"format"` // AnswerFormat
	Record string `json:"record"` // the challenge's
	AKName string `json:"ak_name"`
	// Answer is the credential TPM2_ActivateCredential recovered (base64 in JSON).
	Answer []byte `json:"answer"`
	// State is the challenge's, unchanged.
	State []byte `json:"state,omitempty"`
}

// NewAnswer is the answer to c: its record, the AK name the challenge was sealed for (hex)
// and the secret the TPM recovered.
func NewAnswer(c *EnrolChallenge, akName, secret []byte) EnrolAnswer {
	return EnrolAnswer{Format: AnswerFormat, Record: c.Record, AKName: hex.EncodeToString(akName), Answer: secret, State: c.State}
}

// PostActivation POSTs the answer to url (ActivationType), bounded and retried as Publish
// is: any 2xx means enrolled; a refusal is the error (a *StatusError with the reason).
func PostActivation(ctx context.Context, hc *http.Client, url string, a EnrolAnswer, p PublishPolicy) ([]Attempt, error) {
	body, err := json.Marshal(a)
	if err != nil {
		return nil, fmt.Errorf("activation %s: %w", a.Record, err)
	}
	return send(ctx, hc, "activation", http.MethodPost, url, ActivationType, body, p)
}

// Activator answers an enrolment challenge with the node's TPM: the challenge is the
// EnrolChallenge's (its JSON, for package attest to parse); it returns the AK name the
// challenge was sealed for and the credential TPM2_ActivateCredential recovered.
type Activator func(record string, challenge json.RawMessage) (akName, secret []byte, err error)

// Delivery is what DeliverAttestation did: every request, in order, and the record the
// node enrolled as ("" when the control plane had it enrolled already).
type Delivery struct {
	Attestation []Attempt // the attestation POSTs, both rounds
	Activation  []Attempt
	Record      string
	// Verdict is the body of the control plane's 2xx to the attestation (at most MaxBody
	// bytes): what it decided, for the log.
	Verdict []byte
}

// DeliverAttestation is the one exchange every publisher of an attestation runs (the
// boot's publish stage, a running host's recycle, the tests' and the load generator's
// nodes): POST the attestation; on 428 answer the challenge with activate, POST the
// answer and POST the same attestation again (the 428 did not use up its nonce). One
// enrolment round at most: a second 428 is an error. Each request is bounded and
// retried within p. The error is the refusal (a *StatusError naming the control
// plane's reason) or why the exchange could not finish.
func DeliverAttestation(ctx context.Context, hc *http.Client, url string, body []byte, activate Activator, p PublishPolicy) (*Delivery, error) {
	d := &Delivery{}
	att, rep, err := publishAttestation(ctx, hc, url, body, p)
	d.Attestation = append(d.Attestation, att...)
	if err != nil {
		return d, err
	}
	if rep.status != http.StatusPreconditionRequired {
		d.Verdict = rep.body
		return d, nil
	}
	ec, err := ParseChallenge(rep.body)
	if err != nil {
		return d, fmt.Errorf("enrolment: %w", err)
	}
	if activate == nil {
		return d, fmt.Errorf("enrolment: record %s: the control plane challenges this TPM and there is no TPM to answer", ec.Record)
	}
	akName, secret, err := activate(ec.Record, ec.Challenge)
	if err != nil {
		return d, fmt.Errorf("enrolment: record %s: %w", ec.Record, err)
	}
	d.Activation, err = PostActivation(ctx, hc, url, NewAnswer(ec, akName, secret), p)
	if err != nil {
		return d, fmt.Errorf("enrolment: record %s: answer refused: %w", ec.Record, err)
	}
	d.Record = ec.Record
	att, rep, err = publishAttestation(ctx, hc, url, body, p)
	d.Attestation = append(d.Attestation, att...)
	switch {
	case err != nil:
		return d, fmt.Errorf("after enrolment as record %s: %w", ec.Record, err)
	case rep.status == http.StatusPreconditionRequired:
		return d, fmt.Errorf("challenged again after enrolment as record %s: one enrolment round per publish, none more", ec.Record)
	}
	d.Verdict = rep.body
	return d, nil
}
