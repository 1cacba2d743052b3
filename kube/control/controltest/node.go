// Package controltest plays a node against passage-control in tests: a swtpm TPM with
// an EK certificate from a private swtpm_localca, whose firmware PCRs are extended with
// a real firmware event log (as the firmware would have), passage's signing key, and the
// boot's publish exchange at passage.url: Node.Publish through the boot's netboot
// exchange for the many boots a test makes, and Node.Boot, the real `passage boot
// --root` binary on a synthetic tree with this TPM, for the boot's own publish.
package controltest

import (
	"bytes"
	"context"
	"crypto"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	goattest "github.com/google/go-attestation/attest"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport/linuxudstpm"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// Node is a machine with a TPM that boots and publishes.
type Node struct {
	Hostname string
	state    string
	dir      string
	root     string // the synthetic tree Boot runs on, made on its first call
	boot     string // this boot's id: a reboot starts passage's event log afresh
	stop     func()
	key      *tpmkey.TPM
	// FirmwareLog is what the firmware measured this boot (extended into the PCRs).
	FirmwareLog []byte
	// Generation is the next manifest's generation.
	Generation uint64
	// LastEnvelope is the last manifest signed.
	LastEnvelope []byte
	// AfterNonce, when set, runs between the nonce GET and the first POST (a test kills
	// a replica there).
	AfterNonce func()
	t          testing.TB
}

// NewNode manufactures a TPM with an EK certificate from ca and boots it once with
// firmwareLog.
func NewNode(t testing.TB, ca *attesttest.CA, hostname string, firmwareLog []byte) *Node {
	t.Helper()
	n := &Node{Hostname: hostname, state: filepath.Join(t.TempDir(), "tpm"), t: t, Generation: 1}
	attesttest.Manufacture(t, ca, n.state)
	n.Reboot(firmwareLog)
	return n
}

// Reboot restarts the TPM (TPM2_Startup(CLEAR): PCRs reset, the reset count one up)
// and extends its PCRs with firmwareLog, as a boot's firmware does.
func (n *Node) Reboot(firmwareLog []byte) {
	t := n.t
	t.Helper()
	n.PowerOff()
	sock, stop := attesttest.Serve(t, n.state)
	tp, err := linuxudstpm.Open(sock)
	if err != nil {
		t.Fatal(err)
	}
	if err := ExtendLog(tp, firmwareLog); err != nil {
		t.Fatal(err)
	}
	k, err := tpmkey.New(tp)
	if err != nil {
		t.Fatal(err)
	}
	n.key, n.stop, n.FirmwareLog, n.dir, n.boot = k, stop, firmwareLog, t.TempDir(), newBootID()
}

// PowerOff stops the TPM (the node is down) until the next Reboot.
func (n *Node) PowerOff() {
	if n.key != nil {
		n.key.Close()
		n.stop()
		n.key = nil
	}
}

// ExtendLog extends each sha256 digest of a TCG event log into its PCR, in log order:
// the PCRs then replay the log as the firmware's own would.
func ExtendLog(tp interface {
	Send([]byte) ([]byte, error)
}, raw []byte) error {
	el, err := goattest.ParseEventLog(raw)
	if err != nil {
		return fmt.Errorf("firmware log: %w", err)
	}
	for _, e := range el.Events(goattest.HashSHA256) {
		if e.Type == 3 { // EV_NO_ACTION is logged, never extended (PC Client spec 10.4.1)
			continue
		}
		_, err := tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(e.Index), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: e.Digest}}},
		}.Execute(tp)
		if err != nil {
			return fmt.Errorf("extend PCR %d: %w", e.Index, err)
		}
	}
	return nil
}

// Result is what a publish ended with.
type Result struct {
	// Status is the attestation POST's last status (200: verified).
	Status int
	// Body is its body (the refusal's reason, or the verdict).
	Body string
	// Enrolled: the exchange went through a 428 challenge and an accepted answer.
	Enrolled bool
	// Nonce is the nonce the attestation was made with.
	Nonce []byte
	// Attestation is the attestation POSTed (to replay it).
	Attestation []byte
}

// Publish is the boot's publish stage against passage.url: GET a nonce from getURL,
// sign and measure the manifest of the next generation, POST its envelope, make the
// attestation over the nonce and POST it to postURL, through the boot's own exchange
// (netboot.DeliverAttestation: on 428 the challenge is activated in this node's TPM,
// the answer POSTed, then the attestation again). One try per request: a refusal ends
// it, its status and reason kept in the Result. A URL may be given as two to land the
// GET and the POSTs on different replicas.
func (n *Node) Publish(ctx context.Context, hc *http.Client, getURL, postURL string) (*Result, error) {
	p := netboot.PublishPolicy{Tries: 1, PerTry: 30 * time.Second}
	nonce, _, err := netboot.FetchNonce(ctx, hc, getURL, p)
	if err != nil {
		return nil, err
	}
	if n.AfterNonce != nil {
		n.AfterNonce()
	}
	env, err := n.sign(ctx)
	if err != nil {
		return nil, err
	}
	_ = env
	a, err := n.Attest(nonce)
	if err != nil {
		return nil, err
	}
	res := &Result{Nonce: nonce, Attestation: a, Status: http.StatusOK}
	d, err := netboot.DeliverAttestation(ctx, hc, postURL, a, func(_ string, challenge json.RawMessage) ([]byte, []byte, error) {
		return attest.Answer(n.key.Transport(), challenge)
	}, p)
	res.Enrolled, res.Body = d.Record != "", string(d.Verdict)
	if err != nil {
		return refused(res, err)
	}
	return res, nil
}

// refused keeps a refusal's status and reason in res; any other error is the error.
func refused(res *Result, err error) (*Result, error) {
	var se *netboot.StatusError
	if !errors.As(err, &se) {
		return nil, err
	}
	res.Status, res.Body = se.Code, se.Reason
	return res, nil
}

// sign writes the next generation's manifest, signed by the TPM key and measured into
// PCR 13, and returns its envelope.
func (n *Node) sign(ctx context.Context) ([]byte, error) {
	m := manifesttest.B300(n.Generation)
	m.Node.Hostname = n.Hostname
	m.BootID = n.boot
	s, err := manifest.WriteSigned(ctx, m, n.dir, "manifest.dsse.json", n.key, n.key)
	if err != nil {
		return nil, fmt.Errorf("node %s: sign: %w", n.Hostname, err)
	}
	n.Generation++
	n.LastEnvelope = s.Envelope
	return s.Envelope, nil
}

// NextEnvelope signs and measures the next generation's manifest and returns its
// envelope (a test POSTs it itself).
func (n *Node) NextEnvelope(t testing.TB) []byte {
	t.Helper()
	b, err := n.sign(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Attest makes the attestation over nonce of what this boot measured.
func (n *Node) Attest(nonce []byte) ([]byte, error) {
	plog, err := manifest.ReadRegular(filepath.Join(n.dir, "manifest.dsse.json"+manifest.EventLogSuffix), 1<<20)
	if err != nil {
		return nil, err
	}
	a, err := attest.Collect(n.key.Transport(), tpmkey.Template(), nonce, attest.Evidence{FirmwareLog: n.FirmwareLog, PassageLog: plog})
	if err != nil {
		return nil, fmt.Errorf("node %s: %w", n.Hostname, err)
	}
	a.NonceSource = attest.NonceControlPlane
	a.Envelope = n.LastEnvelope
	return a.Marshal()
}

// Answer activates a credential challenge in this node's TPM: the secret and the AK's
// name, as the boot answers.
func (n *Node) Answer(ch *attest.Challenge) (secret, akName []byte, err error) {
	secret, err = attest.Activate(n.key.Transport(), ch)
	return secret, ch.AKName, err
}

// SigningKey is passage's TPM signing key (the manifests' signer).
func (n *Node) SigningKey() crypto.PublicKey { return n.key.Public() }

// EKCert is the TPM's EK certificate (DER).
func (n *Node) EKCert() ([]byte, error) {
	a, err := attest.Collect(n.key.Transport(), tpmkey.Template(), []byte("ek"), attest.Evidence{})
	if err != nil {
		return nil, err
	}
	return a.EKCert, nil
}

func newBootID() string {
	b := make([]byte, 16)
	rand.Read(b)
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// Post POSTs body with the content type; it returns the status and at most 64 KiB of
// the answer.
func Post(ctx context.Context, hc *http.Client, url, contentType string, body []byte) (int, string, error) {
	return post(ctx, hc, url, contentType, body)
}

func post(ctx context.Context, hc *http.Client, url, contentType string, body []byte) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", contentType)
	resp, err := hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(b), nil
}
