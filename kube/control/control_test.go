package control_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	kubefake "k8s.io/client-go/kubernetes/fake"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
)

// The firmware fixture is a real OVMF Secure Boot boot of a signed UKI and the approved
// set computed from that UKI (attest/testdata/README.md says how it was made).
const fixtures = "../../attest/testdata/"

func firmware(t *testing.T) (log []byte, ap *attest.Approved) {
	t.Helper()
	log, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	if ap, err = attest.ReadApproved(fixtures + "ovmf-secureboot.approved.json"); err != nil {
		t.Fatal(err)
	}
	return log, ap
}

// unapproved is the fixture's log with the UKI's Authenticode hash replaced: the same
// firmware and Secure Boot policy starting another image.
func unapproved(t *testing.T, log []byte, ap *attest.Approved) []byte {
	t.Helper()
	h := []byte(ap.Authenticode[0])
	if bytes.Count(log, h) == 0 {
		t.Fatal("the fixture log does not hold the approved Authenticode hash")
	}
	return bytes.ReplaceAll(log, h, bytes.Repeat([]byte{0x5a}, len(h)))
}

type env struct {
	srv *control.Server
	url string
	hc  *http.Client
	dyn dynamic.Interface
	kc  kubernetes.Interface
	ca  *attesttest.CA
	log []byte
	ap  *attest.Approved
	// ruleWrites counts the DeviceTaintRule writes.
	ruleWrites atomic.Int64
}

// newEnv serves a control plane over TLS on loopback with a fake API (the handler's
// logic; the compare-and-swap is tested against the real API server in kube/harness).
func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{ca: attesttest.NewCA(t)}
	e.log, e.ap = firmware(t)
	store := controltest.FakeStore()
	e.dyn = store.Client
	e.kc = kubefake.NewClientset()
	keys, err := control.NewKeys(bytes.Repeat([]byte("k"), control.MinKey))
	if err != nil {
		t.Fatal(err)
	}
	e.srv = &control.Server{Store: store, Taints: &control.Taints{Client: e.kc, Writes: func() { e.ruleWrites.Add(1) }},
		Keys: keys, Approved: e.ap, Metrics: control.NewMetrics()}
	ts := httptest.NewUnstartedServer(e.srv)
	ts.StartTLS()
	t.Cleanup(ts.Close)
	e.url, e.hc = ts.URL, ts.Client()
	return e
}

// node manufactures a node's TPM; the CA (swtpm_localca makes it on first use) is then
// the control plane's EK CA unless the test gave another.
func (e *env) node(t *testing.T, host string) *controltest.Node {
	t.Helper()
	n := controltest.NewNode(t, e.ca, host, e.log)
	if e.srv.EKCA == nil {
		pool, err := attest.CAPool(e.ca.PEM(t))
		if err != nil {
			t.Fatal(err)
		}
		e.srv.EKCA = pool
	}
	return n
}

func (e *env) record(t *testing.T, name string) *control.Node {
	t.Helper()
	n, err := e.srv.Store.Node(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func (e *env) rule(t *testing.T, name string) *resourcev1.DeviceTaintRule {
	t.Helper()
	r, err := e.kc.ResourceV1().DeviceTaintRules().Get(context.Background(), control.RuleName(name), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestEnrolVerify: a new node's first boot is enrolled (428, activation) and verified
// with no other step, in at most 4 API writes; its next boot in at most 2. A bare
// envelope POST changes nothing; the same attestation again is refused as spent, and a
// nonce no replica issued as never issued, the verdict kept.
func TestEnrolVerify(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	n := e.node(t, "b300-a")

	res, err := n.Publish(ctx, e.hc, e.url, e.url)
	if err != nil {
		t.Fatal(err)
	}
	writes := e.srv.Store.Writes() + e.ruleWrites.Load()
	t.Logf("first boot (enrol and verify): %d record writes, %d taint rule writes", e.srv.Store.Writes(), e.ruleWrites.Load())
	if res.Status != http.StatusOK || !res.Enrolled {
		t.Fatalf("publish: %d enrolled=%v: %s", res.Status, res.Enrolled, res.Body)
	}
	if writes > 4 {
		t.Errorf("first boot: %d API writes, want at most 4", writes)
	}
	var v control.VerdictBody
	if err := json.Unmarshal([]byte(res.Body), &v); err != nil || v.Verdict != control.VerdictVerified || v.Record != "b300-a" || v.Generation != 1 {
		t.Fatalf("verdict %s (%v)", res.Body, err)
	}
	rec := e.record(t, "b300-a")
	if rec.Status.Verdict != control.VerdictVerified || rec.Status.Generation != 1 || len(rec.Spec.EKPublic) == 0 || rec.Status.Nonce == nil {
		t.Fatalf("record after enrolment: %+v", rec.Status)
	}
	if r := e.rule(t, "b300-a"); r != nil {
		t.Fatalf("verified node keeps a taint: %+v", r.Spec.Taint)
	}

	// The next generation's bare envelope: nothing kept, nothing changed.
	nonce := getNonce(t, e)
	e.snapshot(t)
	if st, body := e.post(t, control.EnvelopeType, n.NextEnvelope(t)); st != http.StatusAccepted {
		t.Fatalf("envelope: %d %s", st, body)
	}
	e.unchanged(t)
	a, err := n.Attest(nonce)
	if err != nil {
		t.Fatal(err)
	}
	before := e.srv.Store.Writes() + e.ruleWrites.Load()
	if st, body := e.post(t, control.AttestationType, a); st != http.StatusOK {
		t.Fatalf("attestation: %d %s", st, body)
	}
	if w := e.srv.Store.Writes() + e.ruleWrites.Load() - before; w > 2 {
		t.Errorf("reboot: %d API writes, want at most 2", w)
	}
	if rec := e.record(t, "b300-a"); rec.Status.Verdict != control.VerdictVerified || rec.Status.Generation != 2 {
		t.Fatalf("record after the reboot: %s generation %d", rec.Status.Verdict, rec.Status.Generation)
	}

	// The same attestation again (a retry whose first try was recorded): the verdict it
	// has, nothing written. An older one for a newer record: its nonce spent.
	e.snapshot(t)
	st, body := e.post(t, control.AttestationType, a)
	if st != http.StatusOK || !strings.Contains(body, `"generation":2`) {
		t.Fatalf("replay: %d %s", st, body)
	}
	n.NextEnvelope(t)
	stale, err := n.Attest(nonce)
	if err != nil {
		t.Fatal(err)
	}
	if st, body := e.post(t, control.AttestationType, stale); st != http.StatusForbidden || !strings.Contains(body, "nonce: spent") {
		t.Fatalf("generation 3 over generation 2's nonce: %d %s", st, body)
	}
	// A nonce nobody issued.
	b, _ := n.Attest(bytes.Repeat([]byte{7}, control.NonceSize))
	if st, body := e.post(t, control.AttestationType, b); st != http.StatusForbidden || !strings.Contains(body, "never issued") {
		t.Fatalf("unissued nonce: %d %s", st, body)
	}
	e.unchanged(t)
}

// TestUnapprovedImage: an enrolled node booting an unapproved image gets the NoExecute
// taint with the verifier's reason; an approved boot after clears it.
func TestUnapprovedImage(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	n := e.node(t, "b300-a")
	first, err := n.Publish(ctx, e.hc, e.url, e.url)
	if err != nil || first.Status != http.StatusOK {
		t.Fatalf("first boot: %v %+v", err, first)
	}
	n.Reboot(unapproved(t, e.log, e.ap))
	res, err := n.Publish(ctx, e.hc, e.url, e.url)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != http.StatusForbidden || !strings.Contains(res.Body, "not approved") {
		t.Fatalf("unapproved boot: %d %s", res.Status, res.Body)
	}
	rec := e.record(t, "b300-a")
	r := e.rule(t, "b300-a")
	if rec.Status.Verdict != control.VerdictFailed || r == nil || r.Spec.Taint.Key != control.TaintFailed ||
		r.Spec.Taint.Effect != resourcev1.DeviceTaintEffectNoExecute || r.Annotations[control.ReasonAnnotation] != rec.Status.Reason {
		t.Fatalf("after the unapproved boot: record %s %q, rule %+v", rec.Status.Verdict, rec.Status.Reason, r)
	}
	t.Logf("refused: %s; taint %s=%s:%s", rec.Status.Reason, r.Spec.Taint.Key, r.Spec.Taint.Value, r.Spec.Taint.Effect)

	// The verified first boot's attestation, sent again (it is no secret): refused, the
	// failed verdict and its taint stay.
	e.snapshot(t)
	if st, body := e.post(t, control.AttestationType, first.Attestation); st != http.StatusForbidden {
		t.Fatalf("the old verified attestation after the failure: %d %s", st, body)
	}
	e.unchanged(t)

	n.Reboot(e.log)
	if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
		t.Fatalf("approved boot: %v %+v", err, res)
	}
	if r := e.rule(t, "b300-a"); r != nil {
		t.Fatalf("taint after the approved boot: %+v", r.Spec.Taint)
	}
	if rec := e.record(t, "b300-a"); rec.Status.Verdict != control.VerdictVerified || rec.Status.Generation != 3 {
		t.Fatalf("record: %s generation %d", rec.Status.Verdict, rec.Status.Generation)
	}
}

// TestRefusals: each is refused naming why, and nothing is written by the refused
// request (the records' resourceVersions and the rules are as before it).
func TestRefusals(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, e *env)
		run   func(t *testing.T, e *env) (int, string)
		want  string
	}{{
		name: "EK not chained to the CA",
		setup: func(t *testing.T, e *env) {
			ca := attesttest.NewCA(t)
			attesttest.Manufacture(t, ca, filepath.Join(t.TempDir(), "tpm"))
			other, err := attest.CAPool(ca.PEM(t))
			if err != nil {
				t.Fatal(err)
			}
			e.srv.EKCA = other
		},
		run:  attestNew("b300-x"),
		want: "ek certificate: issued by",
	}, {
		name: "EK not on the intake list",
		setup: func(t *testing.T, e *env) {
			e.srv.Intake = intake(t, "# intake\nsha256:"+strings.Repeat("ab", 32)+"\nserial:01 b300-x\n")
		},
		run:  attestNew("b300-x"),
		want: "not on the intake list",
	}, {
		name: "wrong activation answer",
		run: func(t *testing.T, e *env) (int, string) {
			n := e.node(t, "b300-x")
			nonce := getNonce(t, e)
			n.NextEnvelope(t)
			e.snapshot(t)
			a, _ := n.Attest(nonce)
			st, body := e.post(t, control.AttestationType, a)
			if st != http.StatusPreconditionRequired {
				t.Fatalf("attestation: %d %s", st, body)
			}
			var ch control.ChallengeBody
			json.Unmarshal([]byte(body), &ch)
			e.snapshot(t)
			ans, _ := json.Marshal(control.AnswerBody{Format: control.AnswerFormat, Record: ch.Record, State: ch.State,
				AKName: hex.EncodeToString(ch.Challenge.AKName), Answer: base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{1}, 32))})
			return e.post(t, control.ActivationType, ans)
		},
		want: "activation: wrong answer",
	}, {
		name: "a node POSTing for another node's record",
		run: func(t *testing.T, e *env) (int, string) {
			a := e.node(t, "b300-a")
			if res, err := a.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
				t.Fatalf("node a: %v %+v", err, res)
			}
			// Node a's TPM signs a manifest that says it is b300-b: there is no such record,
			// so it is challenged (nothing written), and its answer refused.
			a.Hostname = "b300-b"
			nonce := getNonce(t, e)
			a.NextEnvelope(t)
			att, _ := a.Attest(nonce)
			e.snapshot(t)
			st, body := e.post(t, control.AttestationType, att)
			if st != http.StatusPreconditionRequired {
				t.Fatalf("attestation: %d %s", st, body)
			}
			e.unchanged(t)
			return answer(t, e, a, body)
		},
		want: "record b300-b: this TPM is enrolled as another record",
	}, {
		name: "another TPM attesting an enrolled node's manifest",
		run: func(t *testing.T, e *env) (int, string) {
			a := e.node(t, "b300-a")
			if res, err := a.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
				t.Fatalf("node a: %v %+v", err, res)
			}
			b := e.node(t, "b300-a")
			nonce := getNonce(t, e)
			b.NextEnvelope(t)
			att, _ := b.Attest(nonce)
			e.snapshot(t)
			return e.post(t, control.AttestationType, att)
		},
		want: "record b300-a: enrolled with another TPM",
	}, {
		name: "EK bound at intake to another record",
		run: func(t *testing.T, e *env) (int, string) {
			// The TPM recorded at intake as b300-a's boots with a manifest naming b300-b.
			n := e.node(t, "b300-b")
			e.srv.Intake = intake(t, ekKey(t, n)+" b300-a\n")
			return attestOnly(n)(t, e)
		},
		want: ": recorded at intake for record b300-a, not b300-b",
	}, {
		name: "oversized body",
		run: func(t *testing.T, e *env) (int, string) {
			e.snapshot(t)
			return e.post(t, control.EnvelopeType, bytes.Repeat([]byte{' '}, control.MaxBody+1))
		},
		want: "body: over 1048576 bytes",
	}, {
		name: "oversized attestation",
		run: func(t *testing.T, e *env) (int, string) {
			e.snapshot(t)
			return e.post(t, control.AttestationType, bytes.Repeat([]byte{' '}, control.MaxAttestation+1))
		},
		want: fmt.Sprintf("body: over %d bytes", control.MaxAttestation),
	}, {
		name: "oversized activation answer",
		run: func(t *testing.T, e *env) (int, string) {
			e.snapshot(t)
			return e.post(t, control.ActivationType, bytes.Repeat([]byte{' '}, control.MaxBody+1))
		},
		want: "body: over 1048576 bytes",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			if tc.setup != nil {
				tc.setup(t, e)
			}
			st, body := tc.run(t, e)
			if st/100 != 4 || !strings.Contains(body, tc.want) {
				t.Fatalf("%d %q, want a 4xx naming %q", st, body, tc.want)
			}
			if len(body) > 1024 {
				t.Fatalf("refusal of %d bytes, over 1 KiB", len(body))
			}
			e.unchanged(t)
			t.Logf("%d %s", st, strings.TrimSpace(body))
		})
	}
}

// answer activates the 428 challenge body in n's TPM and POSTs the answer.
func answer(t *testing.T, e *env, n *controltest.Node, body string) (int, string) {
	t.Helper()
	var ch control.ChallengeBody
	if err := json.Unmarshal([]byte(body), &ch); err != nil {
		t.Fatal(err)
	}
	secret, ak, err := n.Answer(ch.Challenge)
	if err != nil {
		t.Fatal(err)
	}
	ans, _ := json.Marshal(control.AnswerBody{Format: control.AnswerFormat, Record: ch.Record, AKName: hex.EncodeToString(ak),
		Answer: base64.StdEncoding.EncodeToString(secret), State: ch.State})
	return e.post(t, control.ActivationType, ans)
}

// attestNew makes a new node POST its envelope and attestation (attestOnly).
func attestNew(host string) func(t *testing.T, e *env) (int, string) {
	return func(t *testing.T, e *env) (int, string) { return attestOnly(e.node(t, host))(t, e) }
}

// attestOnly makes the node POST its envelope and attestation; the snapshot is taken
// between the two.
func attestOnly(n *controltest.Node) func(t *testing.T, e *env) (int, string) {
	return func(t *testing.T, e *env) (int, string) {
		nonce := getNonce(t, e)
		n.NextEnvelope(t)
		a, err := n.Attest(nonce)
		if err != nil {
			t.Fatal(err)
		}
		e.snapshot(t)
		return e.post(t, control.AttestationType, a)
	}
}

func intake(t *testing.T, list string) *control.Intake {
	t.Helper()
	in, err := control.ParseIntake([]byte(list))
	if err != nil {
		t.Fatal(err)
	}
	return in
}

// ekKey is the intake list's name of the node's EK.
func ekKey(t *testing.T, n *controltest.Node) string {
	t.Helper()
	der, err := n.EKCert()
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return control.EKKey(c)
}

// TestIntakeBinding: an intake list binds each EK to the record it may enrol as; the
// TPM of the other node claiming a name bound to another EK is refused at the
// attestation, before any challenge, and the TPMs bound to their own names enrol; an
// unbound entry enrols under any name not yet enrolled. Without a list, the first TPM
// to enrol a name owns it: another TPM's manifest for it is refused, and so is that
// TPM's activation answer for it.
func TestIntakeBinding(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	a, b, c := e.node(t, "b300-a"), e.node(t, "b300-a"), e.node(t, "b300-c")
	e.srv.Intake = intake(t, ekKey(t, a)+" b300-a\n"+ekKey(t, b)+" b300-b\n"+ekKey(t, c)+"\n")
	res, err := b.Publish(ctx, e.hc, e.url, e.url)
	if err != nil || res.Status != http.StatusForbidden || res.Enrolled || !strings.Contains(res.Body, "recorded at intake for record b300-b, not b300-a") {
		t.Fatalf("b's TPM as b300-a: %v %+v", err, res)
	}
	if _, err := e.srv.Store.Node(ctx, "b300-a"); !errors.Is(err, control.ErrNoRecord) {
		t.Fatalf("b's refused claim wrote a record: %v", err)
	}
	for _, n := range []*controltest.Node{a, c} {
		if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK || !res.Enrolled {
			t.Fatalf("%s: %v %+v", n.Hostname, err, res)
		}
	}
	b.Hostname = "b300-b"
	if res, err := b.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK || !res.Enrolled {
		t.Fatalf("b300-b: %v %+v", err, res)
	}

	// No list: d enrols b300-d first; e's TPM then gets no challenge for it, and an
	// answer it made for a challenge issued before d's enrolment is refused.
	e2 := newEnv(t)
	d, x := e2.node(t, "b300-d"), e2.node(t, "b300-d")
	nonce := getNonce(t, e2)
	x.NextEnvelope(t)
	att, _ := x.Attest(nonce)
	st, body := e2.post(t, control.AttestationType, att)
	if st != http.StatusPreconditionRequired {
		t.Fatalf("x's first claim: %d %s", st, body)
	}
	var ch control.ChallengeBody
	if err := json.Unmarshal([]byte(body), &ch); err != nil {
		t.Fatal(err)
	}
	if res, err := d.Publish(ctx, e2.hc, e2.url, e2.url); err != nil || res.Status != http.StatusOK || !res.Enrolled {
		t.Fatalf("d: %v %+v", err, res)
	}
	e2.snapshot(t)
	if st, body := answer(t, e2, x, body); st/100 != 4 {
		t.Fatalf("x's answer after d enrolled b300-d: %d %s", st, body)
	}
	e2.unchanged(t)
	if rec := e2.record(t, "b300-d"); !bytes.Equal(rec.Spec.EKCert, mustEK(t, d)) {
		t.Fatal("b300-d's enrolment is not d's TPM")
	}
}

func mustEK(t *testing.T, n *controltest.Node) []byte {
	t.Helper()
	der, err := n.EKCert()
	if err != nil {
		t.Fatal(err)
	}
	return der
}

var snapshots = map[*env]map[string]string{}

// snapshot notes every object's resourceVersion; unchanged checks none moved.
func (e *env) snapshot(t *testing.T) { snapshots[e] = e.versions(t) }

func (e *env) unchanged(t *testing.T) {
	t.Helper()
	before, ok := snapshots[e]
	if !ok {
		before = map[string]string{}
	}
	after := e.versions(t)
	for k, v := range after {
		if before[k] != v {
			t.Errorf("%s written by the refused request (resourceVersion %q -> %q)", k, before[k], v)
		}
	}
	for k := range before {
		if _, ok := after[k]; !ok {
			t.Errorf("%s deleted by the refused request", k)
		}
	}
}

func (e *env) versions(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	ctx := context.Background()
	for _, gvr := range []schemaGVR{control.NodeResource, control.EKResource} {
		l, err := e.dyn.Resource(gvr).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range l.Items {
			b, _ := json.Marshal(u.Object)
			out[gvr.Resource+"/"+u.GetName()] = string(b)
		}
	}
	rules, err := e.kc.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rules.Items {
		b, _ := json.Marshal(r)
		out["rule/"+r.Name] = string(b)
	}
	return out
}

func getNonce(t *testing.T, e *env) []byte {
	t.Helper()
	resp, err := e.hc.Get(e.url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	n, err := hex.DecodeString(strings.TrimSpace(b.String()))
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET nonce: %s %q", resp.Status, b.String())
	}
	return n
}

func (e *env) post(t *testing.T, ct string, body []byte) (int, string) {
	t.Helper()
	st, b, err := controltest.Post(context.Background(), e.hc, e.url, ct, body)
	if err != nil {
		t.Fatal(err)
	}
	return st, b
}

// TestStrangersWriteNothing: what anyone can send — nonce GETs, envelopes for made-up
// hostnames, attestations with made-up quotes, a name too long for its rule — writes
// nothing at all, while a genuine new node enrols and verifies among them.
func TestStrangersWriteNothing(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a := e.node(t, "b300-a")
	e.snapshot(t)
	for i := range 50 {
		getNonce(t, e)
		host := fmt.Sprintf("made-up-%d", i)
		if st, body := e.post(t, control.EnvelopeType, unsignedEnvelope(t, host)); st != http.StatusAccepted {
			t.Fatalf("%s: %d %s", host, st, body)
		}
		// An attestation by no TPM, with an issued nonce, for a made-up record: the EK
		// does not chain, nothing is written.
		forged, _ := json.Marshal(attest.Attestation{Format: attest.Format, Nonce: getNonce(t, e), EKCert: []byte{1}, Envelope: unsignedEnvelope(t, host)})
		if st, body := e.post(t, control.AttestationType, forged); st != http.StatusForbidden {
			t.Fatalf("forged attestation for %s: %d %s", host, st, body)
		}
	}
	long := strings.Repeat("a", control.MaxRecordName+1)
	forged, _ := json.Marshal(attest.Attestation{Format: attest.Format, Nonce: getNonce(t, e), Envelope: unsignedEnvelope(t, long)})
	if st, body := e.post(t, control.AttestationType, forged); st != http.StatusBadRequest || !strings.Contains(body, "at most 245") {
		t.Fatalf("a hostname of %d characters: %d %s", len(long), st, body)
	}
	e.unchanged(t)
	if w := e.srv.Store.Writes() + e.ruleWrites.Load(); w != 0 {
		t.Fatalf("strangers cost %d API writes", w)
	}
	if res, err := a.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK || !res.Enrolled {
		t.Fatalf("the genuine new node: %v %+v", err, res)
	}
}

// TestMetrics: the exposition after an enrolment and a refusal is what promtool accepts.
func TestMetrics(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not installed (image/deps.sh installs it): %v", err)
	}
	e := newEnv(t)
	ctx := context.Background()
	n := e.node(t, "b300-a")
	if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
		t.Fatalf("publish: %v %+v", err, res)
	}
	e.post(t, control.AttestationType, []byte("{"))
	var b bytes.Buffer
	if err := e.srv.Metrics.Write(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`passage_control_verdicts_total{verdict="verified"} 1`, `passage_control_enrolments_total 1`,
		`passage_control_refusals_total{reason="attestation"} 1`, `passage_control_nonce_to_verdict_seconds_count 1`} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("metrics lack %q:\n%s", want, b.String())
		}
	}
	path := filepath.Join(t.TempDir(), "control.prom")
	os.WriteFile(path, b.Bytes(), 0o600)
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(b.Bytes())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool check metrics: %v\n%s\n%s", err, out, b.String())
	}
}

type schemaGVR = schema.GroupVersionResource
