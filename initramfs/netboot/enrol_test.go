package netboot

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

type reply1 struct {
	code  int
	ctype string
	body  string
}

// TestPublishAttestationAnswers: the attestation POST's answers. A 2xx delivers it; a 428
// with the challenge type returns its body (at most 16 KiB) and is not retried; a 428 of
// another type, or over the bound, is a refusal, not retried; a refusal's text/plain
// reason reaches the error (and so the attempt), cut at 1 KiB and kept on one line; a
// 503 is retried within the policy's tries, and the last one bounds it.
func TestPublishAttestationAnswers(t *testing.T) {
	challenge := `{"format":"passage-enrol-challenge/1","record":"node-a","challenge":{}}`
	long := strings.Repeat("r", 2000)
	for _, tc := range []struct {
		name      string
		replies   []reply1
		tries     int    // requests made
		challenge string // the body returned
		err       string // words of the error ("" for none)
		code      int    // the *StatusError's code, when one
	}{
		{"accepted", []reply1{{200, "application/json", `{"verdict":"verified"}`}}, 1, "", "", 0},
		{"challenge", []reply1{{428, ChallengeType, challenge}}, 1, challenge, "", 0},
		{"challenge with parameters", []reply1{{428, ChallengeType + "; charset=utf-8", challenge}}, 1, challenge, "", 0},
		{"challenge at the bound", []reply1{{428, ChallengeType, strings.Repeat(" ", MaxChallenge)}}, 1, strings.Repeat(" ", MaxChallenge), "", 0},
		{"challenge over the bound", []reply1{{428, ChallengeType, strings.Repeat(" ", MaxChallenge+1)}}, 1, "", "challenge over 16384 bytes: refused unread", 0},
		{"428 of another type", []reply1{{428, "text/html", "<html>"}}, 1, "", `challenge of type "text/html", want application/vnd.passage.challenge+json`, 0},
		{"refused with a reason", []reply1{{403, "text/plain", "ek certificate: not chained to the EK CA\n"}}, 1, "",
			"403 Forbidden: ek certificate: not chained to the EK CA", 403},
		{"reason on one line", []reply1{{403, "text/plain", "nonce 1a2b: already used\n\x1b[2Jforged line"}}, 1, "",
			"403 Forbidden: nonce 1a2b: already used  [2Jforged line", 403},
		{"reason cut at 1 KiB", []reply1{{409, "text/plain", long}}, 1, "",
			"409 Conflict: " + long[:MaxReason] + " ... (cut at 1024 bytes)", 409},
		{"503 retried", []reply1{{503, "text/plain", "busy"}, {200, "", ""}}, 2, "", "", 0},
		{"503 bounded", []reply1{{503, "text/plain", "busy"}, {503, "text/plain", "busy"}, {503, "text/plain", "still busy"}}, 3, "",
			"3 tries: 503 Service Unavailable: still busy", 503},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			n := 0
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("Content-Type") != AttestationType {
					t.Errorf("content type %q", r.Header.Get("Content-Type"))
				}
				mu.Lock()
				rep := tc.replies[min(n, len(tc.replies)-1)]
				n++
				mu.Unlock()
				if rep.ctype != "" {
					w.Header().Set("Content-Type", rep.ctype)
				}
				w.WriteHeader(rep.code)
				io.WriteString(w, rep.body)
			}))
			defer srv.Close()
			var waits []time.Duration
			p := PublishPolicy{Tries: 3, Backoff: time.Second, Sleep: func(_ context.Context, d time.Duration) error { waits = append(waits, d); return nil }}
			att, ch, err := PublishAttestation(context.Background(), nil, srv.URL, []byte("{}"), p)
			if len(att) != tc.tries || n != tc.tries {
				t.Errorf("%d attempts, %d requests, want %d: %+v", len(att), n, tc.tries, att)
			}
			if len(waits) != tc.tries-1 {
				t.Errorf("waits %v for %d tries", waits, tc.tries)
			}
			if string(ch) != tc.challenge {
				t.Errorf("challenge %q, want %q", ch, tc.challenge)
			}
			if tc.err == "" {
				if err != nil {
					t.Errorf("error %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("error %v, want %q", err, tc.err)
			}
			var se *StatusError
			if got := errors.As(err, &se); got != (tc.code != 0) || got && se.Code != tc.code {
				t.Errorf("status error %v (%+v), want code %d", got, se, tc.code)
			}
			if last := att[len(att)-1]; !strings.Contains(last.Err, strings.TrimPrefix(tc.err, "3 tries: ")) && tc.code != 0 {
				t.Errorf("the last attempt's error %q lacks the reason %q", last.Err, tc.err)
			}
		})
	}
}

// TestPostActivation: the answer's wire shape (the protocol's field names, ak_name in hex,
// answer in base64, the activation media type), a 204 accepted.
func TestPostActivation(t *testing.T) {
	var got map[string]any
	var ctype string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctype = r.Header.Get("Content-Type")
		b, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(b, &got); err != nil {
			t.Errorf("body %s: %v", b, err)
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	c := &EnrolChallenge{Format: ChallengeFormat, Record: "node-a"}
	secret := []byte{1, 2, 3, 0xff}
	att, err := PostActivation(context.Background(), nil, srv.URL, NewAnswer(c, []byte{0x00, 0x0b, 0xab}, secret), PublishPolicy{Tries: 1})
	if err != nil || len(att) != 1 || att[0].Status != 204 {
		t.Fatalf("%+v %v", att, err)
	}
	if ctype != "application/vnd.passage.activation+json" {
		t.Errorf("content type %q", ctype)
	}
	want := map[string]any{"format": "passage-enrol-answer/1", "record": "node-a", "ak_name": "000bab", "answer": base64.StdEncoding.EncodeToString(secret)}
	if len(got) != len(want) {
		t.Errorf("body %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
}

func TestParseChallenge(t *testing.T) {
	for _, tc := range []struct {
		name, body, err string
	}{
		{"good", `{"format":"passage-enrol-challenge/1","record":"node-a","challenge":{"format":"passage-attest-challenge/1"}}`, ""},
		{"another format", `{"format":"passage-enrol-challenge/2","record":"node-a","challenge":{}}`, `format "passage-enrol-challenge/2"`},
		{"no record", `{"format":"passage-enrol-challenge/1","challenge":{}}`, "no record name"},
		{"record with a newline", `{"format":"passage-enrol-challenge/1","record":"a\nb","challenge":{}}`, "not printable"},
		{"record too long", `{"format":"passage-enrol-challenge/1","record":"` + strings.Repeat("a", 254) + `","challenge":{}}`, "over 253"},
		{"no challenge", `{"format":"passage-enrol-challenge/1","record":"node-a"}`, "no challenge object"},
		{"challenge not an object", `{"format":"passage-enrol-challenge/1","record":"node-a","challenge":"x"}`, "no challenge object"},
		{"trailing data", `{"format":"passage-enrol-challenge/1","record":"node-a","challenge":{}} {}`, "trailing data"},
		{"not JSON", `<html>`, "challenge: invalid character"},
		{"record given twice", `{"format":"passage-enrol-challenge/1","record":"node-a","record":"node-b","challenge":{}}`, `duplicate key "record" in $`},
		// encoding/json matches keys case-insensitively: "Record" would replace "record".
		{"record given twice in two cases", `{"format":"passage-enrol-challenge/1","record":"node-a","Record":"node-b","challenge":{}}`, `duplicate key "Record" in $ (also given as "record"`},
		{"a key twice inside the challenge", `{"format":"passage-enrol-challenge/1","record":"node-a","challenge":{"secret":"AA==","secret":"AQ=="}}`, `duplicate key "secret" in $.challenge`},
		{"nested too deep", `{"format":"passage-enrol-challenge/1","record":"node-a","challenge":{"a":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `}}`, "nested deeper than 64 levels"},
		{"over the bound", strings.Repeat(" ", MaxChallenge+1), "over 16384"},
	} {
		c, err := ParseChallenge([]byte(tc.body))
		if tc.err == "" {
			if err != nil || c.Record != "node-a" {
				t.Errorf("%s: %+v %v", tc.name, c, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.err)
		}
	}
}

// FuzzParseChallenge: the 428's body comes from the network; nothing panics, and what is
// accepted has the format, a bounded printable record and a challenge object.
func FuzzParseChallenge(f *testing.F) {
	f.Add([]byte(`{"format":"passage-enrol-challenge/1","record":"node-a","challenge":{"format":"passage-attest-challenge/1"}}`))
	f.Add([]byte(`{"format":"passage-enrol-challenge/1","record":"","challenge":null}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseChallenge(b)
		if err != nil {
			return
		}
		if c.Format != ChallengeFormat || c.Record == "" || len(c.Record) > MaxRecordName || len(c.Challenge) == 0 {
			t.Fatalf("accepted %+v", c)
		}
	})
}

// TestDeliverAttestation: the one enrolment exchange. A 200 hands back its verdict; a
// 428 is answered through the Activator with the challenge's record and body, the answer
// POSTed, the same attestation POSTed again; with no Activator the 428 is an error naming
// the record, and nothing is answered; a second 428 is an error, not a second round.
func TestDeliverAttestation(t *testing.T) {
	challenge := `{"format":"passage-enrol-challenge/1","record":"node-a","challenge":{"x":1}}`
	p := PublishPolicy{Tries: 1}
	for _, tc := range []struct {
		name     string
		attests  []reply1 // answers to the attestation POSTs, in order
		activate bool
		record   string
		verdict  string
		err      string
		posts    []string // content types POSTed, in order
	}{
		{"verified", []reply1{{200, "application/json", `{"verdict":"verified"}`}}, true, "", `{"verdict":"verified"}`, "",
			[]string{AttestationType}},
		{"enrolled", []reply1{{428, ChallengeType, challenge}, {200, "application/json", `{"verdict":"verified"}`}}, true, "node-a",
			`{"verdict":"verified"}`, "", []string{AttestationType, ActivationType, AttestationType}},
		{"no TPM", []reply1{{428, ChallengeType, challenge}}, false, "", "", "record node-a: the control plane challenges this TPM and there is no TPM to answer",
			[]string{AttestationType}},
		{"challenged twice", []reply1{{428, ChallengeType, challenge}, {428, ChallengeType, challenge}}, true, "node-a", "",
			"challenged again after enrolment as record node-a", []string{AttestationType, ActivationType, AttestationType}},
		{"refused", []reply1{{403, "text/plain", "not approved"}}, true, "", "", "403 Forbidden: not approved", []string{AttestationType}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var posts []string
			n := 0
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				defer mu.Unlock()
				ct := r.Header.Get("Content-Type")
				posts = append(posts, ct)
				if ct == ActivationType {
					var a EnrolAnswer
					if err := json.NewDecoder(r.Body).Decode(&a); err != nil || a.Record != "node-a" || string(a.Answer) != "secret" || a.AKName != "616b" {
						t.Errorf("answer %+v (%v)", a, err)
					}
					return
				}
				rep := tc.attests[min(n, len(tc.attests)-1)]
				n++
				w.Header().Set("Content-Type", rep.ctype)
				w.WriteHeader(rep.code)
				io.WriteString(w, rep.body)
			}))
			defer srv.Close()
			var act Activator
			if tc.activate {
				act = func(record string, c json.RawMessage) ([]byte, []byte, error) {
					if record != "node-a" || string(c) != `{"x":1}` {
						t.Errorf("activator given %s %s", record, c)
					}
					return []byte("ak"), []byte("secret"), nil
				}
			}
			d, err := DeliverAttestation(context.Background(), nil, srv.URL, []byte("{}"), act, p)
			if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("error %v, want %q", err, tc.err)
			}
			if d.Record != tc.record || string(d.Verdict) != tc.verdict || strings.Join(posts, " ") != strings.Join(tc.posts, " ") {
				t.Errorf("record %q verdict %q posts %v; want %q %q %v", d.Record, d.Verdict, posts, tc.record, tc.verdict, tc.posts)
			}
		})
	}
}
