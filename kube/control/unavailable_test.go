package control_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/kube/control"
)

// TestUnavailable: an API that fails is a 503 (the boot retries) naming what was asked,
// and the API's own words (its address, the account) go to the replica's log, not to the
// unauthenticated client.
func TestUnavailable(t *testing.T) {
	const secret = `User "system:serviceaccount:passage-system:passage-control" at https://10.96.0.1:443`
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schemaGVR]string{
		control.NodeResource: "PassageNodeList", control.EKResource: "PassageEKList"})
	dyn.PrependReactor("*", "*", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New(secret + ": connection refused")
	})
	var logged bytes.Buffer
	keys, err := control.NewKeys(bytes.Repeat([]byte("k"), control.MinKey))
	if err != nil {
		t.Fatal(err)
	}
	srv := &control.Server{Store: &control.Store{Client: dyn}, Taints: &control.Taints{Client: kubefake.NewClientset()},
		Keys: keys, Metrics: control.NewMetrics(), Log: log.New(&logged, "", 0)}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	nonce, err := keys.Nonce(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	// An attestation past every check made without the API: its record's read fails.
	att, _ := json.Marshal(attest.Attestation{Format: attest.Format, Nonce: nonce, Envelope: unsignedEnvelope(t, "b300-a")})
	for _, tc := range []struct {
		what, method, ct string
		body             []byte
	}{
		{"attestation", http.MethodPost, control.AttestationType, att},
	} {
		logged.Reset()
		req, _ := http.NewRequest(tc.method, ts.URL, bytes.NewReader(tc.body))
		if tc.ct != "" {
			req.Header.Set("Content-Type", tc.ct)
		}
		resp, err := ts.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.Header.Get("Retry-After") == "" {
			t.Errorf("%s with the API failing: no Retry-After", tc.what)
		}
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.HasPrefix(string(b), tc.what+": ") || strings.Contains(string(b), "serviceaccount") || strings.Contains(string(b), "10.96.0.1") {
			t.Errorf("%s with the API failing: %s %q, want 503 naming %s and not the API's words", tc.what, resp.Status, b, tc.what)
		}
		if !strings.Contains(logged.String(), secret) {
			t.Errorf("%s with the API failing: the log %q does not keep the API's words", tc.what, logged.String())
		}
	}
}
