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
	mrand "math/rand/v2"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

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

// Body bounds: an answer is small; an attestation carries the firmware's event log, up
// to attest.MaxFile in all, and the manifest's envelope within it.
const (
	MaxBody        = 1 << 20
	MaxAttestation = attest.MaxFile
	maxChallenge   = 16 << 10
	maxRefusal     = 1 << 10
)

// ChallengeBody is the 428 answer to an unenrolled TPM's attestation. State is the
// control plane's half of the enrolment, sealed: the answer brings it back.
type ChallengeBody struct {
	Format    string            `json:"format"`
	Record    string            `json:"record"`
	Challenge *attest.Challenge `json:"challenge"`
	State     []byte            `json:"state"`
}

// AnswerBody is the boot's activation answer.
type AnswerBody struct {
	Format string `json:"format"`
	Record string `json:"record"`
	AKName string `json:"ak_name"`
	Answer string `json:"answer"` // base64
	State  []byte `json:"state"`
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
	// Keys are the replicas' shared secrets: nonces and sealed enrolment state.
	Keys *Keys
	// NonceTTL is how long an issued nonce is accepted (0: attest.DefaultNonceTTL).
	NonceTTL time.Duration
	// EKCA are the operator's EK certificate issuers.
	EKCA *x509.CertPool
	// Intake, when not nil, is the list of EKs recorded at intake: a TPM not on it is
	// not enrolled, and one whose entry names a record enrols only as that record.
	// Without it, the first TPM chained to EKCA to complete an enrolment under a
	// record name owns that record from then on.
	Intake *Intake
	// Approved is the approved image; nil checks the TPM's word only (attest.VerifyTPM).
	Approved *attest.Approved
	// Approver, when not nil, approves the kubelet's certificate request for the key of
	// each boot this replica verifies.
	Approver *Approver
	Metrics  *Metrics
	Log      *log.Logger
}

func (s *Server) ttl() time.Duration {
	if s.NonceTTL > 0 {
		return s.NonceTTL
	}
	return attest.DefaultNonceTTL
}

// EnrolTTL is how long a challenge's sealed state is taken back.
const EnrolTTL = 10 * time.Minute

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

// ServeHTTP is the exchange: GET a nonce; POST an attestation or an activation answer by
// its Content-Type. What each costs the API server, at most (a conflict repeats a
// write's read and write, up to retry's bound):
//
//	GET nonce                       nothing
//	POST envelope                   nothing (the attestation carries it)
//	POST attestation, not enrolled  1 read (the record, absent): 428 and sealed state
//	POST attestation, enrolled      1 read (the record); if judged: 1 status write, and
//	                                the rule: verified 1 delete, attestation-failed 1
//	                                read and 1 create or update (none if it says so)
//	  judged so already             1 read (the record); attestation-failed also 1 read
//	                                of the rule and 1 write only when it is not what the
//	                                verdict says (a first try wrote the status, not it)
//	POST activation                 2 creates (the EK claim, the record); if the record's
//	                                create fails, 1 read of it by name (a create whose
//	                                answer was lost is an enrolment made)
//
// So a first boot is 4 writes (claim, record, status, rule), a reboot 2 (status,
// rule); nothing a request costs grows with the fleet, and nothing is written before a
// TPM has answered for it.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var err error
	what := "request" // what a 503 names
	switch r.Method {
	case http.MethodGet:
		what = "nonce"
		err = s.nonce(w)
	case http.MethodPost:
		ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
		switch ct {
		case EnvelopeType:
			what = "envelope"
			err = s.envelope(w, r.Body)
		case AttestationType:
			what = "attestation"
			err = s.attestation(ctx, w, r.Body)
		case ActivationType:
			what = "activation"
			err = s.activation(ctx, w, r.Body)
		default:
			err = refuse(http.StatusUnsupportedMediaType, "content type", "content type %q: POST %s or %s", manifest.Printable(ct), AttestationType, ActivationType)
		}
	default:
		w.Header().Set("Allow", "GET, POST")
		err = refuse(http.StatusMethodNotAllowed, "method", "method %q: GET a nonce or POST", manifest.Printable(r.Method))
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
		w.Header().Set("Retry-After", retryAfter())
	}
	s.Metrics.refused(rf.check)
	if s.Log != nil {
		// %q: nothing a client sent reaches the log raw (a newline in the path would
		// forge a line).
		s.Log.Printf("%s %q (%q): %d %s", manifest.Printable(r.Method), r.URL.Path, r.Header.Get("Content-Type"), rf.status, manifest.Printable(rf.reason))
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

// retryAfter is a 503's Retry-After: 1 to 4 seconds, spread so a storm's retries do
// not arrive together again.
func retryAfter() string {
	return strconv.Itoa(1 + mrand.IntN(4))
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

// nonce issues a nonce: a MAC over the time and randomness, stored nowhere.
func (s *Server) nonce(w http.ResponseWriter) error {
	n, err := s.Keys.Nonce(s.Store.now())
	if err != nil {
		return err
	}
	s.Metrics.issued()
	w.Header().Set("Content-Type", NonceType)
	w.Header().Set("Cache-Control", "no-store")
	fmt.Fprintln(w, hex.EncodeToString(n))
	return nil
}

// envelope answers a bare envelope POST (a boot of before the exchange carried it in the
// attestation, or one with no TPM): 202, nothing kept. An envelope no quote names is
// anyone's to send; the attestation delivers it.
func (s *Server) envelope(w http.ResponseWriter, body io.Reader) error {
	// Discarded unread: the bound on memory holds for any number of these at once.
	if n, err := io.Copy(io.Discard, io.LimitReader(body, MaxBody+1)); err != nil {
		return refuse(http.StatusBadRequest, "body", "body: %v", err)
	} else if n > MaxBody {
		return refuse(http.StatusRequestEntityTooLarge, "body", "body: over %d bytes", MaxBody)
	}
	w.WriteHeader(http.StatusAccepted)
	io.WriteString(w, "not kept: an envelope counts only inside the attestation that names it\n")
	return nil
}

// Cheap says whether r asks the API nothing: a nonce GET or a bare envelope POST (whose
// body is discarded unread). Limit lets these past its bound on API work.
func Cheap(r *http.Request) bool {
	if r.Method == http.MethodGet {
		return true
	}
	ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return r.Method == http.MethodPost && ct == EnvelopeType
}

// retry runs f until its write does not conflict (f reads afresh each time).
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

// CheckRecordName refuses a record name (a manifest's hostname) that is not an object
// name, or whose derived names (the DeviceTaintRule's) would not be.
func CheckRecordName(name string) error {
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return fmt.Errorf("%q: not a record name: %s", manifest.Printable(name), strings.Join(errs, "; "))
	}
	if len(name) > MaxRecordName {
		return fmt.Errorf("%q: %d characters, at most %d (its DeviceTaintRule is %s<name>)", manifest.Printable(name), len(name), MaxRecordName, rulePrefix)
	}
	return nil
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

// attestation judges a boot's attestation and the envelope it carries, or, for a TPM
// not yet enrolled, answers 428 with the credential challenge. Everything a stranger
// can send is refused before the API is asked anything but the record's read: the
// nonce's MAC and age, the envelope's shape and name, and (enrolled) the quote, the
// envelope's signature and the nonce not spent.
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
		return refuse(http.StatusBadRequest, "attestation", "attestation: format %q, want %q", manifest.Printable(a.Format), attest.Format)
	}
	if len(a.Envelope) == 0 {
		return refuse(http.StatusBadRequest, "envelope", "attestation: carries no envelope (the manifest it is for goes in it)")
	}
	var env manifest.Envelope
	if err := json.Unmarshal(a.Envelope, &env); err != nil {
		return refuse(http.StatusBadRequest, "envelope", "attestation: envelope: %v", err)
	}
	payload, err := base64.StdEncoding.DecodeString(env.Payload)
	if err != nil {
		return refuse(http.StatusBadRequest, "envelope", "attestation: envelope: payload: %v", err)
	}
	m, err := manifest.Unmarshal(payload)
	if err != nil {
		return refuse(http.StatusBadRequest, "envelope", "attestation: envelope: payload: %v", err)
	}
	name := m.Node.Hostname
	if err := CheckRecordName(name); err != nil {
		return refuse(http.StatusBadRequest, "envelope", "attestation: node hostname %v", err)
	}
	issued, err := s.Keys.CheckNonce(a.Nonce, s.Store.now(), s.ttl())
	if err != nil {
		return refuse(http.StatusForbidden, "nonce", "record %s: %v", name, err)
	}
	n, err := s.Store.Node(ctx, name)
	if errors.Is(err, ErrNoRecord) || (err == nil && !n.enrolled()) {
		return s.challenge(w, name, &a)
	}
	if err != nil {
		return err
	}
	if !bytes.Equal(n.Spec.EKPublic, a.EKPublic) {
		return refuse(http.StatusForbidden, "record", "record %s: enrolled with another TPM (ek %s), this is ek %s", name, ekID(n.Spec.EKPublic), ekID(a.EKPublic))
	}
	return s.verify(ctx, w, n, &a, issued, payload)
}

func ekID(pub []byte) string {
	sum := sha256.Sum256(pub)
	return "sha256:" + hex.EncodeToString(sum[:8]) + "..."
}

// enrolState is a challenge's sealed state: the record the TPM asked for and the
// control plane's half of the enrolment (no secret: the credential's digest).
type enrolState struct {
	Record  string          `json:"record"`
	AKName  string          `json:"ak_name"`
	Pending *attest.Pending `json:"pending"`
}

const enrolFormat = "passage-control/enrol-state/1"

// challenge starts an unenrolled TPM's enrolment, writing nothing: the nonce was live
// (it is not spent: the boot POSTs the same attestation after activating), the EK
// certificate chains to the EK CA and is on the intake list when one is kept, the quote
// and certification are the AK's; the control plane's half goes sealed in the challenge.
func (s *Server) challenge(w http.ResponseWriter, name string, a *attest.Attestation) error {
	if s.Intake != nil {
		if err := s.Intake.Check(a.EKCert, name); err != nil {
			return refuse(http.StatusForbidden, "intake", "%v", err)
		}
	}
	ch, p, err := attest.Enrol(a, s.EKCA)
	if err != nil {
		return refuse(http.StatusForbidden, strings.ToLower(attest.CheckOf(err)), "%s", lowerFirst(err.Error()))
	}
	st, err := s.Keys.Seal(enrolFormat, enrolState{Record: name, AKName: hex.EncodeToString(ch.AKName), Pending: p}, s.Store.now().Add(EnrolTTL))
	if err != nil {
		return err
	}
	body, err := json.Marshal(ChallengeBody{Format: ChallengeFormat, Record: name, Challenge: ch, State: st})
	if err != nil {
		return err
	}
	if len(body) > maxChallenge {
		return fmt.Errorf("record %s: challenge of %d bytes, over %d", name, len(body), maxChallenge)
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

// activation finishes an enrolment: the answer must be the credential sealed to the EK
// for the AK, and the state the challenge carried. Then, and only then, the TPM claims
// its one record (a create the API server serialises) and the record is created with
// EK, AK and signing key.
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
		return refuse(http.StatusBadRequest, "activation", "activation: format %q, want %q", manifest.Printable(ans.Format), AnswerFormat)
	}
	secret, err := base64.StdEncoding.DecodeString(ans.Answer)
	if err != nil {
		return refuse(http.StatusBadRequest, "activation", "activation: answer: %v", err)
	}
	var st enrolState
	if err := s.Keys.Open(enrolFormat, ans.State, s.Store.now(), &st); err != nil {
		return refuse(http.StatusForbidden, "activation", "activation: %v", err)
	}
	if st.Record != ans.Record || !strings.EqualFold(st.AKName, ans.AKName) || st.Pending == nil {
		return refuse(http.StatusForbidden, "activation", "activation: record %q, ak_name %q: not the challenge's", manifest.Printable(ans.Record), manifest.Printable(ans.AKName))
	}
	rec, err := attest.Complete(st.Pending, secret)
	if err != nil {
		return refuse(http.StatusForbidden, "activation", "activation: wrong answer (%v)", err)
	}
	name := st.Record
	if s.Intake != nil {
		if err := s.Intake.Check(rec.EKCert, name); err != nil {
			return refuse(http.StatusForbidden, "intake", "%v", err)
		}
	}
	// From the claim on, the enrolment is finished even if the boot stops waiting: cut
	// off, it would leave a claim without its record, for the retry to find.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), VerdictTimeout)
	defer cancel()
	made, err := s.Store.ClaimEK(ctx, rec.EKPublic, name)
	if errors.Is(err, ErrClaimed) {
		return refuse(http.StatusForbidden, "record", "record %s: this TPM is enrolled as another record (%v)", name, err)
	}
	if err != nil {
		return err
	}
	now := s.Store.now().UTC()
	n := &Node{Name: name, Labels: map[string]string{EKLabel: labelOf(rec.EKPublic)}, Spec: NodeSpec{Node: name,
		EKCert: rec.EKCert, EKPublic: rec.EKPublic, AKPublic: rec.AKPublic, SigningKeyPublic: rec.SigningKeyPublic, Enrolled: &now}}
	err = retry(ctx, func() error {
		_, err := s.Store.Create(ctx, n)
		if !apierrors.IsAlreadyExists(err) {
			return err
		}
		cur, err := s.Store.Node(ctx, name)
		if errors.Is(err, ErrNoRecord) {
			return apierrors.NewConflict(NodeResource.GroupResource(), name, err) // deleted meanwhile: create again
		}
		if err != nil {
			return err
		}
		switch {
		case !cur.enrolled():
			// A record of before the exchange enrolled on activation: it becomes this one.
			cur.Spec, cur.Labels = n.Spec, n.Labels
			_, err = s.Store.Update(ctx, cur)
			return err
		case bytes.Equal(cur.Spec.EKPublic, rec.EKPublic):
			return nil // a retried or concurrent answer of this enrolment
		}
		return refuse(http.StatusForbidden, "record", "record %s: enrolled with another TPM (ek %s), this is ek %s", name, ekID(cur.Spec.EKPublic), ekID(rec.EKPublic))
	})
	var rf *refusal
	switch {
	case err == nil:
	case errors.As(err, &rf):
		// The record is another TPM's (read, not guessed): this TPM owns no record, and
		// its claim goes, so it can enrol as the one it may.
		if made {
			err = errors.Join(err, s.Store.Unclaim(ctx, rec.EKPublic))
		}
		return err
	default:
		// The create (or update) may have been made with only its answer lost: read the
		// record back. Enrolled with this TPM, the enrolment is done. Otherwise the claim
		// stays whatever the read says: a write whose answer was lost may still land
		// after a read that did not see it, and a record without its claim would let
		// this TPM enrol under a second name. A claim without its record is what the
		// boot's retry completes (ClaimEK finds it naming this record).
		cur, rerr := s.Store.Node(ctx, name)
		if rerr != nil || !bytes.Equal(cur.Spec.EKPublic, rec.EKPublic) {
			return err
		}
		if s.Log != nil {
			s.Log.Printf("activation: record %s: the write answered %v; read back, it is enrolled with this TPM", name, err)
		}
	}
	s.Metrics.enrolled()
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// verify judges an enrolled node's attestation of the envelope it carries:
// attest.VerifyTPM (the quote over this nonce, the signing key, PCR 13 replaying to
// this manifest, no rollback), the nonce not spent for this record, then
// attest.VerifyFirmware against the approved image. A refusal anyone could provoke
// (a forged or stale quote, a log that does not replay, a spent nonce) is answered and
// changes nothing; only evidence (attest.IsEvidence: the TPM's own word over logs that
// replay, showing a rollback or an unapproved boot) makes the verdict
// attestation-failed. A record moves forward only: nothing older than its generation is
// taken, and a failed generation is left only by a newer verified one. The status write
// carries the resourceVersion read, so it also spends the nonce exactly once.
func (s *Server) verify(ctx context.Context, w http.ResponseWriter, n *Node, a *attest.Attestation, issued time.Time, payload []byte) error {
	ver, signer, err := s.verifyEnvelope(n, a.Envelope)
	if err != nil {
		return err
	}
	gen := int64(ver.Manifest.Generation)
	digest := manifest.Digest(payload)
	m := attest.Manifest{Payload: ver.Payload, Generation: ver.Manifest.Generation, Signer: signer}
	res, verr := attest.VerifyTPM(n.record(), a, m, attest.Policy{EKCA: s.EKCA, Nonce: a.Nonce})
	if verr != nil && !attest.IsEvidence(verr) {
		return refuse(http.StatusForbidden, strings.ToLower(attest.CheckOf(verr)), "record %s: %s (nothing changed)", n.Name, lowerFirst(verr.Error()))
	}
	if verr == nil && s.Approved != nil {
		if _, verr = attest.VerifyFirmware(a.FirmwareLog, a.PCRs, s.Approved); verr != nil && !attest.IsEvidence(verr) {
			return refuse(http.StatusForbidden, strings.ToLower(attest.CheckOf(verr)), "record %s: %s (nothing changed)", n.Name, lowerFirst(verr.Error()))
		}
	}
	verdict, reason, check := VerdictVerified, fmt.Sprintf("generation %d attested", gen), ""
	if verr != nil {
		if check = attest.CheckOf(verr); check == "" {
			check = "firmware"
		}
		verdict, reason = VerdictFailed, failedReason(gen, check, verr)
	}
	// Once the judgement is written the rule must follow even if the boot stops
	// waiting: cut off with the request, a verdict would stand with the rule of before.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), VerdictTimeout)
	defer cancel()
	first := true
	same := false
	err = retry(ctx, func() error {
		if !first {
			var err error
			if n, err = s.Store.Node(ctx, n.Name); err != nil {
				return err
			}
		}
		first = false
		if !bytes.Equal(n.Spec.EKPublic, a.EKPublic) {
			return refuse(http.StatusForbidden, "record", "record %s: enrolled with another TPM meanwhile", n.Name)
		}
		if st := n.Status; st.Verdict == verdict && st.Generation == gen && st.Digest == digest {
			// Judged so already (a retry whose first try was recorded, the host attesting
			// the generation its boot delivered): nothing to write, and the same answer.
			same = true
			return nil
		}
		if n.Status.Nonce != nil && !issued.After(*n.Status.Nonce) {
			return refuse(http.StatusForbidden, "nonce", "record %s: nonce: spent (an attestation over a nonce issued at or after it was recorded; fetch a new one)", n.Name)
		}
		switch st := n.Status; {
		case gen < st.Generation:
			return refuse(http.StatusConflict, "generation", "record %s: generation %d is older than %d already judged (nothing changed)", n.Name, gen, st.Generation)
		case st.Verdict == VerdictFailed && verdict == VerdictVerified && gen <= st.Generation:
			return refuse(http.StatusConflict, "generation", "record %s: generation %d failed attestation; only a newer generation verified restores it (nothing changed)", n.Name, st.Generation)
		}
		now := s.Store.now().UTC()
		nonce := issued.UTC()
		n.Status = NodeStatus{Verdict: verdict, Reason: reason, Time: &now, Generation: gen, Digest: digest, Nonce: &nonce,
			ResetCount: n.Status.ResetCount, BootID: ver.Manifest.BootID, KubeletKey: ver.Manifest.Node.KubeletKey}
		if res != nil {
			n.Status.ResetCount = int64(res.Seen.ResetCount)
		}
		_, err := s.Store.UpdateStatus(wctx, n)
		return err
	})
	if err != nil {
		return err
	}
	// The rule follows the record as it now stands (RuleFor, as the reconciler's). A
	// retry of a failed verdict mends it too: its first try may have written the status
	// and failed on the rule (a refusal, a timeout, throttling), which the record does not
	// show. A retry of a verified one deletes nothing: anyone can send that attestation
	// again, and a rule there now may be the reconciler's for a newer generation the pool
	// publishes, which only the reconciler reads; a stale one it removes on its pass.
	if same {
		if want := RuleFor(n, 0); want.Verdict == VerdictFailed {
			if _, err := s.Taints.Mend(wctx, n.Name, n.Spec.Node, want); err != nil {
				return err
			}
		}
	} else {
		if err := s.Taints.Set(wctx, n.Name, n.Spec.Node, RuleFor(n, 0)); err != nil {
			return err
		}
		s.Metrics.verdict(verdict, s.Store.now().Sub(issued))
	}
	if verr != nil {
		return refuse(http.StatusForbidden, strings.ToLower(check), "record %s: %s", n.Name, lowerFirst(verr.Error()))
	}
	// The kubelet's request for the key this boot attested, pending or to come, is
	// approved by this replica at once (no API call: its cache).
	s.Approver.Verified(n.Name, n.Status.KubeletKey)
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(VerdictBody{Record: n.Name, Verdict: verdict, Generation: gen})
}

// VerdictTimeout bounds the writes that record a verdict, which do not stop with the
// request.
const VerdictTimeout = 30 * time.Second

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
