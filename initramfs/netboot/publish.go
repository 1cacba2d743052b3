package netboot

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime"
	"net/http"
	"strconv"
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
// waits that start at Backoff and double up to MaxBackoff; or, with For, as many
// requests as fit in For. A 503 or 429 that says when to come back (Retry-After) sets
// the next wait instead of the backoff. Every wait is jittered (jitter), so that nodes
// refused together do not come back together.
type PublishPolicy struct {
	Tries      int
	PerTry     time.Duration
	Backoff    time.Duration
	MaxBackoff time.Duration
	// For, when positive, bounds the exchange in time rather than in tries: it goes on
	// after each retryable answer (or none) until For has passed since it began (or ctx
	// ends), Tries then being no bound, MaxTries the only count. A wait that would end
	// past For (a Retry-After longer than what is left) is not waited: the exchange
	// stops there and says so. The boot's passage.publish_for.
	For time.Duration
	// Rand returns a uniformly random number in [0, n) for the jitter; nil is
	// math/rand/v2, which never waits for the kernel's random pool (entropy_test.go).
	// Tests that assert exact waits return 0: no jitter.
	Rand func(n int64) int64
	// Now is the clock For is measured by; nil is time.Now. Tests whose Sleep records
	// waits advance it.
	Now func() time.Time
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

// MaxTries bounds the requests of one exchange whatever the policy says: with For and a
// server that answers at once, the count still ends.
const MaxTries = 10000

// MaxRetryAfter is the longest Retry-After taken: a longer one (a misconfigured server,
// a date years away) is ignored and the backoff waited instead.
const MaxRetryAfter = time.Hour

func (p PublishPolicy) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}

// jitter spreads a wait. A backoff step d becomes a wait in [d/2, d] (AWS's "equal
// jitter": never longer than the step, never shorter than half of it); a server's
// Retry-After ra one in [ra, 3ra/2] (never sooner than told). With Rand returning 0
// the waits are exactly d and ra.
func (p PublishPolicy) jitter(d time.Duration, told bool) time.Duration {
	spread := d / 2
	if spread <= 0 {
		return d
	}
	r := rand.Int64N
	if p.Rand != nil {
		r = p.Rand
	}
	j := time.Duration(r(int64(spread) + 1))
	if j < 0 || j > spread {
		j = spread
	}
	if told {
		return d + j
	}
	return d - j
}

func (p PublishPolicy) wait(what string) func() {
	if p.Waiting == nil {
		return func() {}
	}
	return p.Waiting(what)
}

// DefaultPublish is at most 5 tries, 10 s each, with waits of at most 1, 2, 4, 8 s (each
// jittered down to half): under a minute.
var DefaultPublish = PublishPolicy{Tries: 5, PerTry: 10 * time.Second, Backoff: time.Second, MaxBackoff: 8 * time.Second}

// Attempt is one request Publish made.
type Attempt struct {
	Status int    `json:"status,omitempty"` // HTTP status; 0 when no response
	Err    string `json:"error,omitempty"`
	Wait   string `json:"wait_before,omitempty"`
	// RetryAfter is the answer's Retry-After, when it had one that was taken.
	RetryAfter string `json:"retry_after,omitempty"`
}

// Waits returns the backoff before each try after the first, before jitter (each wait
// is at most this) and without a server's Retry-After: what Publish would sleep when
// nothing says otherwise.
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
		&answer{status: http.StatusPreconditionRequired, ctype: ChallengeType, max: MaxChallenge, what: "challenge"}, nil)
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
	att, _, err := exchangeAnswer(ctx, hc, verb, method, url, ctype, body, p, nil, nil)
	return att, err
}

// FetchNonce GETs a nonce from url (passage.url: the control plane answers a GET that
// accepts NonceType with a fresh nonce in hex), bounded and retried within p exactly as
// Publish is. Only a whole nonce line is a nonce (parseNonce): an answer that is not one
// is an error, not retried; an answer cut off mid-body (the connection lost, fewer bytes
// than its Content-Length) is a failed try, retried.
func FetchNonce(ctx context.Context, hc *http.Client, url string, p PublishPolicy) ([]byte, []Attempt, error) {
	var nonce []byte
	att, _, err := exchange(ctx, hc, "nonce", http.MethodGet, url, NonceType, nil, p, func(b []byte) error {
		n, err := parseNonce(b)
		nonce = n
		return err
	})
	if err != nil {
		return nil, att, err
	}
	return nonce, att, nil
}

// parseNonce takes a nonce answer as the control plane writes it (fmt.Fprintln of the
// hex): one line, 16 to 64 bytes in hex (a quote's qualifying data holds 64), ended by
// its newline. A prefix of a longer answer can decode as hex of a valid length, so an
// answer without the newline is refused as cut short, not used as a shorter nonce.
func parseNonce(b []byte) ([]byte, error) {
	line, whole := bytes.CutSuffix(b, []byte("\n"))
	line = bytes.TrimSuffix(line, []byte("\r"))
	shown := line
	if len(shown) > 2*64+8 {
		shown = append(shown[:2*64+8:2*64+8], "..."...)
	}
	n, err := hex.DecodeString(string(line))
	switch {
	case err != nil || len(n) < 16 || len(n) > 64:
		return nil, fmt.Errorf("the answer %q is not 16 to 64 bytes of hex", shown)
	case !whole:
		return nil, fmt.Errorf("the answer %q is not a whole line (no newline at its end): cut short, not taken", shown)
	}
	return n, nil
}

// NonceType is the media type of a nonce from the control plane (attest.NonceType).
const NonceType = "application/vnd.passage.nonce"

// exchange is send returning the body of the successful response (at most MaxBody
// bytes), which must be read whole and pass parse: a body cut off is a failed try.
func exchange(ctx context.Context, hc *http.Client, verb, method, url, ctype string, body []byte, p PublishPolicy, parse func([]byte) error) ([]Attempt, []byte, error) {
	att, rep, err := exchangeAnswer(ctx, hc, verb, method, url, ctype, body, p, nil, parse)
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
	// RetryAfter is the wait a 503 or 429 asked for (its Retry-After, in seconds or as
	// an HTTP date), 0 when it named none, or one that is past or over MaxRetryAfter.
	RetryAfter time.Duration
}

func (e *StatusError) Error() string {
	if e.Reason == "" {
		return e.Status
	}
	return e.Status + ": " + e.Reason
}

// cutError is a 2xx whose body could not be read whole (the connection lost mid-body):
// a failed try, retried, never an answer.
type cutError struct{ err error }

func (e *cutError) Error() string { return "answer cut short: " + e.err.Error() }
func (e *cutError) Unwrap() error { return e.err }

// left is how long the exchange may still go on: until deadline (For) and ctx's own
// deadline, whichever is first; ok is false when neither bounds it.
func (p PublishPolicy) left(ctx context.Context, deadline time.Time) (left time.Duration, ok bool) {
	if !deadline.IsZero() {
		left, ok = deadline.Sub(p.now()), true
	}
	if dl, has := ctx.Deadline(); has {
		if l := time.Until(dl); !ok || l < left {
			left, ok = l, true
		}
	}
	return left, ok
}

// exchangeAnswer is exchange that also ends, without an error, on the status ans names;
// parse, when set, must accept a 2xx's body read whole.
func exchangeAnswer(ctx context.Context, hc *http.Client, verb, method, url, ctype string, body []byte, p PublishPolicy, ans *answer, parse func([]byte) error) ([]Attempt, reply, error) {
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
	tries := max(p.Tries, 1)
	var deadline time.Time
	if p.For > 0 {
		tries = MaxTries
		deadline = p.now().Add(p.For)
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, p.For)
		defer cancel()
	}
	tries = min(tries, MaxTries)
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
	var attempts []Attempt
	var last error
	var told time.Duration // the last answer's Retry-After
	step := p.Backoff
	for i := 0; i < tries; i++ {
		a := Attempt{}
		if i > 0 {
			wait := p.jitter(step, false)
			if told > 0 {
				wait = p.jitter(told, true)
			}
			if left, ok := p.left(ctx, deadline); ok && wait >= left {
				why := fmt.Sprintf("the next try would be in %s, %s left", wait.Round(time.Millisecond), max(left, 0).Round(time.Millisecond))
				if told > 0 {
					why = fmt.Sprintf("the server asks for %s more (Retry-After), %s left", told, max(left, 0).Round(time.Millisecond))
				}
				return attempts, reply{}, fmt.Errorf("%s %s: %d tries, no more: %s: %w", verb, url, len(attempts), why, last)
			}
			a.Wait = wait.String()
			if err := sleep(ctx, wait); err != nil {
				return attempts, reply{}, fmt.Errorf("%s %s: %w (after %d tries: %v)", verb, url, err, i, last)
			}
			if step *= 2; p.MaxBackoff > 0 && step > p.MaxBackoff {
				step = p.MaxBackoff
			}
		}
		done := p.wait("a response from " + url)
		code, got, err := request(ctx, hc, method, url, ctype, body, p, ans, parse)
		done()
		a.Status = code
		if err == nil {
			attempts = append(attempts, a)
			return attempts, reply{status: code, body: got}, nil
		}
		told = 0
		var se *StatusError
		if errors.As(err, &se) && se.RetryAfter > 0 {
			told = se.RetryAfter
			a.RetryAfter = told.String()
		}
		a.Err = err.Error()
		attempts = append(attempts, a)
		last = err
		var cut *cutError
		if code != 0 && !retryable(code) && !errors.As(err, &cut) {
			break
		}
	}
	return attempts, reply{}, fmt.Errorf("%s %s: %d tries: %w", verb, url, len(attempts), last)
}

// retryAfter is the wait a Retry-After header asks for (RFC 9110 10.2.3: seconds, or an
// HTTP date), 0 when there is none to take: absent, malformed, past, or over
// MaxRetryAfter (a server's mistake should not park a boot for a day).
func retryAfter(h string, now time.Time) time.Duration {
	h = strings.TrimSpace(h)
	if h == "" {
		return 0
	}
	var d time.Duration
	if secs, err := strconv.ParseInt(h, 10, 64); err == nil {
		if secs <= 0 || secs > int64(MaxRetryAfter/time.Second) {
			return 0
		}
		d = time.Duration(secs) * time.Second
	} else if t, err := http.ParseTime(h); err == nil {
		d = t.Sub(now)
	}
	if d <= 0 || d > MaxRetryAfter {
		return 0
	}
	return d
}

func request(ctx context.Context, hc *http.Client, method, url, ctype string, body []byte, p PublishPolicy, ans *answer, parse func([]byte) error) (int, []byte, error) {
	if p.PerTry > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, p.PerTry)
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
		se := &StatusError{Code: code, Status: resp.Status, Reason: reason(msg)}
		if code == http.StatusServiceUnavailable || code == http.StatusTooManyRequests {
			se.RetryAfter = retryAfter(resp.Header.Get("Retry-After"), p.now())
		}
		return code, nil, se
	}
	if parse == nil {
		// Delivered: what the answer says is for the log, read as far as it goes.
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, MaxBody))
		return code, msg, nil
	}
	msg, err := io.ReadAll(io.LimitReader(resp.Body, MaxBody+1))
	if err != nil {
		return code, nil, fmt.Errorf("%s: %w", resp.Status, &cutError{err})
	}
	if len(msg) > MaxBody {
		return code, nil, fmt.Errorf("%s: answer over %d bytes: refused unread", resp.Status, MaxBody)
	}
	if err := parse(msg); err != nil {
		return code, nil, fmt.Errorf("%s: %w", resp.Status, err)
	}
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
