package controltest

import (
	"context"
	"crypto/rsa"
	"encoding/json"
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
	// KubeletKey is the node.kubelet_key each manifest Sign and Reboot sign from now on
	// (initramfs/kubelet's digest of the key the boot made); "" signs none.
	KubeletKey string
	tpm        *softtpm.TPM
	signed     *manifest.Signed
	log        []byte
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

// BootTimes is what one boot's exchange took: each phase's time, from the end of the
// one before to the end of its last request (its tries, the waits between them and the
// node's own work included), and how many requests it made.
type BootTimes struct {
	Start, End time.Time
	Phase      [Phases]time.Duration
	// Requests counts the requests made, retries included; Shed those answered 503.
	Requests, Shed int
	Enrolled       bool
}

// request is one request a boot made: its kind (the phase it belongs to, the two
// attestation rounds both PhaseAttestation) and when it started and ended.
type request struct {
	kind       Phase
	start, end time.Time
}

// stamps records each request a boot makes through it (requests are sequential).
type stamps struct {
	next http.RoundTripper
	reqs []request
	shed int
}

func (s *stamps) RoundTrip(r *http.Request) (*http.Response, error) {
	kind := PhaseNonce
	switch r.Header.Get("Content-Type") {
	case netboot.EnvelopeType:
		kind = PhaseEnvelope
	case netboot.AttestationType:
		kind = PhaseAttestation
	case netboot.ActivationType:
		kind = PhaseActivation
	}
	start := time.Now()
	resp, err := s.next.RoundTrip(r)
	s.reqs = append(s.reqs, request{kind: kind, start: start, end: time.Now()})
	if err == nil && resp.StatusCode == http.StatusServiceUnavailable {
		s.shed++
	}
	return resp, err
}

// last is when the last request of kind that started within [from, to) ended; zero when
// none did.
func (s *stamps) last(kind Phase, from, to time.Time) time.Time {
	var t time.Time
	for _, r := range s.reqs {
		if r.kind == kind && !r.start.Before(from) && r.start.Before(to) {
			t = r.end
		}
	}
	return t
}

// phases splits the boot's time at the end of each phase's last request.
func (bt *BootTimes) phases(s *stamps, quoted time.Time) {
	bt.Requests, bt.Shed = len(s.reqs), s.shed
	end := bt.End
	if end.IsZero() {
		end = time.Now()
	}
	activation := end // the first activation request's start
	for _, r := range s.reqs {
		if r.kind == PhaseActivation {
			activation = r.start
			break
		}
	}
	ends := [Phases]time.Time{
		PhaseEnvelope:    s.last(PhaseEnvelope, bt.Start, end),
		PhaseNonce:       s.last(PhaseNonce, bt.Start, end),
		PhaseQuote:       quoted,
		PhaseAttestation: s.last(PhaseAttestation, bt.Start, activation),
		PhaseActivation:  s.last(PhaseActivation, bt.Start, end),
		PhaseVerified:    s.last(PhaseAttestation, activation, end),
	}
	// A boot that finished ends its last phase: the verdict's (the node's own time after
	// its last answer counted there).
	switch {
	case bt.End.IsZero():
	case !ends[PhaseActivation].IsZero():
		ends[PhaseVerified] = bt.End
	default:
		ends[PhaseAttestation] = bt.End
	}
	prev := bt.Start
	for ph, t := range ends {
		if t.IsZero() {
			continue
		}
		bt.Phase[ph] = t.Sub(prev)
		prev = t
	}
}

// Boot is the boot's publish stage against url, with the same netboot calls as
// stages/boot's publish and policy p: POST the envelope, GET a nonce, quote over it, and
// deliver the attestation (netboot.DeliverAttestation: on 428 the challenge is activated
// in the soft TPM, the answer POSTed, the attestation POSTed again). It ends when the
// control plane accepted the attestation (nil error) or a request failed within p (the
// error, the refusal's reason in it).
func (n *SoftNode) Boot(ctx context.Context, hc *http.Client, url string, p netboot.PublishPolicy) (bt *BootTimes, err error) {
	bt = &BootTimes{Start: time.Now()}
	s := &stamps{next: hc.Transport}
	if s.next == nil {
		s.next = http.DefaultTransport
	}
	c := *hc
	c.Transport = s
	var quoted time.Time
	defer func() {
		bt.phases(s, quoted)
		if err != nil {
			err = fmt.Errorf("node %s: %w", n.Hostname, err)
		}
	}()
	if _, err := netboot.Publish(ctx, &c, url, n.signed.Envelope, p); err != nil {
		return bt, err
	}
	nonce, _, err := netboot.FetchNonce(ctx, &c, url, p)
	if err != nil {
		return bt, err
	}
	a, err := n.tpm.Attest(nonce, n.log)
	if err != nil {
		return bt, err
	}
	a.Envelope = n.signed.Envelope
	body, err := a.Marshal()
	if err != nil {
		return bt, err
	}
	quoted = time.Now()
	d, err := netboot.DeliverAttestation(ctx, &c, url, body, n.answer, p)
	bt.Enrolled = d != nil && d.Record != ""
	if err != nil {
		return bt, err
	}
	bt.End = time.Now()
	return bt, nil
}

// answer is the netboot.Activator of the soft TPM (attest.Answer's, in software).
func (n *SoftNode) answer(_ string, challenge json.RawMessage) (akName, secret []byte, err error) {
	c, err := attest.ParseChallenge(challenge)
	if err != nil {
		return nil, nil, err
	}
	secret, err = n.tpm.Activate(c)
	return c.AKName, secret, err
}

// Reboot boots fw again (PCR 13 reset, the reset count one up) and signs generation
// gen's manifest naming hostname: the node's next boot, before its publish stage.
func (n *SoftNode) Reboot(ctx context.Context, fw *softtpm.Firmware, hostname string, gen uint64) error {
	n.tpm.Reboot(fw)
	return n.Sign(ctx, hostname, gen)
}

// Sign signs and measures generation gen's manifest naming hostname in this boot (a
// running host's next generation, or a manifest for another name: an attack's).
func (n *SoftNode) Sign(ctx context.Context, hostname string, gen uint64) error {
	m := manifesttest.B300(gen)
	m.Node.Hostname, m.Node.KubeletKey = hostname, n.KubeletKey
	s, log, err := n.tpm.SignManifest(ctx, m, "manifest.dsse.json")
	if err != nil {
		return fmt.Errorf("node %s: sign: %w", hostname, err)
	}
	n.Hostname, n.signed, n.log = hostname, s, log
	return nil
}

// Attestation is the attestation over nonce carrying the last manifest's envelope, as
// the boot POSTs it.
func (n *SoftNode) Attestation(nonce []byte) (*attest.Attestation, error) {
	a, err := n.tpm.Attest(nonce, n.log)
	if err != nil {
		return nil, err
	}
	a.Envelope = n.signed.Envelope
	return a, nil
}

// Answer activates a credential challenge in the soft TPM (the activation's secret and
// the AK's name, as the boot answers).
func (n *SoftNode) Answer(c *attest.Challenge) (secret, akName []byte, err error) {
	secret, err = n.tpm.Activate(c)
	return secret, c.AKName, err
}
