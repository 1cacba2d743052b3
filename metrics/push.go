package metrics

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// PushPolicy bounds a push: at most Tries requests of at most PerTry each, Wait apart.
// The caller's context bounds the whole.
type PushPolicy struct {
	Tries  int
	PerTry time.Duration
	Wait   time.Duration
}

// DefaultPush is the boot's: a Pushgateway that does not answer in 3 x 5 s is down.
var DefaultPush = PushPolicy{Tries: 3, PerTry: 5 * time.Second, Wait: time.Second}

// GroupURL is the Pushgateway URL of one node's group: job "passage", instance the
// node's name, base64url-encoded as the Pushgateway's API allows, so that any name
// (slashes, an empty one) makes a valid path.
func GroupURL(gateway, instance string) string {
	enc := base64.RawURLEncoding.EncodeToString([]byte(instance))
	if enc == "" {
		enc = "=" // the API's spelling of an empty value
	}
	return gateway + "/metrics/job/passage/instance@base64/" + enc
}

// Push replaces the group at url with body (PUT: the node's last boot replaces its
// previous one, whose series would otherwise linger). It returns one line per try; the
// error is the last failure, nil once the gateway answered 2xx.
func Push(ctx context.Context, hc *http.Client, url string, body []byte, p PushPolicy) ([]string, error) {
	if hc == nil {
		hc = http.DefaultClient
	}
	tries := max(p.Tries, 1)
	var log []string
	var last error
	for i := range tries {
		if i > 0 {
			select {
			case <-ctx.Done():
				return log, fmt.Errorf("push %s: %w (after %d tries: %v)", url, ctx.Err(), i, last)
			case <-time.After(p.Wait):
			}
		}
		code, err := put(ctx, hc, url, body, p.PerTry)
		if err == nil {
			log = append(log, fmt.Sprintf("try %d: %d", i+1, code))
			return log, nil
		}
		log = append(log, fmt.Sprintf("try %d: %v", i+1, err))
		last = err
		if code/100 == 4 {
			break // the gateway refused the content: another try gets the same answer
		}
	}
	return log, fmt.Errorf("push %s: %d tries: %w", url, len(log), last)
}

func put(ctx context.Context, hc *http.Client, url string, body []byte, perTry time.Duration) (int, error) {
	if perTry > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, perTry)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, url, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", ContentType)
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, errors.New(resp.Status + ": " + string(bytes.TrimSpace(msg)))
	}
	return resp.StatusCode, nil
}
