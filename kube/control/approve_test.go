package control_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"

	"github.com/passage-boot/passage/attest/softtpm"
	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
)

// bootKey makes the kubelet's key as the boot does (kubelet.Make, the TPM's bytes here
// from crypto/rand) and returns it with its digest. The kubelet's own loader
// (keyutil.LoadOrGenerateKeyFile, what its bootstrap calls on the file) takes it as it
// is, making no key of its own.
func bootKey(t *testing.T) (*ecdsa.PrivateKey, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "kubelet")
	os.Mkdir(dir, 0o755)
	digest, err := kubelet.Make(dir, func(n int) ([]byte, error) {
		b := make([]byte, n)
		rand.Read(b)
		return b, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, kubelet.KeyFile)
	written, _ := os.ReadFile(path)
	data, generated, err := keyutil.LoadOrGenerateKeyFile(path)
	if err != nil || generated || !bytes.Equal(data, written) {
		t.Fatalf("the kubelet's loader on the boot's key: generated %v, %v", generated, err)
	}
	k, err := keyutil.ParsePrivateKeyPEM(data)
	if err != nil {
		t.Fatal(err)
	}
	key := k.(*ecdsa.PrivateKey)
	if d, _ := kubelet.Digest(key.Public()); d != digest {
		t.Fatalf("digest %s, Make said %s", d, digest)
	}
	return key, digest
}

// requestPEM is the request the kubelet's bootstrap makes for node (certutil.MakeCSR,
// subject CN=system:node:<node>, O=system:nodes, no names), or with subject and names
// given.
func requestPEM(t *testing.T, key crypto.Signer, subject pkix.Name, dns []string, ips []net.IP) []byte {
	t.Helper()
	b, err := certutil.MakeCSR(key, &subject, dns, ips)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func nodeSubject(node string) pkix.Name {
	return pkix.Name{CommonName: "system:node:" + node, Organization: []string{"system:nodes"}}
}

var kubeletUsages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}

func csrObject(name string, req []byte, requester string, usages ...certificatesv1.KeyUsage) *certificatesv1.CertificateSigningRequest {
	if usages == nil {
		usages = kubeletUsages
	}
	return &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: name, CreationTimestamp: metav1.Now()},
		Spec: certificatesv1.CertificateSigningRequestSpec{Request: req, SignerName: control.KubeletSigner, Usages: usages,
			Username: requester, Groups: []string{"system:bootstrappers", "system:authenticated"}},
	}
}

// TestJudge: what the approver takes as the kubelet's request, without the API: the
// bootstrap's own request (by a bootstrap token, or by the node itself), and nothing
// else: another signer, subject, extra name or usage, a broken signature, another
// requester.
func TestJudge(t *testing.T) {
	key, digest := bootKey(t)
	good := requestPEM(t, key, nodeSubject("b300-a"), nil, nil)
	rsaUsages := []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageKeyEncipherment, certificatesv1.UsageClientAuth}
	p, _ := pem.Decode(good)
	broken := bytes.Clone(p.Bytes)
	broken[len(broken)-3] ^= 1 // in the signature
	brokenPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: broken})
	withOU := nodeSubject("b300-a")
	withOU.OrganizationalUnit = []string{"x"}
	for name, tc := range map[string]struct {
		csr  *certificatesv1.CertificateSigningRequest
		want string // "" taken
	}{
		"the bootstrap's request":         {csrObject("a", good, "system:bootstrap:abcdef"), ""},
		"by the node itself":              {csrObject("a", good, "system:node:b300-a"), ""},
		"with key encipherment":           {csrObject("a", good, "system:bootstrap:abcdef", rsaUsages...), ""},
		"by another node":                 {csrObject("a", good, "system:node:b300-b"), control.CSRRequester},
		"by a service account":            {csrObject("a", good, "system:serviceaccount:default:x"), control.CSRRequester},
		"server auth":                     {csrObject("a", good, "system:bootstrap:abcdef", certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth), control.CSRNotKubelet},
		"client auth alone":               {csrObject("a", good, "system:bootstrap:abcdef", certificatesv1.UsageClientAuth), control.CSRNotKubelet},
		"a DNS name":                      {csrObject("a", requestPEM(t, key, nodeSubject("b300-a"), []string{"b300-a"}, nil), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"an IP address":                   {csrObject("a", requestPEM(t, key, nodeSubject("b300-a"), nil, []net.IP{net.IPv4(10, 0, 0, 1)}), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"another organization":            {csrObject("a", requestPEM(t, key, pkix.Name{CommonName: "system:node:b300-a", Organization: []string{"system:masters"}}, nil, nil), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"two organizations":               {csrObject("a", requestPEM(t, key, pkix.Name{CommonName: "system:node:b300-a", Organization: []string{"system:nodes", "system:masters"}}, nil, nil), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"another attribute":               {csrObject("a", requestPEM(t, key, withOU, nil, nil), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"not a node":                      {csrObject("a", requestPEM(t, key, pkix.Name{CommonName: "admin", Organization: []string{"system:nodes"}}, nil, nil), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"a node name that is no record's": {csrObject("a", requestPEM(t, key, nodeSubject("B300_A"), nil, nil), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"a broken signature":              {csrObject("a", brokenPEM, "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"not PEM":                         {csrObject("a", []byte("junk"), "system:bootstrap:abcdef"), control.CSRNotKubelet},
		"another signer": {func() *certificatesv1.CertificateSigningRequest {
			c := csrObject("a", good, "system:bootstrap:abcdef")
			c.Spec.SignerName = "kubernetes.io/kube-apiserver-client"
			return c
		}(), control.CSRNotKubelet},
		"a request that fills the whole bound": {csrObject("a", bytes.Repeat([]byte{'x'}, 1<<20), "system:bootstrap:abcdef"), control.CSRNotKubelet},
	} {
		t.Run(name, func(t *testing.T) {
			node, key, result, why := control.Judge(tc.csr)
			if result != tc.want {
				t.Fatalf("result %q (%s), want %q", result, why, tc.want)
			}
			if tc.want == "" && (node != "b300-a" || key != digest) {
				t.Errorf("node %q key %q, want b300-a %s", node, key, digest)
			}
			if tc.want != "" && why == "" {
				t.Error("no reason given")
			}
		})
	}
}

// TestJudgeRecord: the record decides: approved only when it is verified and its
// attested kubelet key is the request's.
func TestJudgeRecord(t *testing.T) {
	const k1, k2 = "sha256:" + "11111111111111111111111111111111" + "11111111111111111111111111111111", "sha256:" + "22222222222222222222222222222222" + "22222222222222222222222222222222"
	rec := func(verdict, key string) *control.Node {
		return &control.Node{Name: "b300-a", Status: control.NodeStatus{Verdict: verdict, Generation: 4, KubeletKey: key, BootID: "b0071d", Reason: "why"}}
	}
	for name, tc := range map[string]struct {
		n    *control.Node
		want string
	}{
		"verified, its key":          {rec(control.VerdictVerified, k1), control.CSRApproved},
		"verified, another key":      {rec(control.VerdictVerified, k2), control.CSRKeyMismatch},
		"verified, no key attested":  {rec(control.VerdictVerified, ""), control.CSRKeyMismatch},
		"attestation-failed its key": {rec(control.VerdictFailed, k1), control.CSRNotVerified},
		"enrolled, never judged":     {rec("", ""), control.CSRNotVerified},
		"no record":                  {nil, control.CSRNoRecord},
	} {
		result, why := control.JudgeRecord("b300-a", k1, tc.n)
		if result != tc.want || why == "" {
			t.Errorf("%s: %q (%s), want %q", name, result, why, tc.want)
		}
	}
}

// approvals counts the approval writes the fake API saw, by request.
func approvals(kc *kubefake.Clientset) map[string]int {
	out := map[string]int{}
	for _, a := range kc.Actions() {
		if a.GetResource().Resource == "certificatesigningrequests" && a.GetVerb() == "update" {
			u := a.(k8stesting.UpdateAction)
			out[u.GetSubresource()+" "+u.GetObject().(*certificatesv1.CertificateSigningRequest).Name]++
		}
	}
	return out
}

// TestApprover: two replicas' approvers on the fake API, the first verifying the boots
// (Server.Approver), the second not (Grace 1 s). A request made before its boot was
// verified is approved by the verifying replica as the verdict is written (its Grace is an
// hour: only Verified can have done it), with one approval write in all; a request for
// another key of the verified node, for a node that never enrolled, for a node whose
// attestation failed, or not the kubelet's, stays pending (the second replica judged
// each, naming why), with no write; a reboot verified with a new key gets its new
// request approved and a new request for the old key not.
func TestApprover(t *testing.T) {
	e, ca, fw := softEnv(t)
	kc := e.kc.(*kubefake.Clientset)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m1, m2 := control.NewMetrics(), control.NewMetrics()
	verifier := &control.Approver{Client: kc, Store: e.srv.Store, Metrics: m1, Grace: time.Hour, Log: log.New(testLog{t}, "replica 1: ", 0)}
	other := &control.Approver{Client: kc, Store: e.srv.Store, Metrics: m2, Grace: time.Second, Log: log.New(testLog{t}, "replica 2: ", 0)}
	e.srv.Approver = verifier
	go verifier.Run(ctx)
	go other.Run(ctx)
	waitUntil(t, 10*time.Second, "the approvers' caches", func() bool { return verifier.Synced() && other.Synced() })

	csrs := kc.CertificatesV1().CertificateSigningRequests()
	create := func(c *certificatesv1.CertificateSigningRequest) {
		t.Helper()
		if _, err := csrs.Create(ctx, c, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	get := func(name string) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		c, err := csrs.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	approvedBy := func(name string) string {
		for _, c := range get(name).Status.Conditions {
			if c.Type == certificatesv1.CertificateApproved {
				return c.Reason + ": " + c.Message
			}
		}
		return ""
	}
	boot := func(n *controltest.SoftNode, wantErr string) {
		t.Helper()
		_, err := n.Boot(ctx, e.hc, e.url, netboot.PublishPolicy{Tries: 1})
		if (wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), wantErr)) {
			t.Fatalf("boot of %s: %v, want %q", n.Hostname, err, wantErr)
		}
	}

	// (a) The node's kubelet asks before its boot is verified; the verdict approves it.
	node := softNode(t, ca, fw, "b300-k")
	k1, d1 := bootKey(t)
	node.KubeletKey = d1
	if err := node.Sign(ctx, node.Hostname, 1); err != nil {
		t.Fatal(err)
	}
	create(csrObject("node-csr-a", requestPEM(t, k1, nodeSubject("b300-k"), nil, nil), "system:bootstrap:abcdef"))
	boot(node, "")
	if rec := e.record(t, "b300-k"); rec.Status.KubeletKey != d1 || rec.Status.Verdict != control.VerdictVerified {
		t.Fatalf("record: %s, kubelet key %q, want %s", rec.Status.Verdict, rec.Status.KubeletKey, d1)
	}
	waitUntil(t, 10*time.Second, "node-csr-a approved", func() bool { return approvedBy("node-csr-a") != "" })
	if got := approvedBy("node-csr-a"); !strings.HasPrefix(got, control.ApprovedReason+": record b300-k verified at generation 1") || !strings.Contains(got, d1) {
		t.Errorf("approval: %s", got)
	}

	// (b)-(d) and requests that are not the kubelet's: the second replica judges each
	// after its Grace, leaving it pending.
	other1, _ := bootKey(t)
	failed := softNode(t, ca, mustFirmware(t, unapproved(t, e.log, e.ap)), "b300-f")
	k3, d3 := bootKey(t)
	failed.KubeletKey = d3
	if err := failed.Sign(ctx, failed.Hostname, 1); err != nil {
		t.Fatal(err)
	}
	boot(failed, "not approved")
	if rec := e.record(t, "b300-f"); rec.Status.Verdict != control.VerdictFailed || rec.Status.KubeletKey != d3 {
		t.Fatalf("record b300-f: %s, key %q", rec.Status.Verdict, rec.Status.KubeletKey)
	}
	ghost, _ := bootKey(t)
	pending := map[string]string{
		"other-key":   control.CSRKeyMismatch,
		"failed-boot": control.CSRNotVerified,
		"never":       control.CSRNoRecord,
		"server-auth": control.CSRNotKubelet,
		"a-pod":       control.CSRRequester,
	}
	create(csrObject("other-key", requestPEM(t, other1, nodeSubject("b300-k"), nil, nil), "system:bootstrap:abcdef"))
	create(csrObject("failed-boot", requestPEM(t, k3, nodeSubject("b300-f"), nil, nil), "system:bootstrap:abcdef"))
	create(csrObject("never", requestPEM(t, ghost, nodeSubject("b300-ghost"), nil, nil), "system:bootstrap:abcdef"))
	create(csrObject("server-auth", requestPEM(t, k1, nodeSubject("b300-k"), nil, nil), "system:bootstrap:abcdef", certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth))
	create(csrObject("a-pod", requestPEM(t, k1, nodeSubject("b300-k"), nil, nil), "system:serviceaccount:default:x"))
	waitUntil(t, 15*time.Second, "the second replica's judgements", func() bool {
		c := counts(t, m2)
		return c[control.CSRKeyMismatch] >= 1 && c[control.CSRNotVerified] >= 1 && c[control.CSRNoRecord] >= 1 && c[control.CSRNotKubelet] >= 1 && c[control.CSRRequester] >= 1
	})
	for name := range pending {
		if got := approvedBy(name); got != "" {
			t.Errorf("%s approved: %s", name, got)
		}
	}

	// (e) A reboot verified with a new key: its request approved, a new request for the
	// previous boot's key not.
	k4, d4 := bootKey(t)
	node.KubeletKey = d4
	if err := node.Reboot(ctx, fw, node.Hostname, 2); err != nil {
		t.Fatal(err)
	}
	boot(node, "")
	create(csrObject("old-key", requestPEM(t, k1, nodeSubject("b300-k"), nil, nil), "system:bootstrap:abcdef"))
	create(csrObject("node-csr-e", requestPEM(t, k4, nodeSubject("b300-k"), nil, nil), "system:bootstrap:abcdef"))
	waitUntil(t, 10*time.Second, "node-csr-e approved", func() bool { return approvedBy("node-csr-e") != "" })
	before := counts(t, m2)[control.CSRKeyMismatch]
	waitUntil(t, 15*time.Second, "the second replica's judgement of old-key", func() bool { return counts(t, m2)[control.CSRKeyMismatch] > before })
	if got := approvedBy("old-key"); got != "" {
		t.Errorf("the previous boot's key approved after the reboot: %s", got)
	}
	// Past the second replica's Grace: it found both approved, and wrote nothing.
	time.Sleep(1500 * time.Millisecond)
	want := map[string]int{"approval node-csr-a": 1, "approval node-csr-e": 1}
	if got := approvals(kc); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("writes to requests: %v, want %v (one approval each, no other write)", got, want)
	}
	if c := counts(t, m1); c[control.CSRApproved] != 2 {
		t.Errorf("the verifying replica's counts: %v", c)
	}
	if c := counts(t, m2); c[control.CSRApproved] != 0 {
		t.Errorf("the other replica approved: %v", c)
	}
}

// counts are passage_control_csr_total's values by result, as the exposition writes
// them.
func counts(t *testing.T, m *control.Metrics) map[string]int {
	t.Helper()
	var b bytes.Buffer
	if err := m.Write(&b); err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, l := range strings.Split(b.String(), "\n") {
		var result string
		var n int
		if rest, ok := strings.CutPrefix(l, `passage_control_csr_total{result="`); ok {
			if i := strings.Index(rest, `"} `); i > 0 {
				result = rest[:i]
				fmt.Sscan(rest[i+3:], &n)
				out[result] = n
			}
		}
	}
	return out
}

func mustFirmware(t *testing.T, log []byte) *softtpm.Firmware {
	t.Helper()
	fw, err := softtpm.NewFirmware(log)
	if err != nil {
		t.Fatal(err)
	}
	return fw
}

// testLog writes a logger's lines to the test's log.
type testLog struct{ t *testing.T }

func (l testLog) Write(b []byte) (int, error) {
	l.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}

func waitUntil(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %v", what, d)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
