package control

import (
	"bufio"
	"bytes"
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/google/go-tpm/tpm2"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
)

// The media types and formats of the exchange at passage.url: the boot's
// (initramfs/netboot), named once.
const (
	NonceType       = netboot.NonceType
	EnvelopeType    = netboot.EnvelopeType
	AttestationType = netboot.AttestationType
	ChallengeType   = netboot.ChallengeType
	ActivationType  = netboot.ActivationType
	ChallengeFormat = netboot.ChallengeFormat
	AnswerFormat    = netboot.AnswerFormat
)

// Body bounds: an envelope or an answer is at most MaxBody (the record keeps the
// envelope, and an object in the API is at most about 1.5 MiB); an attestation carries
// the firmware's event log, up to attest.MaxFirmwareLog, so it is bounded by
// attest.MaxFile.
const (
	MaxBody        = 1 << 20
	MaxAttestation = attest.MaxFile
	maxChallenge   = 16 << 10
	maxRefusal     = 1 << 10
)

// ChallengeBody is the 428 answer to an unenrolled TPM's attestation.
type ChallengeBody struct {
	Format    string            `json:"format"`
	Record    string            `json:"record"`
	Challenge *attest.Challenge `json:"challenge"`
}

// AnswerBody is the boot's activation answer.
type AnswerBody struct {
	Format string `json:"format"`
	Record string `json:"record"`
	AKName string `json:"ak_name"`
	Answer string `json:"answer"` // base64
}

// VerdictBody is the 200 answer to an accepted attestation.
type VerdictBody struct {
	Record     string `json:"record"`
	Verdict    string `json:"verdict"`
	Generation int64  `json:"generation"`
}

// Server answers passage.url. It holds configuration only: every request reads and
// writes the API through Store and Taints.
type Server struct {
	Store  *Store
	Taints *Taints
	// EKCA are the operator's EK certificate issuers.
	EKCA *x509.CertPool
	// Intake, when not nil, is the list of EKs recorded at intake: a TPM not on it is
	// not enrolled, and one whose entry names a record enrols only as that record.
	// Without it, the first TPM chained to EKCA to complete an enrolment under a
	// record name owns that record from then on.
	Intake *Intake
	// Approved is the approved image; nil checks the TPM's word only (attest.VerifyTPM).
	Approved *attest.Approved
	Metrics  *Metrics
	Log      *log.Logger
}

// refusal is an answer other than 2xx: its status and the reason, text/plain.
type refusal struct {
	status int
	reason string
	// check is the metrics' label (the refused check).
	check string
}

func (r *refusal) Error() string { return r.reason }

func refuse(status int, check, format string, a ...any) *refusal {
	return &refusal{status: status, check: check, reason: fmt.Sprintf(format, a...)}
}

// ServeHTTP is the exchange: GET a nonce; POST an envelope, an attestation or an
// activation answer by their Content-Type.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var err error
	what := "request" // what a 503 names
	switch r.Method {
	case http.MethodGet:
		what = "nonce"
		err = s.nonce(ctx, w)
	case http.MethodPost:
		ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
		switch ct {
		case EnvelopeType:
			what = "envelope"
			err = s.envelope(ctx, w, r.Body)
		case AttestationType:
			what = "attestation"
			err = s.attestation(ctx, w, r.Body)
		case ActivationType:
			what = "activation"
			err = s.activation(ctx, w, r.Body)
		default:
			err = refuse(http.StatusUnsupportedMediaType, "content type", "content type %q: POST %s, %s or %s", ct, EnvelopeType, AttestationType, ActivationType)
		}
	default:
		w.Header().Set("Allow", "GET, POST")
		err = refuse(http.StatusMethodNotAllowed, "method", "method %s: GET a nonce or POST", r.Method)
	}
	if err == nil {
		return
	}
	var rf *refusal
	public := ""
	if !errors.As(err, &rf) {
		// The API is unreachable, a write conflicted on every try, the context ended:
		// 503, which the boot retries (another replica may answer). The API's words (its
		// address, the account, the objects) go to the log, not to a client no one has
		// authenticated, as attest.NonceHandler keeps its files to itself.
		rf = &refusal{status: http.StatusServiceUnavailable, check: "unavailable", reason: err.Error()}
		public = what + ": the control plane's store did not answer; retry (the reason is in its log)"
	}
	s.Metrics.refused(rf.check)
	if s.Log != nil {
		s.Log.Printf("%s %s (%s): %d %s", r.Method, r.URL.Path, r.Header.Get("Content-Type"), rf.status, rf.reason)
	}
	if public == "" {
		public = rf.reason
	}
	reason := strings.ReplaceAll(public, "\n", "; ")
	if len(reason) > maxRefusal-1 {
		reason = reason[:maxRefusal-4] + "..."
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(rf.status)
	io.WriteString(w, reason+"\n")
}

func readBody(body io.Reader, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(body, limit+1))
	if err != nil {
		return nil, refuse(http.StatusBadRequest, "body", "body: %v", err)
	}
	if int64(len(b)) > limit {
		return nil, refuse(http.StatusRequestEntityTooLarge, "body", "body: over %d bytes", limit)
	}
	return b, nil
}

func (s *Server) nonce(ctx context.Context, w http.ResponseWriter) error {
	n, err := s.Store.IssueNonce(ctx)
	if errors.Is(err, ErrTooManyNonces) {
		// 503, which the boot's nonce fetch retries; the sweep makes room.
		w.Header().Set("Retry-After", "60")
		return refuse(http.StatusServiceUnavailable, "nonces full", "%v: retry later", err)
	}
	if err != nil {
		return err
	}
	s.Metrics.issued()
	w.Header().Set("Content-Type", NonceType)
	w.Header().Set("Cache-Control", "no-store")
	fmt.Fprintln(w, hex.EncodeToString(n))
	return nil
}

// fresh is a retry body that writes through f the record read: first t, as the
// request's list found it (the write carries its resourceVersion, so a record changed
// since is a conflict, not overwritten), then, after a conflict, a new read of it. It
// saves the read a first write does not need: one GET per attestation.
func fresh(ctx context.Context, st *Store, t *Node, f func(n *Node) error) func() error {
	first := true
	return func() error {
		n := t
		if !first {
			var err error
			if n, err = st.Node(ctx, t.Name); err != nil {
				return err
			}
		}
		first = false
		return f(n)
	}
}

// retry runs f on a fresh read of the record until its write does not conflict.
func retry(ctx context.Context, f func() error) error {
	var err error
	for i := range 8 {
		if err = f(); !apierrors.IsConflict(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(i+1) * 5 * time.Millisecond):
		}
	}
	return err
}

// envelope keeps a POSTed manifest in its node's record (made on the first POST): the
// attestation, on whichever replica it lands, is verified against it. An enrolled
// node's envelope must carry its certified signing key's signature. A new manifest
// makes the node unverified until its attestation comes.
func (s *Server) envelope(ctx context.Context, w http.ResponseWriter, body io.Reader) error {
	b, err := readBody(body, MaxBody)
	if err != nil {
		return err
	}
	var env manifest.Envelope
	if err := json.Unmarshal(b, &env); err != nil {
		return refuse(http.StatusBadRequest, "envelope", "envelope: %v", err)
	}
	payload, err := base64.StdEncoding.DecodeString(env.Payload)
	if err != nil {
		return refuse(http.StatusBadRequest, "envelope", "envelope: payload: %v", err)
	}
	m, err := manifest.Unmarshal(payload)
	if err != nil {
		return refuse(http.StatusBadRequest, "envelope", "envelope: payload: %v", err)
	}
	name := m.Node.Hostname
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return refuse(http.StatusBadRequest, "envelope", "envelope: node hostname %q: not a record name: %s", manifest.Printable(name), strings.Join(errs, "; "))
	}
	digest := manifest.Digest(payload)
	held := &HeldManifest{Envelope: b, Digest: digest, Generation: int64(m.Generation), BootID: m.BootID, Posted: s.Store.now().UTC()}
	var verdict string
	err = retry(ctx, func() error {
		n, err := s.Store.Node(ctx, name)
		if errors.Is(err, ErrNoRecord) {
			if err := s.Store.CheckRoom(ctx); errors.Is(err, ErrTooManyUnenrolled) {
				// 503, which the boot's publish retries; an enrolment or the sweep makes room.
				w.Header().Set("Retry-After", "60")
				return refuse(http.StatusServiceUnavailable, "unenrolled full", "record %s: %v: retry later", name, err)
			} else if err != nil {
				return err
			}
			// Made with the manifest's label: the update below then has nothing to do.
			n, err = s.Store.Create(ctx, &Node{Name: name, Spec: NodeSpec{Node: name}, Labels: map[string]string{ManifestLabel: manifestLabel(digest)}})
			if apierrors.IsAlreadyExists(err) {
				return apierrors.NewConflict(NodeResource.GroupResource(), name, err)
			}
		}
		if err != nil {
			return err
		}
		if n.enrolled() {
			if _, _, err := s.verifyEnvelope(n, b); err != nil {
				return err
			}
			if int64(m.Generation) < n.Status.Generation {
				return refuse(http.StatusConflict, "reset count", "record %s: generation %d is older than %d already verified", name, m.Generation, n.Status.Generation)
			}
		}
		if n.Status.Manifest != nil && n.Status.Manifest.Digest == digest {
			verdict = n.Status.Verdict
			return nil // a retried POST
		}
		reason := fmt.Sprintf("generation %d posted, not attested", m.Generation)
		if !n.enrolled() {
			reason = fmt.Sprintf("generation %d posted; TPM not enrolled", m.Generation)
		}
		now := s.Store.now().UTC()
		verdict = VerdictUnverified
		// The label goes through the main resource, the status through its subresource
		// (an update of the one leaves the other as it was).
		if n.Labels == nil {
			n.Labels = map[string]string{}
		}
		if n.Labels[ManifestLabel] != manifestLabel(digest) {
			n.Labels[ManifestLabel] = manifestLabel(digest)
			if n, err = s.Store.Update(ctx, n); err != nil {
				return err
			}
		}
		n.Status.Manifest = held
		n.Status.Verdict, n.Status.Reason, n.Status.Time = verdict, reason, &now
		_, err = s.Store.UpdateStatus(ctx, n)
		return err
	})
	if err != nil {
		return err
	}
	if verdict != VerdictVerified {
		if err := s.Taints.Set(ctx, name, name, VerdictUnverified, "", fmt.Sprintf("generation %d not attested", m.Generation)); err != nil {
			return err
		}
	}
	w.WriteHeader(http.StatusAccepted)
	return nil
}

func manifestLabel(digest string) string {
	h := strings.TrimPrefix(digest, "sha256:")
	if len(h) > 63 {
		h = h[:63]
	}
	return h
}

func (n *Node) enrolled() bool { return len(n.Spec.EKPublic) > 0 }

// record is the enrolled node as attest keeps it.
func (n *Node) record() *attest.NodeRecord {
	return &attest.NodeRecord{
		Format: attest.NodeFormat, EKCert: n.Spec.EKCert, EKPublic: n.Spec.EKPublic, AKPublic: n.Spec.AKPublic,
		SigningKeyPublic: n.Spec.SigningKeyPublic,
		Seen:             attest.Seen{ResetCount: uint32(n.Status.ResetCount), Generation: uint64(n.Status.Generation)},
	}
}

// verifyEnvelope checks an envelope against the record's certified signing key.
func (s *Server) verifyEnvelope(n *Node, env []byte) (*manifest.Verified, crypto.PublicKey, error) {
	keyPEM, err := n.record().SigningKeyPEM()
	if err != nil {
		return nil, nil, fmt.Errorf("record %s: signing key: %w", n.Name, err)
	}
	v, err := manifest.ParsePublicKey(keyPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("record %s: signing key: %w", n.Name, err)
	}
	ver, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		return nil, nil, refuse(http.StatusForbidden, "envelope", "record %s: envelope not signed by its enrolled signing key: %v", n.Name, err)
	}
	return ver, v.Public(), nil
}

// attestation verifies a boot's attestation of the manifest its record holds, or, for a
// TPM not yet enrolled, answers 428 with the credential challenge.
func (s *Server) attestation(ctx context.Context, w http.ResponseWriter, body io.Reader) error {
	b, err := readBody(body, MaxAttestation)
	if err != nil {
		return err
	}
	var a attest.Attestation
	if err := json.Unmarshal(b, &a); err != nil {
		return refuse(http.StatusBadRequest, "attestation", "attestation: %v", err)
	}
	if a.Format != attest.Format {
		return refuse(http.StatusBadRequest, "attestation", "attestation: format %q, want %q", a.Format, attest.Format)
	}
	if len(a.Nonce) == 0 || len(a.Nonce) > 64 {
		return refuse(http.StatusBadRequest, "attestation", "attestation: nonce of %d bytes", len(a.Nonce))
	}
	l, err := manifest.ParseEventLog(a.PassageLog)
	if err != nil || len(l.Events) == 0 {
		return refuse(http.StatusBadRequest, "attestation", "attestation: passage's event log names no manifest (%v)", err)
	}
	digest := l.Events[len(l.Events)-1].PayloadDigest
	holders, err := s.Store.ByLabel(ctx, ManifestLabel, manifestLabel(digest))
	if err != nil {
		return err
	}
	var t *Node
	for _, n := range holders {
		if n.Status.Manifest != nil && n.Status.Manifest.Digest == digest {
			t = n
		}
	}
	if t == nil {
		return refuse(http.StatusConflict, "manifest", "attestation of manifest %s: no record holds it (POST its envelope first)", digest)
	}
	owners, err := s.Store.ByLabel(ctx, EKLabel, labelOf(a.EKPublic))
	if err != nil {
		return err
	}
	for _, o := range owners {
		if o.Name != t.Name && bytes.Equal(o.Spec.EKPublic, a.EKPublic) {
			return refuse(http.StatusForbidden, "record", "record %s: this TPM is enrolled as record %s", t.Name, o.Name)
		}
	}
	if !t.enrolled() {
		return s.challenge(ctx, w, t, &a)
	}
	if !bytes.Equal(t.Spec.EKPublic, a.EKPublic) {
		return refuse(http.StatusForbidden, "record", "record %s: enrolled with another TPM (ek %s), this is ek %s", t.Name, ekID(t.Spec.EKPublic), ekID(a.EKPublic))
	}
	return s.verify(ctx, w, t, &a)
}

// akName is the hex TPM name (nameAlg and digest) of a TPMT_PUBLIC, as a challenge
// gives it.
func akName(pub []byte) (string, error) {
	p, err := tpm2.Unmarshal[tpm2.TPMTPublic](pub)
	if err != nil {
		return "", err
	}
	name, err := tpm2.ObjectName(p)
	if err != nil {
		return "", err
	}
	return hex.EncodeToString(name.Buffer), nil
}

func ekID(pub []byte) string {
	sum := sha256.Sum256(pub)
	return "sha256:" + hex.EncodeToString(sum[:8]) + "..."
}

// challenge starts an unenrolled TPM's enrolment: the nonce must be live (it is not used
// up: the boot POSTs the same attestation after activating), the EK certificate chained
// to the EK CA and on the intake list when one is kept; the control plane's half goes
// in the record, the challenge to the boot.
func (s *Server) challenge(ctx context.Context, w http.ResponseWriter, t *Node, a *attest.Attestation) error {
	if err := s.Store.CheckNonce(ctx, a.Nonce); err != nil {
		return nonceRefusal(err)
	}
	if s.Intake != nil {
		if err := s.Intake.Check(a.EKCert, t.Name); err != nil {
			return refuse(http.StatusForbidden, "intake", "%v", err)
		}
	}
	ch, p, err := attest.Enrol(a, s.EKCA)
	if err != nil {
		return refuse(http.StatusForbidden, strings.ToLower(attest.CheckOf(err)), "%s", lowerFirst(err.Error()))
	}
	pj, err := json.Marshal(p)
	if err != nil {
		return err
	}
	body, err := json.Marshal(ChallengeBody{Format: ChallengeFormat, Record: t.Name, Challenge: ch})
	if err != nil {
		return err
	}
	if len(body) > maxChallenge {
		return fmt.Errorf("record %s: challenge of %d bytes, over %d", t.Name, len(body), maxChallenge)
	}
	now := s.Store.now().UTC()
	err = retry(ctx, fresh(ctx, s.Store, t, func(n *Node) error {
		if n.enrolled() {
			return refuse(http.StatusConflict, "record", "record %s: enrolled meanwhile; POST the attestation again", t.Name)
		}
		n.Status.Pending = &PendingEnrolment{AKName: hex.EncodeToString(ch.AKName), Pending: pj, Issued: now}
		n.Status.Verdict, n.Status.Reason, n.Status.Time = VerdictEnrolling, "credential challenge sent for ak "+hex.EncodeToString(ch.AKName[:min(len(ch.AKName), 8)])+"...", &now
		_, err := s.Store.UpdateStatus(ctx, n)
		return err
	}))
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", ChallengeType)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusPreconditionRequired)
	w.Write(body)
	return nil
}

// lowerFirst writes attest's "EK certificate: ..." as the exchange's "ek certificate: ...".
func lowerFirst(s string) string {
	if i := strings.Index(s, ": "); i > 0 {
		return strings.ToLower(s[:i]) + s[i:]
	}
	return s
}

func nonceRefusal(err error) error {
	var nr *NonceRefusal
	if errors.As(err, &nr) {
		return refuse(http.StatusForbidden, "nonce", "%v", err)
	}
	return err
}

// activation finishes an enrolment: the answer must be the credential sealed to the
// EK for the AK; the record then holds EK, AK and signing key.
func (s *Server) activation(ctx context.Context, w http.ResponseWriter, body io.Reader) error {
	b, err := readBody(body, MaxBody)
	if err != nil {
		return err
	}
	var ans AnswerBody
	if err := json.Unmarshal(b, &ans); err != nil {
		return refuse(http.StatusBadRequest, "activation", "activation: %v", err)
	}
	if ans.Format != AnswerFormat {
		return refuse(http.StatusBadRequest, "activation", "activation: format %q, want %q", ans.Format, AnswerFormat)
	}
	secret, err := base64.StdEncoding.DecodeString(ans.Answer)
	if err != nil {
		return refuse(http.StatusBadRequest, "activation", "activation: answer: %v", err)
	}
	if errs := validation.IsDNS1123Subdomain(ans.Record); len(errs) > 0 {
		return refuse(http.StatusBadRequest, "activation", "activation: record %q: %s", manifest.Printable(ans.Record), strings.Join(errs, "; "))
	}
	return retry(ctx, func() error {
		n, err := s.Store.Node(ctx, ans.Record)
		if errors.Is(err, ErrNoRecord) {
			return refuse(http.StatusNotFound, "activation", "activation: record %s: none", ans.Record)
		}
		if err != nil {
			return err
		}
		if n.Status.Pending == nil {
			if n.enrolled() {
				// A retried answer that won before is 204 again; an answer for an AK the
				// record was not enrolled with (another TPM's, challenged before this
				// one's enrolment won) is refused.
				if name, err := akName(n.Spec.AKPublic); err != nil || !strings.EqualFold(name, ans.AKName) {
					return refuse(http.StatusForbidden, "record", "activation: record %s: enrolled with another AK (ek %s); ak_name %s was not enrolled", n.Name, ekID(n.Spec.EKPublic), manifest.Printable(ans.AKName))
				}
				w.WriteHeader(http.StatusNoContent)
				return nil
			}
			return refuse(http.StatusConflict, "activation", "activation: record %s: no enrolment pending", n.Name)
		}
		if !strings.EqualFold(n.Status.Pending.AKName, ans.AKName) {
			return refuse(http.StatusForbidden, "activation", "activation: record %s: ak_name %s is not the challenged AK", n.Name, manifest.Printable(ans.AKName))
		}
		var p attest.Pending
		if err := json.Unmarshal(n.Status.Pending.Pending, &p); err != nil {
			return fmt.Errorf("record %s: pending enrolment: %w", n.Name, err)
		}
		rec, err := attest.Complete(&p, secret)
		if err != nil {
			return refuse(http.StatusForbidden, "activation", "activation: wrong answer (%v)", err)
		}
		// The record is pinned to the first TPM that enrolled it: the challenge is never
		// written on an enrolled record, and an answer never replaces its enrolment.
		if n.enrolled() && !bytes.Equal(n.Spec.EKPublic, rec.EKPublic) {
			return refuse(http.StatusForbidden, "record", "record %s: enrolled with another TPM (ek %s), this is ek %s", n.Name, ekID(n.Spec.EKPublic), ekID(rec.EKPublic))
		}
		if s.Intake != nil {
			if err := s.Intake.Check(rec.EKCert, n.Name); err != nil {
				return refuse(http.StatusForbidden, "intake", "%v", err)
			}
		}
		owners, err := s.Store.ByLabel(ctx, EKLabel, labelOf(rec.EKPublic))
		if err != nil {
			return err
		}
		for _, o := range owners {
			if o.Name != n.Name && bytes.Equal(o.Spec.EKPublic, rec.EKPublic) {
				return refuse(http.StatusForbidden, "record", "record %s: this TPM is enrolled as record %s", n.Name, o.Name)
			}
		}
		now := s.Store.now().UTC()
		n.Spec.EKCert, n.Spec.EKPublic, n.Spec.AKPublic, n.Spec.SigningKeyPublic = rec.EKCert, rec.EKPublic, rec.AKPublic, rec.SigningKeyPublic
		n.Spec.Enrolled = &now
		if n.Labels == nil {
			n.Labels = map[string]string{}
		}
		n.Labels[EKLabel] = labelOf(rec.EKPublic)
		st := n.Status
		if n, err = s.Store.Update(ctx, n); err != nil {
			return err
		}
		n.Status = st
		n.Status.Pending = nil
		n.Status.ResetCount = int64(rec.Seen.ResetCount)
		n.Status.Verdict, n.Status.Reason, n.Status.Time = VerdictUnverified, "enrolled; attestation not yet accepted", &now
		if _, err := s.Store.UpdateStatus(ctx, n); err != nil && !apierrors.IsConflict(err) {
			return err
		}
		s.Metrics.enrolled()
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

// verify holds an enrolled node's attestation to its record: attest.VerifyTPM, the
// nonce used up by one compare-and-swap, attest.VerifyFirmware against the approved
// image. Only a refusal of an attestation the enrolled TPM itself made (its quote
// verified: a rollback, passage's log not replaying, an unapproved image or PCR policy)
// changes the verdict to attestation-failed: a refusal anyone could provoke (a forged
// quote, a replayed or unissued nonce) says nothing about the node's boot, and tainting
// on it would let anyone holding an old attestation evict the node's pods.
func (s *Server) verify(ctx context.Context, w http.ResponseWriter, t *Node, a *attest.Attestation) error {
	ver, signer, err := s.verifyEnvelope(t, t.Status.Manifest.Envelope)
	if err != nil {
		return err
	}
	m := attest.Manifest{Payload: ver.Payload, Generation: ver.Manifest.Generation, Signer: signer}
	res, tpmErr := attest.VerifyTPM(t.record(), a, m, attest.Policy{EKCA: s.EKCA, Nonce: a.Nonce})
	if tpmErr != nil {
		switch attest.CheckOf(tpmErr) {
		case "reset count", "PCR 13":
		default:
			return refuse(http.StatusForbidden, strings.ToLower(attest.CheckOf(tpmErr)), "record %s: %s", t.Name, lowerFirst(tpmErr.Error()))
		}
	}
	issued, err := s.Store.UseNonce(ctx, a.Nonce, t.Name)
	if err != nil {
		return nonceRefusal(err)
	}
	// The nonce is spent: the verdict is written and the rule set even if the boot stops
	// waiting (its try timed out under load). Cut off with the request, a spent nonce
	// would leave no verdict, and the boot's retry, refused as a replay, none either: the
	// node would stay unverified until its next boot (seen in the boot storm).
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), VerdictTimeout)
	defer cancel()
	verr := tpmErr
	if verr == nil && s.Approved != nil {
		_, verr = attest.VerifyFirmware(a.FirmwareLog, a.PCRs, s.Approved)
	}
	now := s.Store.now().UTC()
	gen := int64(ver.Manifest.Generation)
	verdict, reason, check := VerdictVerified, fmt.Sprintf("generation %d attested", gen), ""
	if verr != nil {
		check = attest.CheckOf(verr)
		if check == "" {
			check = "firmware"
		}
		verdict, reason = VerdictFailed, fmt.Sprintf("generation %d: %s", gen, verr)
	}
	digest := t.Status.Manifest.Digest
	err = retry(ctx, fresh(ctx, s.Store, t, func(n *Node) error {
		if n.Status.Manifest == nil || n.Status.Manifest.Digest != digest {
			return refuse(http.StatusConflict, "manifest", "record %s: a newer manifest was posted meanwhile", n.Name)
		}
		n.Status.Verdict, n.Status.Reason, n.Status.Time = verdict, reason, &now
		if verr == nil {
			n.Status.Generation, n.Status.ResetCount, n.Status.BootID = int64(res.Seen.Generation), int64(res.Seen.ResetCount), ver.Manifest.BootID
		}
		// An enrolled record has no enrolment pending: the activation's status write,
		// which leaves a conflict be (its spec write enrolled the node), may not have
		// cleared it.
		n.Status.Pending = nil
		_, err := s.Store.UpdateStatus(ctx, n)
		return err
	}))
	if err != nil {
		return err
	}
	if err := s.Taints.Set(ctx, t.Name, t.Spec.Node, verdict, check, reason); err != nil {
		return err
	}
	s.Metrics.verdict(verdict, now.Sub(issued))
	if verr != nil {
		return refuse(http.StatusForbidden, strings.ToLower(check), "record %s: %s", t.Name, lowerFirst(verr.Error()))
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(VerdictBody{Record: t.Name, Verdict: verdict, Generation: gen})
}

// VerdictTimeout bounds the writes that record a verdict once its nonce is spent (the
// record's status and the rule), which do not stop with the request.
const VerdictTimeout = 30 * time.Second

// SweepUnenrolled deletes the records not enrolled within their time
// (Store.SweepUnenrolled) and their DeviceTaintRules, leaving the node as one that never
// POSTed. A record made again meanwhile (the node POSTed between the two deletes) gets
// its rule back. It returns how many records it deleted.
func (s *Server) SweepUnenrolled(ctx context.Context, page int64) (int, error) {
	gone, err := s.Store.SweepUnenrolled(ctx, page)
	var published map[string]int64
	if len(gone) > 0 {
		var perr error
		if published, perr = s.pools(ctx, page); perr != nil {
			// Unknown which pools publish: every swept record's rule stays.
			return len(gone), errors.Join(err, fmt.Errorf("swept %d records, their rules kept: %w", len(gone), perr))
		}
	}
	for _, name := range gone {
		// A pool passage-dra still publishes keeps its devices untainted only once a
		// record verifies it: its rule says unverified, never nothing. Only a record
		// no pool stands behind (a made-up hostname) loses its rule with it.
		if _, ok := published[name]; ok {
			err = errors.Join(err, s.Taints.Set(ctx, name, name, VerdictUnverified, "", "its record was swept, not enrolled"))
			continue
		}
		if rerr := s.Taints.Clear(ctx, name); rerr != nil {
			err = errors.Join(err, rerr)
			continue
		}
		n, rerr := s.Store.Node(ctx, name)
		if errors.Is(rerr, ErrNoRecord) {
			continue
		}
		if rerr == nil && n.Status.Verdict != VerdictVerified {
			rerr = s.Taints.Set(ctx, name, n.Spec.Node, VerdictUnverified, "", "posted again while its stale record was swept")
		}
		err = errors.Join(err, rerr)
	}
	s.Metrics.swept(len(gone))
	return len(gone), err
}

// Intake is the list of EKs recorded at intake: sha256 of the EK certificate's public
// key (SubjectPublicKeyInfo DER) or the certificate's serial number, each either bound
// to the one record (the manifest's hostname) its TPM may enrol as, or unbound (any
// record not yet enrolled).
type Intake struct {
	// keys and serials map an entry to the record it binds ("" for none).
	keys, serials map[string]string
}

// ParseIntake reads an intake list: one entry a line, "sha256:<hex>" (the EK's public
// key) or "serial:<hex>" (the EK certificate's serial), optionally followed by the
// record name the TPM may enrol as; '#' starts a comment. An entry listed twice with
// different records is refused: which one the operator meant is not for the control
// plane to guess.
func ParseIntake(b []byte) (*Intake, error) {
	in := &Intake{keys: map[string]string{}, serials: map[string]string{}}
	lineOf := map[string]int{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for line := 1; sc.Scan(); line++ {
		f := sc.Text()
		if i := strings.IndexByte(f, '#'); i >= 0 {
			f = f[:i]
		}
		fields := strings.Fields(f)
		if len(fields) == 0 {
			continue
		}
		if len(fields) > 2 {
			return nil, fmt.Errorf("intake list line %d: %q: want sha256:<hex> or serial:<hex>, then at most a record name", line, manifest.Printable(strings.TrimSpace(f)))
		}
		kind, v, ok := strings.Cut(fields[0], ":")
		v = strings.ToLower(v)
		// A serial is a number in hex (x509's Text(16) writes "a", not "0a").
		if !ok || v == "" || strings.Trim(v, "0123456789abcdef") != "" {
			return nil, fmt.Errorf("intake list line %d: %q: want sha256:<hex> or serial:<hex>", line, manifest.Printable(fields[0]))
		}
		record := ""
		if len(fields) == 2 {
			record = fields[1]
			if errs := validation.IsDNS1123Subdomain(record); len(errs) > 0 {
				return nil, fmt.Errorf("intake list line %d: record %q: %s", line, manifest.Printable(record), strings.Join(errs, "; "))
			}
		}
		var m map[string]string
		switch kind {
		case "sha256":
			if len(v) != 64 {
				return nil, fmt.Errorf("intake list line %d: sha256 of %d hex digits, want 64", line, len(v))
			}
			m = in.keys
		case "serial":
			v = strings.TrimLeft(v, "0")
			m = in.serials
		default:
			return nil, fmt.Errorf("intake list line %d: %q: want sha256:<hex> or serial:<hex>", line, manifest.Printable(kind))
		}
		if prev, ok := m[v]; ok && prev != record {
			return nil, fmt.Errorf("intake list line %d: %s:%s bound to %q, and to %q on line %d", line, kind, v, record, prev, lineOf[kind+v])
		}
		m[v], lineOf[kind+v] = record, line
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("intake list: %w", err)
	}
	return in, nil
}

// EKKey is the intake list's name of an EK certificate's key: "sha256:<hex>".
func EKKey(cert *x509.Certificate) string {
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Check says whether the EK certificate may enrol as record: its key or serial is on
// the list, and no entry that names it binds it to another record (a key entry and a
// serial entry that disagree refuse it).
func (in *Intake) Check(der []byte, record string) error {
	c, err := x509.ParseCertificate(der)
	if err != nil {
		return fmt.Errorf("ek certificate: %v", err)
	}
	key, serial := EKKey(c), c.SerialNumber.Text(16)
	found := false
	for _, e := range []struct {
		m  map[string]string
		id string
	}{{in.keys, strings.TrimPrefix(key, "sha256:")}, {in.serials, strings.TrimLeft(serial, "0")}} {
		bound, ok := e.m[e.id]
		if !ok {
			continue
		}
		found = true
		if bound != "" && bound != record {
			return fmt.Errorf("ek %s (serial %s): recorded at intake for record %s, not %s", key, serial, bound, record)
		}
	}
	if !found {
		return fmt.Errorf("ek %s (serial %s): not on the intake list", key, serial)
	}
	return nil
}
