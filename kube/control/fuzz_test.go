package control_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	kubefake "k8s.io/client-go/kubernetes/fake"

	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
)

// FuzzParseIntake: an intake list is outside bytes; it parses or is refused naming the
// line, and whatever it accepts answers Check without panicking.
func FuzzParseIntake(f *testing.F) {
	f.Add([]byte("sha256:" + strings.Repeat("ab", 32) + "\nserial:01 # a comment\n"))
	f.Add([]byte("serial:\n"))
	f.Add([]byte("sha256:zz\n"))
	f.Add([]byte("serial:0a b300-a\nserial:a b300-b\n"))
	f.Add([]byte("sha256:" + strings.Repeat("ab", 32) + " B300_A\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		in, err := control.ParseIntake(b)
		if err != nil {
			if !strings.Contains(err.Error(), "intake list") {
				t.Fatalf("refusal does not name the list: %v", err)
			}
			return
		}
		if err := in.Check([]byte("not a certificate"), "b300-a"); err == nil {
			t.Fatal("a non-certificate passed the intake list")
		}
	})
}

// FuzzPost: any body POSTed with any of the exchange's types is answered without a
// panic; an attestation or an answer with a 4xx and its reason (the fake API holds no
// enrolled record: nothing can verify), an envelope with a 4xx or, for a well-formed
// manifest, 202.
func FuzzPost(f *testing.F) {
	for _, ct := range []string{control.EnvelopeType, control.AttestationType, control.ActivationType} {
		f.Add(ct, []byte("{}"))
		f.Add(ct, []byte(`{"format":"passage-attestation/1","nonce":"AAAA","passage_log":"AAAA"}`))
		f.Add(ct, []byte(`{"format":"passage-enrol-answer/1","record":"b300-a","ak_name":"00","answer":"AAAA"}`))
		f.Add(ct, []byte(`{"payloadType":"application/vnd.passage.manifest+json","payload":"e30=","signatures":[]}`))
	}
	keys, err := control.NewKeys(bytes.Repeat([]byte("k"), control.MinKey))
	if err != nil {
		f.Fatal(err)
	}
	srv := &control.Server{Store: controltest.FakeStore(), Taints: &control.Taints{Client: kubefake.NewClientset()}, Keys: keys, Metrics: control.NewMetrics()}
	f.Fuzz(func(t *testing.T, ct string, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
		req.Header.Set("Content-Type", ct)
		w := httptest.NewRecorder()
		srv.ServeHTTP(w, req)
		if ct == control.EnvelopeType && w.Code == http.StatusAccepted {
			return
		}
		if w.Code/100 != 4 || w.Body.Len() == 0 || w.Body.Len() > 1024 {
			t.Fatalf("POST %q %q: %d %q", ct, body, w.Code, w.Body.String())
		}
	})
}

// TestParseIntake: the list's refusals name the line and what is wrong with it.
func TestParseIntake(t *testing.T) {
	key := "sha256:" + strings.Repeat("ab", 32)
	for _, tc := range []struct{ list, want string }{
		{key + " b300-a\n" + key + " b300-a # twice, the same\nserial:0A\n", ""},
		{key + " b300-a\n" + key + " b300-b\n", `intake list line 2: sha256:` + strings.Repeat("ab", 32) + ` bound to "b300-b", and to "b300-a" on line 1`},
		{"serial:0a\nserial:a b300-a\n", `intake list line 2: serial:a bound to "b300-a", and to "" on line 1`},
		{key + " B300_A\n", `intake list line 1: record "B300_A"`},
		{key + " b300-a extra\n", "intake list line 1: "},
		{"md5:00\n", `intake list line 1: "md5"`},
	} {
		_, err := control.ParseIntake([]byte(tc.list))
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%q: %v, want %q", tc.list, err, tc.want)
		}
	}
}
