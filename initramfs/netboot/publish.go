package netboot

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

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

// PublishAttestation POSTs an attestation to url, bounded and retried as Publish is.
func PublishAttestation(ctx context.Context, hc *http.Client, url string, body []byte, p PublishPolicy) ([]Attempt, error) {
	return send(ctx, hc, "publish", http.MethodPost, url, AttestationType, body, p)
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
	att, _, err := exchange(ctx, hc, verb, method, url, ctype, body, p)
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

// exchange is send returning the body of the successful response (at most 512 bytes).
func exchange(ctx context.Context, hc *http.Client, verb, method, url, ctype string, body []byte, p PublishPolicy) ([]Attempt, []byte, error) {
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
			return nil, nil, err
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
				return attempts, nil, fmt.Errorf("%s %s: %w (after %d tries: %v)", verb, url, err, i, last)
			}
		}
		done := p.wait("a response from " + url)
		code, got, err := request(ctx, hc, method, url, ctype, body, p.PerTry)
		done()
		a.Status = code
		if err == nil {
			attempts = append(attempts, a)
			return attempts, got, nil
		}
		a.Err = err.Error()
		attempts = append(attempts, a)
		last = err
		if code != 0 && !retryable(code) {
			break
		}
	}
	return attempts, nil, fmt.Errorf("%s %s: %d tries: %w", verb, url, len(attempts), last)
}

func request(ctx context.Context, hc *http.Client, method, url, ctype string, body []byte, perTry time.Duration) (int, []byte, error) {
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
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode/100 == 3 {
		return resp.StatusCode, nil, fmt.Errorf("%s: redirect to %q not followed (the body goes only to the URL given)", resp.Status, resp.Header.Get("Location"))
	}
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, nil, errors.New(resp.Status + ": " + string(bytes.TrimSpace(msg)))
	}
	return resp.StatusCode, msg, nil
}
