package controltest

import (
	"context"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/softtpm"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// SoftNode is a node whose TPM is done in software (attest/softtpm: its EK certificate
// from a test CA, its quotes signed in process memory), for the boot-storm load
// generator: thousands of them boot at once where a swtpm each could not. It has booted
// firmware and signed its manifest when made (the boot's manifest stage, before the
// network); Boot is the publish stage's exchange.
type SoftNode struct {
	Hostname string
	tpm      *softtpm.TPM
	signed   *manifest.Signed
	log      []byte
}

// NewSoftNode manufactures the node's TPM around ek (its certificate issued by ca),
// boots fw and signs the manifest of generation gen, measured into PCR 13.
func NewSoftNode(ctx context.Context, ca *softtpm.CA, ek *rsa.PrivateKey, fw *softtpm.Firmware, hostname string, gen uint64) (*SoftNode, error) {
	tpm, err := softtpm.New(ca, ek)
	if err != nil {
		return nil, fmt.Errorf("node %s: %w", hostname, err)
	}
	tpm.Reboot(fw)
	m := manifesttest.B300(gen)
	m.Node.Hostname = hostname
	s, log, err := tpm.SignManifest(ctx, m, "manifest.dsse.json")
	if err != nil {
		return nil, fmt.Errorf("node %s: sign: %w", hostname, err)
	}
	return &SoftNode{Hostname: hostname, tpm: tpm, signed: s, log: log}, nil
}

// Phase names a step of the exchange, in the order the boot makes them.
type Phase int

const (
	PhaseEnvelope    Phase = iota // POST the envelope
	PhaseNonce                    // GET a nonce
	PhaseQuote                    // certify and quote over it (the node's TPM; no request)
	PhaseAttestation              // POST the attestation: 428 and a challenge (first boot) or the verdict
	PhaseActivation               // activate the credential and POST the answer
	PhaseVerified                 // POST the attestation again: 200, verified
	Phases
)

func (p Phase) String() string {
	return [...]string{"envelope", "nonce", "quote", "attestation/428", "activation", "verified"}[p]
}

// BootTimes is what one boot's exchange took: each phase's time (its tries and the
// waits between them included) and how many requests it made.
type BootTimes struct {
	Start, End time.Time
	Phase      [Phases]time.Duration
	// Requests counts the requests made, retries included.
	Requests int
	Enrolled bool
}

// Boot is the boot's publish stage against url (stages/boot's publish, with the same
// netboot calls and policy p): POST the envelope, GET a nonce, quote over it, POST the
// attestation; on 428 activate the challenge, POST the answer and the attestation
// again. It ends when the control plane accepted the attestation (nil error) or a
// request failed within p (the error, the refusal's reason in it).
func (n *SoftNode) Boot(ctx context.Context, hc *http.Client, url string, p netboot.PublishPolicy) (*BootTimes, error) {
	bt := &BootTimes{Start: time.Now()}
	mark := time.Now()
	phase := func(ph Phase, att []netboot.Attempt) {
		now := time.Now()
		bt.Phase[ph] += now.Sub(mark)
		bt.Requests += len(att)
		mark = now
	}
	att, err := netboot.Publish(ctx, hc, url, n.signed.Envelope, p)
	phase(PhaseEnvelope, att)
	if err != nil {
		return bt, fmt.Errorf("node %s: %w", n.Hostname, err)
	}
	nonce, att, err := netboot.FetchNonce(ctx, hc, url, p)
	phase(PhaseNonce, att)
	if err != nil {
		return bt, fmt.Errorf("node %s: %w", n.Hostname, err)
	}
	a, err := n.tpm.Attest(nonce, n.log)
	if err != nil {
		return bt, fmt.Errorf("node %s: %w", n.Hostname, err)
	}
	body, err := a.Marshal()
	if err != nil {
		return bt, err
	}
	phase(PhaseQuote, nil)
	att, challenge, err := netboot.PublishAttestation(ctx, hc, url, body, p)
	phase(PhaseAttestation, att)
	if err != nil {
		return bt, fmt.Errorf("node %s: attestation: %w", n.Hostname, err)
	}
	if challenge == nil {
		bt.End = time.Now()
		return bt, nil
	}
	ec, err := netboot.ParseChallenge(challenge)
	if err != nil {
		return bt, fmt.Errorf("node %s: %w", n.Hostname, err)
	}
	var c attest.Challenge
	if err := json.Unmarshal(ec.Challenge, &c); err != nil {
		return bt, fmt.Errorf("node %s: record %s: challenge: %w", n.Hostname, ec.Record, err)
	}
	secret, err := n.tpm.Activate(&c)
	if err != nil {
		return bt, fmt.Errorf("node %s: record %s: %w", n.Hostname, ec.Record, err)
	}
	att, err = netboot.PostActivation(ctx, hc, url, netboot.NewAnswer(ec, c.AKName, secret), p)
	phase(PhaseActivation, att)
	if err != nil {
		return bt, fmt.Errorf("node %s: record %s: answer refused: %w", n.Hostname, ec.Record, err)
	}
	bt.Enrolled = true
	att, again, err := netboot.PublishAttestation(ctx, hc, url, body, p)
	phase(PhaseVerified, att)
	if err != nil {
		return bt, fmt.Errorf("node %s: attestation after enrolment: %w", n.Hostname, err)
	}
	if again != nil {
		return bt, errors.New("node " + n.Hostname + ": challenged again after enrolment")
	}
	bt.End = time.Now()
	return bt, nil
}
