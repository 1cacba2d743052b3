package verifiertest

import (
	"bytes"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/manifest"
)

// The media types and formats of the exchange at passage.url, spelled here as the
// protocol spells them (not taken from the boot's package): a test of the boot against
// this control plane then checks the boot speaks the protocol, not merely itself.
const (
	envelopeType    = "application/vnd.dsse.envelope.v1+json"
	attestationType = "application/vnd.passage.attestation+json"
	challengeType   = "application/vnd.passage.challenge+json"
	activationType  = "application/vnd.passage.activation+json"
	challengeFormat = "passage-enrol-challenge/1"
	answerFormat    = "passage-enrol-answer/1"
	// MaxBody bounds every request body.
	MaxBody = 1 << 20
)

// EnrolOptions are an enrolling control plane's trust and the faults a test asks of it.
type EnrolOptions struct {
	// EKCA is the operator's EK CA (PEM): EK certificates must chain to it.
	EKCA []byte
	// Unavailable answers this many requests of a content type (or, for the nonce GET,
	// of "GET") with 503 before serving it: a replica restarting.
	Unavailable map[string]int
	// PadChallenge adds this many bytes to every challenge body (a "padding" member).
	PadChallenge int
	// WrongSecret keeps another credential's digest than the one sealed: the node's true
	// answer is then refused by attest.Complete, as a wrong answer is.
	WrongSecret bool
	// Forget accepts the answer (204) but keeps no record: the attestation posted again
	// is challenged again, which a boot must not answer twice.
	Forget bool
}

// Request is one request the control plane answered.
type Request struct {
	Method, Type string
	Status       int
	Reason       string // a refusal's text/plain body
}

// Enrolling is a control plane on loopback that speaks the whole exchange at passage.url,
// enrolment included: a GET issues a nonce from the store (attest.NonceHandler); the
// envelope POST is kept; an attestation POST is verified against the node record of its
// EK (attest.VerifyTPM, the envelope's manifest, the nonce used up) and answered 200, or,
// for an EK with no record, answered 428 with attest.Enrol's challenge (the nonce not
// used up); the activation POST is checked with attest.Complete and makes the record.
// Refusals are 4xx with a text/plain reason. Its records are in memory: a test's.
type Enrolling struct {
	*httptest.Server
	Nonces *attest.NonceStore

	opts    EnrolOptions
	ca      *x509.CertPool
	nonces  http.Handler
	mu      sync.Mutex
	records map[string]*attest.NodeRecord
	pending map[string]pendingEnrol
	env     []byte
	log     []Request
	down    map[string]int
}

type pendingEnrol struct {
	p      *attest.Pending
	akName []byte
}

// NewEnrolling starts the control plane, its nonce store at noncePath.
func NewEnrolling(t testing.TB, noncePath string, o EnrolOptions) *Enrolling {
	t.Helper()
	pool, err := attest.CAPool(o.EKCA)
	if err != nil {
		t.Fatal(err)
	}
	store := &attest.NonceStore{Path: noncePath}
	cp := &Enrolling{Nonces: store, opts: o, ca: pool, nonces: attest.NonceHandler(store),
		records: map[string]*attest.NodeRecord{}, pending: map[string]pendingEnrol{}, down: map[string]int{}}
	for k, v := range o.Unavailable {
		cp.down[k] = v
	}
	cp.Server = httptest.NewServer(http.HandlerFunc(cp.serve))
	t.Cleanup(cp.Close)
	return cp
}

// Requests are the requests answered so far, in order.
func (cp *Enrolling) Requests() []Request {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return append([]Request(nil), cp.log...)
}

// Record is the node record kept under name (nil for none).
func (cp *Enrolling) Record(name string) *attest.NodeRecord {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.records[name]
}

// RecordName is the name the control plane gives the record of the TPM whose EK public
// area is ekPublic.
func RecordName(ekPublic []byte) string {
	sum := sha256.Sum256(ekPublic)
	return "node-" + hex.EncodeToString(sum[:6])
}

// statusWriter keeps the status and a refusal's text for the log.
type statusWriter struct {
	http.ResponseWriter
	status int
	text   bytes.Buffer
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if w.status >= 400 {
		w.text.Write(b)
	}
	return w.ResponseWriter.Write(b)
}

func refuseText(w http.ResponseWriter, code int, format string, a ...any) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	fmt.Fprintf(w, format, a...)
}

func (cp *Enrolling) serve(w http.ResponseWriter, r *http.Request) {
	ctype := r.Header.Get("Content-Type")
	if mt, _, err := mime.ParseMediaType(ctype); err == nil {
		ctype = mt
	}
	key := ctype
	if r.Method == http.MethodGet {
		key = "GET"
	}
	sw := &statusWriter{ResponseWriter: w}
	defer func() {
		cp.mu.Lock()
		cp.log = append(cp.log, Request{Method: r.Method, Type: key, Status: sw.status, Reason: strings.TrimSpace(sw.text.String())})
		cp.mu.Unlock()
	}()
	cp.mu.Lock()
	down := cp.down[key] > 0
	if down {
		cp.down[key]--
	}
	cp.mu.Unlock()
	if down {
		refuseText(sw, http.StatusServiceUnavailable, "replica unavailable")
		return
	}
	if r.Method == http.MethodGet {
		cp.nonces.ServeHTTP(sw, r)
		return
	}
	if r.Method != http.MethodPost {
		refuseText(sw, http.StatusMethodNotAllowed, "method %s: GET a nonce or POST", r.Method)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxBody+1))
	if err != nil {
		refuseText(sw, http.StatusBadRequest, "body: %v", err)
		return
	}
	if len(body) > MaxBody {
		refuseText(sw, http.StatusRequestEntityTooLarge, "body: over %d bytes", MaxBody)
		return
	}
	switch ctype {
	case envelopeType:
		cp.mu.Lock()
		cp.env = body
		cp.mu.Unlock()
		sw.WriteHeader(http.StatusNoContent)
	case attestationType:
		cp.attestation(sw, body)
	case activationType:
		cp.activation(sw, body)
	default:
		refuseText(sw, http.StatusUnsupportedMediaType, "content type %q: not one of the exchange's", ctype)
	}
}

func (cp *Enrolling) attestation(w http.ResponseWriter, body []byte) {
	a, err := attest.ParseAttestation(body)
	if err != nil {
		refuseText(w, http.StatusBadRequest, "attestation: %v", err)
		return
	}
	name := RecordName(a.EKPublic)
	cp.mu.Lock()
	rec, env := cp.records[name], cp.env
	cp.mu.Unlock()
	if len(a.Envelope) > 0 {
		env = a.Envelope // the envelope the attestation carries, as passage-control takes it
	}
	if rec == nil {
		cp.challenge(w, name, a)
		return
	}
	pemKey, err := rec.SigningKeyPEM()
	if err != nil {
		refuseText(w, http.StatusForbidden, "record %s: %v", name, err)
		return
	}
	v, err := manifest.ParsePublicKey(pemKey)
	if err != nil {
		refuseText(w, http.StatusForbidden, "record %s: %v", name, err)
		return
	}
	m, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		refuseText(w, http.StatusForbidden, "record %s: manifest: %v", name, err)
		return
	}
	res, err := attest.VerifyTPM(rec, a, attest.Manifest{Payload: m.Payload, Generation: m.Manifest.Generation, Signer: v.Public()},
		attest.Policy{EKCA: cp.ca, Nonces: cp.Nonces})
	if err != nil {
		refuseText(w, http.StatusForbidden, "record %s: %v", name, err)
		return
	}
	cp.mu.Lock()
	rec.Seen = res.Seen
	cp.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"record":%q,"verdict":"verified","generation":%d}`+"\n", name, m.Manifest.Generation)
}

// challenge starts the enrolment of an EK with no record: attest.Enrol checks the EK
// certificate against the CA and seals the credential; the 428 carries the challenge.
func (cp *Enrolling) challenge(w http.ResponseWriter, name string, a *attest.Attestation) {
	ch, p, err := attest.Enrol(a, cp.ca)
	if err != nil {
		refuseText(w, http.StatusForbidden, "%v", err)
		return
	}
	if cp.opts.WrongSecret {
		other := sha256.Sum256([]byte("not the sealed credential"))
		p.SecretSHA256 = other[:]
	}
	cj, err := json.Marshal(ch)
	if err != nil {
		refuseText(w, http.StatusInternalServerError, "challenge: %v", err)
		return
	}
	out := map[string]any{"format": challengeFormat, "record": name, "challenge": json.RawMessage(cj)}
	if cp.opts.PadChallenge > 0 {
		out["padding"] = strings.Repeat("x", cp.opts.PadChallenge)
	}
	b, err := json.Marshal(out)
	if err != nil {
		refuseText(w, http.StatusInternalServerError, "challenge: %v", err)
		return
	}
	cp.mu.Lock()
	cp.pending[name] = pendingEnrol{p: p, akName: ch.AKName}
	cp.mu.Unlock()
	w.Header().Set("Content-Type", challengeType)
	w.WriteHeader(http.StatusPreconditionRequired)
	w.Write(b)
}

func (cp *Enrolling) activation(w http.ResponseWriter, body []byte) {
	var ans struct {
		Format string `json:"format"`
		Record string `json:"record"`
		AKName string `json:"ak_name"`
		Answer []byte `json:"answer"`
	}
	if err := json.Unmarshal(body, &ans); err != nil || ans.Format != answerFormat {
		refuseText(w, http.StatusBadRequest, "activation: not a %s document (%v)", answerFormat, err)
		return
	}
	cp.mu.Lock()
	pe, ok := cp.pending[ans.Record]
	cp.mu.Unlock()
	if !ok {
		refuseText(w, http.StatusConflict, "record %s: no enrolment pending", ans.Record)
		return
	}
	if ans.AKName != hex.EncodeToString(pe.akName) {
		refuseText(w, http.StatusForbidden, "record %s: ak_name %s is not the AK challenged", ans.Record, ans.AKName)
		return
	}
	rec, err := attest.Complete(pe.p, ans.Answer)
	if err != nil {
		refuseText(w, http.StatusForbidden, "activation: wrong answer (%v)", err)
		return
	}
	cp.mu.Lock()
	delete(cp.pending, ans.Record)
	if !cp.opts.Forget {
		cp.records[ans.Record] = rec
	}
	cp.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}
