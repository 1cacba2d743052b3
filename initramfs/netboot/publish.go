package netboot

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"time"
	"unicode"

	"github.com/passage-boot/passage/entropy"
)

// EnvelopeType is the media type of a DSSE envelope (in-toto's registration).
const EnvelopeType = "application/vnd.dsse.envelope.v1+json"

// AttestationType is the media type of passage's attestation of the manifest (package
// attest, manifest/SCHEMA.md), POSTed to the same URL after the envelope.
const AttestationType = "application/vnd.passage.attestation+json"

// PublishPolicy bounds Publish: at most Tries requests, each within PerTry, separated by
// waits that start at Backoff and double up to MaxBackoff.
type PublishPolicy struct {
	Tries      int
	PerTry     time.Duration
	Backoff    time.Duration
	MaxBackoff time.Duration
	// Sleep waits d or until ctx is done; nil is a real timer. Tests record the waits.
	Sleep func(ctx context.Context, d time.Duration) error
	// Pool is the kernel's random pool, which an https URL waits for (TLS makes session
	// keys, and Go's crypto/tls would block in getrandom(2) without a bound); nil is
	// entropy.Kernel. A plain http URL needs no secret (the envelope is signed) and does
	// not wait.
	Pool entropy.Pool
	// Waiting is told what Publish waits on until the returned func is called
	// (stages.Result.Wait); nil: not told.
	Waiting func(what string) (done func())
	// Note hears "waiting for the kernel's random pool" when an https publish has to
	// wait for it; nil: not told.
	Note func(string)
}

func (p PublishPolicy) wait(what string) func() {
	if p.Waiting == nil {
		return func() {}
	}
	return p.Waiting(what)
}

// DefaultPublish is at most 5 tries, 10 s each, with waits of 1, 2, 4, 8 s: under a minute.
var DefaultPublish = PublishPolicy{Tries: 5, PerTry: 10 * time.Second, Backoff: time.Second, MaxBackoff: 8 * time.Second}

// Attempt is one request Publish made.
type Attempt struct {
	Status int    `json:"status,omitempty"` // HTTP status; 0 when no response
	Err    string `json:"error,omitempty"`
	Wait   string `json:"wait_before,omitempty"`
}

// Waits returns the backoff before each try after the first: what Publish would sleep.
func (p PublishPolicy) Waits() []time.Duration {
	var out []time.Duration
	d := p.Backoff
	for i := 1; i < p.Tries; i++ {
		out = append(out, d)
		d *= 2
		if p.MaxBackoff > 0 && d > p.MaxBackoff {
			d = p.MaxBackoff
		}
	}
	return out
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// retryable says whether a status is worth another try: server errors, 408 and 429. Other
// 4xx mean the server refuses this envelope, and asking again will not change its mind.
func retryable(code int) bool {
	return code >= 500 || code == http.StatusRequestTimeout || code == http.StatusTooManyRequests
}

// Publish POSTs body to url as a DSSE envelope, retrying within p. It returns every attempt
// made; the error is the last failure, or nil once the server answered 2xx.
func Publish(ctx context.Context, hc *http.Client, url string, body []byte, p PublishPolicy) ([]Attempt, error) {
	return send(ctx, hc, "publish", http.MethodPost, url, EnvelopeType, body, p)
}

// PublishAttestation POSTs an attestation to url, bounded and retried as Publish is. A
// control plane that has not enrolled the node's TPM answers 428 with a challenge
// (ChallengeType, at most MaxChallenge bytes): its body is returned, with a nil error,
// for the publish stage to answer (PostActivation) before it POSTs the attestation
// again. Any other answer is the attestation's delivery (a 2xx: nil body) or its
// refusal (the error, with the status and the server's reason: a *StatusError).
func PublishAttestation(ctx context.Context, hc *http.Client, url string, body []byte, p PublishPolicy) ([]Attempt, []byte, error) {
	att, rep, err := publishAttestation(ctx, hc, url, body, p)
	if err != nil || rep.status != http.StatusPreconditionRequired {
		return att, nil, err
	}
	return att, rep.body, nil
}

// publishAttestation is PublishAttestation returning the response that ended it: a 428's
// challenge or a 2xx's verdict (at most MaxBody bytes).
func publishAttestation(ctx context.Context, hc *http.Client, url string, body []byte, p PublishPolicy) ([]Attempt, reply, error) {
	return exchangeAnswer(ctx, hc, "publish", http.MethodPost, url, AttestationType, body, p,
		&answer{status: http.StatusPreconditionRequired, ctype: ChallengeType, max: MaxChallenge, what: "challenge"})
}

// Put PUTs body, of media type ctype, to url (a Pushgateway group: the node's last boot
// replaces its previous one), bounded and retried within p exactly as Publish is.
func Put(ctx context.Context, hc *http.Client, url, ctype string, body []byte, p PublishPolicy) ([]Attempt, error) {
	return send(ctx, hc, "put", http.MethodPut, url, ctype, body, p)
}

// send is Publish's and Put's one bounded request loop: an https URL first waits for the
// kernel's random pool within ctx; then at most p.Tries requests, backing off between
// them, no retry of a status the server will answer again.
func send(ctx context.Context, hc *http.Client, verb, method, url, ctype string, body []byte, p PublishPolicy) ([]Attempt, error) {
	att, _, err := exchangeAnswer(ctx, hc, verb, method, url, ctype, body, p, nil)
	return att, err
}

// FetchNonce GETs a nonce from url (passage.url: the control plane answers a GET that
// accepts NonceType with a fresh nonce in hex), bounded and retried within p exactly as
// Publish is. A body that is not 16 to 64 bytes of hex is an error, not retried.
func FetchNonce(ctx context.Context, hc *http.Client, url string, p PublishPolicy) ([]byte, []Attempt, error) {
	att, body, err := exchange(ctx, hc, "nonce", http.MethodGet, url, NonceType, nil, p)
	if err != nil {
		return nil, att, err
	}
	n, err := hex.DecodeString(string(bytes.TrimSpace(body)))
	if err != nil || len(n) < 16 || len(n) > 64 {
		return nil, att, fmt.Errorf("nonce %s: the answer %q is not 16 to 64 bytes of hex", url, bytes.TrimSpace(body))
	}
	return n, att, nil
}

// NonceType is the media type of a nonce from the control plane (attest.NonceType).
const NonceType = "application/vnd.passage.nonce"

// exchange is send returning the body of the successful response (at most MaxBody bytes).
func exchange(ctx context.Context, hc *http.Client, verb, method, url, ctype string, body []byte, p PublishPolicy) ([]Attempt, []byte, error) {
	att, rep, err := exchangeAnswer(ctx, hc, verb, method, url, ctype, body, p, nil)
	return att, rep.body, err
}

// MaxBody bounds what is read of a 2xx answer (a nonce, a verdict): nothing the boot
// needs from one is longer.
const MaxBody = 512

// MaxReason bounds what is read of a refusal's body: the control plane names its reason
// in text/plain within 1 KiB (the enrolment exchange, README), and the reason goes to the
// console and the log, not a page of HTML.
const MaxReason = 1 << 10

// answer is a status other than 2xx that ends the exchange as an answer, not a refusal:
// the control plane's 428 with a challenge. Its content type must be ctype and its body
// at most max bytes; otherwise it is a refusal, not retried (a 4xx).
type answer struct {
	status int
	ctype  string
	max    int64
	what   string // names the body in errors
}

// reply is the response that ended an exchange.
type reply struct {
	status int
	body   []byte
}

// StatusError is a response that was neither 2xx nor an answer the exchange expected:
// the server refused, and Reason is what its body said (text/plain, at most MaxReason
// bytes read, control characters replaced so it stays one line on the console).
type StatusError struct {
	Code   int    // HTTP status code
	Status string // "403 Forbidden"
	Reason string
}

func (e *StatusError) Error() string {
	if e.Reason == "" {
		return e.Status
	}
	return e.Status + ": " + e.Reason
}

// exchangeAnswer is exchange that also ends, without an error, on the status ans names.
func exchangeAnswer(ctx context.Context, hc *http.Client, verb, method, url, ctype string, body []byte, p PublishPolicy, ans *answer) ([]Attempt, reply, error) {
	if hc == nil {
		hc = http.DefaultClient
	}
	// No redirect is followed: after a 301, 302 or 303 a client repeats a POST or PUT as
	// a GET without the body, whose 2xx would be taken for delivery, and a redirect to
	// https would skip the random-pool wait above. Success is a 2xx to the request that
	// carried the body; a 3xx is a refusal naming where the server pointed.
	c := *hc
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	hc = &c
	if p.Tries <= 0 {
		p.Tries = 1
	}
	sleep := p.Sleep
	if sleep == nil {
		sleep = sleepCtx
	}
	if strings.HasPrefix(strings.ToLower(url), "https:") {
		done := p.wait(entropy.Waiting)
		err := entropy.Wait(ctx, p.Pool, verb+" "+url+": TLS", p.Note)
		done()
		if err != nil {
			return nil, reply{}, err
		}
	}
	waits := p.Waits()
	var attempts []Attempt
	var last error
	for i := 0; i < p.Tries; i++ {
		a := Attempt{}
		if i > 0 {
			a.Wait = waits[i-1].String()
			if err := sleep(ctx, waits[i-1]); err != nil {
				return attempts, reply{}, fmt.Errorf("%s %s: %w (after %d tries: %v)", verb, url, err, i, last)
			}
		}
		done := p.wait("a response from " + url)
		code, got, err := request(ctx, hc, method, url, ctype, body, p.PerTry, ans)
		done()
		a.Status = code
		if err == nil {
			attempts = append(attempts, a)
			return attempts, reply{status: code, body: got}, nil
		}
		a.Err = err.Error()
		attempts = append(attempts, a)
		last = err
		if code != 0 && !retryable(code) {
			break
		}
	}
	return attempts, reply{}, fmt.Errorf("%s %s: %d tries: %w", verb, url, len(attempts), last)
}

func request(ctx context.Context, hc *http.Client, method, url, ctype string, body []byte, perTry time.Duration, ans *answer) (int, []byte, error) {
	if perTry > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, perTry)
		defer cancel()
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, err
	}
	if method == http.MethodGet {
		req.Header.Set("Accept", ctype)
	} else {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	code := resp.StatusCode
	if ans != nil && code == ans.status {
		if mt, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type")); err != nil || mt != ans.ctype {
			return code, nil, fmt.Errorf("%s: %s of type %q, want %s", resp.Status, ans.what, resp.Header.Get("Content-Type"), ans.ctype)
		}
		got, err := io.ReadAll(io.LimitReader(resp.Body, ans.max+1))
		if err != nil {
			return code, nil, fmt.Errorf("%s: %s: %w", resp.Status, ans.what, err)
		}
		if int64(len(got)) > ans.max {
			return code, nil, fmt.Errorf("%s: %s over %d bytes: refused unread", resp.Status, ans.what, ans.max)
		}
		return code, got, nil
	}
	if code/100 == 3 {
		return code, nil, fmt.Errorf("%s: redirect to %q not followed (the body goes only to the URL given)", resp.Status, resp.Header.Get("Location"))
	}
	if code/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, MaxReason+1))
		return code, nil, &StatusError{Code: code, Status: resp.Status, Reason: reason(msg)}
	}
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, MaxBody))
	return code, msg, nil
}

// reason is a refusal's body as one console line: at most MaxReason bytes (longer is
// cut and says so), invalid UTF-8 and control characters (a newline, an escape sequence)
// replaced, surrounding space trimmed.
func reason(msg []byte) string {
	cut := len(msg) > MaxReason
	if cut {
		msg = msg[:MaxReason]
	}
	s := strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(string(msg), "?"))
	s = strings.TrimSpace(s)
	if cut {
		s += fmt.Sprintf(" ... (cut at %d bytes)", MaxReason)
	}
	return s
}
