//go:build cluster

package harness_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/softtpm"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/harness"
)

// ruleAccess withdraws passage-control's permission on DeviceTaintRules (the deploy
// file's role, edited on the API server) and gives it back, each time waiting until the
// account's own requests show it: the API server refuses the replicas' rule writes in
// between, as it would any write it does not allow.
type ruleAccess struct {
	c       *harness.Cluster
	account kubernetes.Interface
	rules   []rbacv1.PolicyRule
}

func newRuleAccess(t *testing.T, ctx context.Context, c *harness.Cluster, kubeconfig string) *ruleAccess {
	t.Helper()
	rc, err := clientcmdConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	role, err := c.Client.RbacV1().ClusterRoles().Get(ctx, "passage-control", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return &ruleAccess{c: c, account: kubernetes.NewForConfigOrDie(rc), rules: role.Rules}
}

func (a *ruleAccess) set(t *testing.T, ctx context.Context, allowed bool) {
	t.Helper()
	role, err := a.c.Client.RbacV1().ClusterRoles().Get(ctx, "passage-control", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	role.Rules = nil
	for _, r := range a.rules {
		if allowed || !strings.Contains(strings.Join(r.Resources, ","), "devicetaintrules") {
			role.Rules = append(role.Rules, r)
		}
	}
	if _, err := a.c.Client.RbacV1().ClusterRoles().Update(ctx, role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ctx, 30*time.Second, fmt.Sprintf("rule permission allowed=%v seen by the account", allowed), func() (bool, string) {
		_, err := a.account.ResourceV1().DeviceTaintRules().Get(ctx, "passage-permission-probe", metav1.GetOptions{})
		return apierrors.IsForbidden(err) != allowed, fmt.Sprint(err)
	})
}

// TestClusterVerdictRule (issue #55, 7): a verdict whose rule write the API server
// refuses once is enforced all the same, on the real API server with passage-control
// replicas as processes on the deploy file's role. The replicas' permission on
// DeviceTaintRules is withdrawn during an unapproved boot's attestation: 503, the record
// attestation-failed and no rule. With it back, the boot's retry of the same attestation
// creates the NoExecute rule (1 record read, 1 rule read, 1 rule create, no status
// write, counted by the API server), and a retry after that writes nothing. A second
// node, whose pool is published and whose boot does not retry, gets its NoExecute rule
// from the reconciler; its next, approved boot with the permission withdrawn again is
// verified with the old NoExecute left (its delete refused), which the reconciler then
// deletes.
func TestClusterVerdictRule(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	work, ctlBin, c, kc := controlCluster(t, ctx)
	access := newRuleAccess(t, ctx, c, kc)
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	pool := replicaFiles(t, work, ca.PEM())
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	raw, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	ap, err := attest.ReadApproved(fixtures + "ovmf-secureboot.approved.json")
	if err != nil {
		t.Fatal(err)
	}
	fw, err := softtpm.NewFirmware(raw)
	if err != nil {
		t.Fatal(err)
	}
	bad, err := softtpm.NewFirmware(bytes.ReplaceAll(raw, []byte(ap.Authenticode[0]), bytes.Repeat([]byte{0x5a}, len(ap.Authenticode[0]))))
	if err != nil {
		t.Fatal(err)
	}
	admin, err := rest.HTTPClientFor(restConfig(t, c))
	if err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))
	rule := func(name string) *resourceapi.DeviceTaintRule {
		t.Helper()
		r, err := c.Client.ResourceV1().DeviceTaintRules().Get(ctx, control.RuleName(name), metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	record := func(name string) control.NodeStatus {
		t.Helper()
		u, err := dyn.Resource(control.NodeResource).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var st control.NodeStatus
		if s, ok := u.Object["status"].(map[string]any); ok {
			st.Verdict, _ = s["verdict"].(string)
			st.Reason, _ = s["reason"].(string)
			if g, ok := s["generation"].(int64); ok {
				st.Generation = g
			}
		}
		return st
	}
	failedRule := func(name, when string) *resourceapi.DeviceTaintRule {
		t.Helper()
		st, r := record(name), rule(name)
		if st.Verdict != control.VerdictFailed || r == nil || r.Spec.Taint.Key != control.TaintFailed || r.Spec.Taint.Value != "pcr-4" ||
			r.Spec.Taint.Effect != resourceapi.DeviceTaintEffectNoExecute || r.Annotations[control.ReasonAnnotation] != st.Reason ||
			r.Spec.DeviceSelector == nil || r.Spec.DeviceSelector.Pool == nil || *r.Spec.DeviceSelector.Pool != name {
			t.Fatalf("%s: record %s %q, rule %+v; want the failed verdict's NoExecute on pool %s", when, st.Verdict, st.Reason, r, name)
		}
		return r
	}
	newNode := func(host string) *controltest.SoftNode {
		t.Helper()
		ek, err := softtpm.GenerateEK()
		if err != nil {
			t.Fatal(err)
		}
		n, err := controltest.NewSoftNode(ctx, ca, ek, fw, host, 1)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	attestOver := func(n *controltest.SoftNode, u string) []byte {
		t.Helper()
		a, err := n.Attestation(getNonceFrom(t, hc, u))
		if err != nil {
			t.Fatal(err)
		}
		b, err := a.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	post := func(u string, body []byte) (int, string) {
		t.Helper()
		code, reason, err := controltest.Post(ctx, hc, u, control.AttestationType, body)
		if err != nil {
			t.Fatal(err)
		}
		return code, strings.TrimSpace(reason)
	}

	// 1. The boot retries. r1 reconciles once an hour: only the exchange writes here, and
	// the API server's counts around a request are that request's.
	r1 := startReplica(t, ctx, ctlBin, kc, work, 1, "--reconcile-every", "1h")
	a := newNode("b300-a")
	if _, err := a.Boot(ctx, hc, r1.url, netboot.DefaultPublish); err != nil {
		t.Fatalf("b300-a's first boot: %v", err)
	}
	if err := a.Reboot(ctx, bad, "b300-a", 2); err != nil {
		t.Fatal(err)
	}
	body := attestOver(a, r1.url)
	access.set(t, ctx, false)
	code, reason := post(r1.url, body)
	access.set(t, ctx, true)
	if code != http.StatusServiceUnavailable {
		t.Fatalf("the unapproved boot with the rule permission withdrawn: %d %s, want 503", code, reason)
	}
	if st, r := record("b300-a"), rule("b300-a"); st.Verdict != control.VerdictFailed || r != nil {
		t.Fatalf("after the refused rule write: record %s, rule %+v; want attestation-failed and no rule yet", st.Verdict, r)
	}
	before := apiRequests(t, ctx, admin, c.Server)
	code, reason = post(r1.url, body)
	cost := apiRequests(t, ctx, admin, c.Server).minus(before)
	if code != http.StatusForbidden || !strings.Contains(reason, "not approved") {
		t.Fatalf("the boot's retry with the permission back: %d %s", code, reason)
	}
	r := failedRule("b300-a", "after the boot's retry")
	want := map[string]float64{"GET passagenodes": 1, "GET devicetaintrules": 1, "POST devicetaintrules": 1}
	if got := costOf(cost); !equalCounts(got, want) {
		t.Errorf("the retry cost %v, want %v", got, want)
	}
	before = apiRequests(t, ctx, admin, c.Server)
	code, _ = post(r1.url, body)
	cost = apiRequests(t, ctx, admin, c.Server).minus(before)
	want = map[string]float64{"GET passagenodes": 1, "GET devicetaintrules": 1}
	if got := costOf(cost); code != http.StatusForbidden || !equalCounts(got, want) {
		t.Errorf("a retry with the rule in place: %d, cost %v, want %v", code, got, want)
	}
	t.Logf("b300-a: the rule create refused, then the boot's retry: %s=%s:%s (%s)", r.Spec.Taint.Key, r.Spec.Taint.Value, r.Spec.Taint.Effect,
		r.Annotations[control.ReasonAnnotation])

	// 2. No retry: the reconciler (r2, every 2 s) mends b300-b's rule, either way.
	r2 := startReplica(t, ctx, ctlBin, kc, work, 2, "--reconcile-every", "2s")
	b := newNode("b300-b")
	if _, err := b.Boot(ctx, hc, r2.url, netboot.DefaultPublish); err != nil {
		t.Fatalf("b300-b's first boot: %v", err)
	}
	all := true
	slice := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "b300-b-1"},
		Spec: resourceapi.ResourceSliceSpec{Driver: resources.DriverName, AllNodes: &all,
			Pool: resourceapi.ResourcePool{Name: "b300-b", Generation: 1, ResourceSliceCount: 1}}}
	if _, err := c.Client.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := b.Reboot(ctx, bad, "b300-b", 2); err != nil {
		t.Fatal(err)
	}
	body = attestOver(b, r2.url)
	access.set(t, ctx, false)
	code, reason = post(r2.url, body)
	access.set(t, ctx, true)
	if code != http.StatusServiceUnavailable {
		t.Fatalf("b300-b's unapproved boot with the rule permission withdrawn: %d %s, want 503", code, reason)
	}
	restored := time.Now()
	waitFor(t, ctx, 20*time.Second, "b300-b's NoExecute rule from the reconciler", func() (bool, string) {
		r := rule("b300-b")
		return r != nil, fmt.Sprintf("record %s, rule %v", record("b300-b").Verdict, r)
	})
	r = failedRule("b300-b", "after the reconciler")
	t.Logf("b300-b: the rule create refused, no retry: the reconciler's %s=%s:%s %.1f s after the permission was back",
		r.Spec.Taint.Key, r.Spec.Taint.Value, r.Spec.Taint.Effect, time.Since(restored).Seconds())

	// Its approved boot with the permission withdrawn: verified, the NoExecute left.
	if err := b.Reboot(ctx, fw, "b300-b", 3); err != nil {
		t.Fatal(err)
	}
	body = attestOver(b, r2.url)
	access.set(t, ctx, false)
	code, reason = post(r2.url, body)
	if code != http.StatusServiceUnavailable {
		access.set(t, ctx, true)
		t.Fatalf("b300-b's approved boot with the rule permission withdrawn: %d %s, want 503", code, reason)
	}
	if st, r := record("b300-b"), rule("b300-b"); st.Verdict != control.VerdictVerified || st.Generation != 3 || r == nil {
		access.set(t, ctx, true)
		t.Fatalf("after the refused delete: record %s generation %d, rule %v; want verified 3 and the old rule", st.Verdict, st.Generation, r)
	}
	access.set(t, ctx, true)
	restored = time.Now()
	waitFor(t, ctx, 20*time.Second, "b300-b's stale NoExecute rule deleted by the reconciler", func() (bool, string) {
		r := rule("b300-b")
		if r == nil {
			return true, ""
		}
		return false, fmt.Sprintf("%s=%s:%s", r.Spec.Taint.Key, r.Spec.Taint.Value, r.Spec.Taint.Effect)
	})
	t.Logf("b300-b: verified at 3 with its rule delete refused: the reconciler deleted the NoExecute %.1f s after the permission was back",
		time.Since(restored).Seconds())
	if rule("b300-a") == nil {
		t.Fatal("b300-a's rule went (its pool is not published: the reconciler does not look at it)")
	}
	sameVerdicts(t, ctx, kc, 2)
}

// sameVerdicts: the reconciler's walk of the verdicts, a table the API server projects
// from the CRD's printer columns (Store.Verdicts with Table, as passage-control asks
// for it, with its own account), holds each record's verdict, generation and reason
// as the records themselves do (the same walk without Table, listing them whole); it
// reports how many there were, at least want.
func sameVerdicts(t *testing.T, ctx context.Context, kubeconfig string, want int) {
	t.Helper()
	rc, err := clientcmdConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	kc := kubernetes.NewForConfigOrDie(rc)
	dyn := dynamic.NewForConfigOrDie(rc)
	table, err := (&control.Store{Client: dyn, Table: kc.Discovery().RESTClient()}).Verdicts(ctx, 2)
	if err != nil {
		t.Fatalf("the verdicts as a table: %v", err)
	}
	whole, err := (&control.Store{Client: dyn}).Verdicts(ctx, 2)
	if err != nil {
		t.Fatalf("the records whole: %v", err)
	}
	if len(table) != len(whole) || len(table) < want {
		t.Fatalf("%d verdicts in the table, %d records listed (at least %d written)", len(table), len(whole), want)
	}
	verdicts := map[string]int{}
	for name, n := range whole {
		if got := table[name]; got == nil || got.Status.Verdict != n.Status.Verdict || got.Status.Generation != n.Status.Generation || got.Status.Reason != n.Status.Reason {
			t.Errorf("record %s: the table says %+v, the record %+v", name, got, n.Status)
		}
		verdicts[fmt.Sprintf("%q at %d, %d bytes of reason", n.Status.Verdict, n.Status.Generation, len(n.Status.Reason))]++
	}
	t.Logf("%d records, the same in the table: %v", len(whole), verdicts)
}

// costOf is a request's API calls on passage's resources, "VERB resource": not the
// eviction controller's (its informer's list and watch of the rules, a rule's status).
func costOf(r requests) map[string]float64 {
	out := map[string]float64{}
	for k, v := range r {
		controller := k[1] == "WATCH" || (k[1] == "LIST" && k[2] == "devicetaintrules") || k[2] == "devicetaintrules/status"
		if k[0] == "total" && ours(k[2]) && !controller {
			out[k[1]+" "+k[2]] += v
		}
	}
	return out
}

func equalCounts(a, b map[string]float64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// answerDropper is a loopback proxy between a passage-control replica and the API
// server: it forwards everything, and while armed it forwards one create of a
// PassageNode, reads the API server's whole answer, and closes the replica's connection
// without it — a create made whose answer was lost.
type answerDropper struct {
	url, ca string // its https URL and the certificate to trust it with
	armed   atomic.Bool
	dropped atomic.Int64
	status  atomic.Int64 // the dropped answer's status
}

func newAnswerDropper(t *testing.T, c *harness.Cluster) *answerDropper {
	t.Helper()
	ca, err := os.ReadFile(filepath.Join(c.Dir, "serving.crt"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	target, err := url.Parse(c.Server)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.Transport = tr
	// TLS: clientcmd sends a kubeconfig's token over TLS only.
	certPEM, keyPEM := serving(t)
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	d := &answerDropper{ca: filepath.Join(t.TempDir(), "proxy.crt")}
	if err := os.WriteFile(d.ca, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second,
		// HTTP/1.1 only: a dropped answer is a closed connection, as a lost one is.
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}}, TLSNextProto: map[string]func(*http.Server, *tls.Conn, http.Handler){},
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/"+control.NodeResource.Resource) && d.armed.CompareAndSwap(true, false) {
				out := r.Clone(r.Context())
				out.URL.Scheme, out.URL.Host, out.Host, out.RequestURI = target.Scheme, target.Host, target.Host, ""
				resp, err := tr.RoundTrip(out)
				if err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					d.status.Store(int64(resp.StatusCode))
				}
				d.dropped.Add(1)
				panic(http.ErrAbortHandler) // the connection closed, no answer
			}
			rp.ServeHTTP(w, r)
		})}
	var wg sync.WaitGroup
	wg.Go(func() { srv.ServeTLS(ln, "", "") })
	t.Cleanup(func() { srv.Close(); wg.Wait(); tr.CloseIdleConnections() })
	d.url = "https://" + ln.Addr().String()
	return d
}

// TestClusterLostCreate (issue #55, 8): the record's create reaches the real API server
// and is made, and its answer is lost on the way back (a loopback proxy between the
// replica and the API server closes the connection instead). The one activation POST
// (the boot makes no other) is answered 204, the record enrolled with the TPM and the
// TPM's EK claim naming it; the same TPM then asking to enrol as another name is
// refused by that claim, and no second record is made.
func TestClusterLostCreate(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	work, ctlBin, c, kc := controlCluster(t, ctx)
	rc, err := clientcmdConfig(kc)
	if err != nil {
		t.Fatal(err)
	}
	d := newAnswerDropper(t, c)
	// The account's token, through the proxy.
	proxied := filepath.Join(work, "passage-control-proxied.kubeconfig")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: %q, certificate-authority: %q}}]
users: [{name: u, user: {token: %q}}]
contexts: [{name: e2e, context: {cluster: e2e, user: u}}]
current-context: e2e
`, d.url, d.ca, rc.BearerToken)
	if err := os.WriteFile(proxied, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	pool := replicaFiles(t, work, ca.PEM())
	r1 := startReplica(t, ctx, ctlBin, proxied, work, 1, "--reconcile-every", "1h")
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	raw, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	fw, err := softtpm.NewFirmware(raw)
	if err != nil {
		t.Fatal(err)
	}
	ek, err := softtpm.GenerateEK()
	if err != nil {
		t.Fatal(err)
	}
	n, err := controltest.NewSoftNode(ctx, ca, ek, fw, "b300-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))
	claims := func() map[string]string {
		t.Helper()
		l, err := dyn.Resource(control.EKResource).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, u := range l.Items {
			spec, _ := u.Object["spec"].(map[string]any)
			out[u.GetName()], _ = spec["record"].(string)
		}
		return out
	}

	ch := challenge(t, ctx, hc, r1.url, n)
	d.armed.Store(true)
	code, reason, err := controltest.Post(ctx, hc, r1.url, control.ActivationType, answerFor(t, n, ch))
	if err != nil {
		t.Fatal(err)
	}
	if d.dropped.Load() != 1 || d.status.Load() != http.StatusCreated {
		t.Fatalf("the proxy dropped %d answers (the API server's: %d), want one 201", d.dropped.Load(), d.status.Load())
	}
	rec, err := dyn.Resource(control.NodeResource).Get(ctx, "b300-a", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the record whose answer was lost: %v", err)
	}
	got := claims()
	t.Logf("activation with the record's answer lost: %d %s; EK claims %v", code, strings.TrimSpace(reason), got)
	if len(got) != 1 || values(got)[0] != "b300-a" {
		t.Fatalf("after the lost answer: EK claims %v, want the TPM's naming b300-a (record %s made)", got, rec.GetName())
	}
	if code != http.StatusNoContent {
		t.Errorf("the activation whose record's answer was lost: %d %s, want 204 (the record read back)", code, reason)
	}

	// The same TPM asking to be b300-c: challenged (nothing written), its answer refused.
	if err := n.Sign(ctx, "b300-c", 1); err != nil {
		t.Fatal(err)
	}
	ch = challenge(t, ctx, hc, r1.url, n)
	code, reason, err = controltest.Post(ctx, hc, r1.url, control.ActivationType, answerFor(t, n, ch))
	if err != nil || code != http.StatusForbidden || !strings.Contains(reason, "this TPM is enrolled as another record") {
		t.Fatalf("b300-a's TPM enrolling as b300-c: %v %d %s", err, code, reason)
	}
	if _, err := dyn.Resource(control.NodeResource).Get(ctx, "b300-c", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("b300-c: %v, want no record", err)
	}
	// And b300-a's boot goes on: verified.
	if err := n.Sign(ctx, "b300-a", 2); err != nil {
		t.Fatal(err)
	}
	a, err := n.Attestation(getNonceFrom(t, hc, r1.url))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := a.Marshal()
	if code, reason, err := controltest.Post(ctx, hc, r1.url, control.AttestationType, body); err != nil || code != http.StatusOK {
		t.Fatalf("b300-a's attestation after the enrolment: %v %d %s", err, code, reason)
	}
}

func values(m map[string]string) []string {
	var out []string
	for _, v := range m {
		out = append(out, v)
	}
	return out
}
