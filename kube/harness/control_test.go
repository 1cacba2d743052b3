//go:build cluster

package harness_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/harness"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/stages"
)

const fixtures = "../../attest/testdata/"

// replica is one passage-control process.
type replica struct {
	url, metrics string
	cmd          *exec.Cmd
	done         chan struct{}
	log          string
}

// TestClusterControl: two passage-control replicas as processes on the real control
// plane, boots with swtpm TPMs POSTing to them (see README.md, "The tests").
func TestClusterControl(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	work := t.TempDir()
	ctlBin := goBuild(t, work, "passage-control")
	passageBin := filepath.Join(work, "passage")
	build := exec.CommandContext(ctx, "go", "build", "-o", passageBin, "./cmd/passage")
	build.Dir = filepath.Join("..", "..") // the main module
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build passage: %v\n%s", err, b)
	}
	c := startCluster(t, ctx, work)
	api := c.Client
	createNamespace(t, ctx, api)
	applyCRDs(t, ctx, c)
	ctlConfig := filepath.Join(work, "passage-control.kubeconfig")
	deployControlRBAC(t, ctx, c, ctlConfig)

	// The node's TPM is manufactured first: swtpm_localca makes its CA on first use.
	log, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	ca := attesttest.NewCA(t)
	node := controltest.NewNode(t, ca, "b300-a", log)
	pool := replicaFiles(t, work, ca.PEM(t))
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	// The replicas' passes are an hour apart: whatever they do to a rule here, an event
	// made them do it.
	launch := func(i int, extra ...string) *replica {
		return startReplica(t, ctx, ctlBin, ctlConfig, work, i, append([]string{"--reconcile-every", "1h"}, extra...)...)
	}
	r1, r2 := launch(1), launch(2)
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))
	record := func(name string) map[string]any {
		u, err := dyn.Resource(control.NodeResource).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("record %s: %v", name, err)
		}
		st, _ := u.Object["status"].(map[string]any)
		return st
	}
	rule := func(name string) *resourceapi.DeviceTaintRule {
		r, err := api.ResourceV1().DeviceTaintRules().Get(ctx, control.RuleName(name), metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	// The node's manifest is POSTed bare (kept by no one: it counts only inside an
	// attestation); no attestation yet. Its slices are what passage-dra renders from that
	// manifest (resources.Render), published by the test. Its Kubernetes name is not its
	// hostname (the DaemonSet's --node-name=$(NODE_NAME)): the record and its rule know it
	// by the manifest's hostname, the slices' pool.
	addNode(t, ctx, api, "worker-a")
	if st, body, err := controltest.Post(ctx, hc, r1.url, control.EnvelopeType, node.NextEnvelope(t)); err != nil || st != http.StatusAccepted {
		t.Fatalf("envelope: %v %d %s", err, st, body)
	}
	if _, err := dyn.Resource(control.NodeResource).Get(ctx, "b300-a", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("a bare envelope made a record: %v", err)
	}
	key, err := manifest.NewVerifier(node.SigningKey())
	if err != nil {
		t.Fatal(err)
	}
	v, err := manifest.Verify(node.LastEnvelope, key, manifest.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	objs, err := resources.Render(v, resources.Options{NodeName: "worker-a"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := api.ResourceV1().DeviceClasses().Create(ctx, objs.Class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, tmpl := range objs.Templates {
		if _, err := api.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range objs.Slices {
		if _, err := api.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	tmpl := objs.Shapes[0].TemplateName()
	// Pools published by nodes whose boots never reached passage.url: the replicas taint
	// each on its slice's event, naming why (their passes are an hour apart: only the
	// watches can). The time from a slice's creation to its rule, seen by a watch of the
	// rules, is how long a pool published at a generation no one verified stays
	// schedulable: the watch's delivery, a replica's settle (up to 1 s) and one mend.
	apiAdmin, err := rest.HTTPClientFor(restConfig(t, c))
	if err != nil {
		t.Fatal(err)
	}
	ruleCreates := func() float64 {
		return apiRequests(t, ctx, apiAdmin, c.Server)[[3]string{"total", "POST", "devicetaintrules"}]
	}
	ghostRule := func(pool string) time.Duration {
		t.Helper()
		w, err := api.ResourceV1().DeviceTaintRules().Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + control.RuleName(pool)})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Stop()
		ghost := objs.Slices[0].DeepCopy()
		ghost.Name, ghost.Spec.Pool.Name, ghost.Spec.Pool.ResourceSliceCount = pool+"-0", pool, 1
		start := time.Now()
		if _, err := api.ResourceV1().ResourceSlices().Create(ctx, ghost, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// A generous bound, so that a loaded machine does not fail it: the old period
		// alone was 15 s. The figure itself is logged (README.md, "The reconciler").
		timeout := time.After(10 * time.Second)
		for {
			select {
			case ev, ok := <-w.ResultChan():
				if !ok {
					t.Fatalf("%s: the watch of its rule ended", pool)
				}
				r, is := ev.Object.(*resourceapi.DeviceTaintRule)
				if ev.Type != watch.Added || !is {
					continue
				}
				took := time.Since(start)
				if r.Spec.Taint.Key != control.TaintUnverified || !strings.Contains(r.Annotations[control.ReasonAnnotation], "no record: the node has not enrolled") {
					t.Fatalf("%s's rule: %s: %s", pool, r.Spec.Taint.Key, r.Annotations[control.ReasonAnnotation])
				}
				return took
			case <-timeout:
				t.Fatalf("%s: no rule 10 s after its slice was published (%s)", pool, fmt.Sprint(rule(pool)))
			}
		}
	}
	// What each replica's reconciler did: written, or found written when it looked
	// (the other replica's write reached it after its settle).
	judged := func(r *replica) map[string]float64 {
		resp, err := http.Get(r.metrics)
		if err != nil {
			t.Fatal(err)
		}
		m, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out := map[string]float64{}
		for _, res := range []string{control.JudgedWritten, control.JudgedUnchanged} {
			var v float64
			fmt.Sscan(strings.TrimPrefix(metricLine(m, `passage_control_reconcile_judgements_total{result="`+res+`"} `), `passage_control_reconcile_judgements_total{result="`+res+`"} `), &v)
			out[res] = v
		}
		return out
	}
	// b300-a's pool, published just above, gets its rule first, and the replica that
	// did not write it has looked again after its settle: what is counted below is the
	// ghosts'.
	waitFor(t, ctx, 10*time.Second, "b300-a's rule", func() (bool, string) { return rule("b300-a") != nil, "no rule" })
	time.Sleep(control.DefaultSettle + 200*time.Millisecond)
	j1, j2 := judged(r1), judged(r2)
	creates0 := ruleCreates()
	var waits []time.Duration
	for i := range 20 {
		pool := "b300-ghost"
		if i > 0 {
			pool = fmt.Sprintf("b300-ghost-%d", i)
		}
		waits = append(waits, ghostRule(pool))
	}
	creates := ruleCreates() - creates0
	sorted := slices.Clone(waits)
	slices.Sort(sorted)
	k1, k2 := judged(r1), judged(r2)
	t.Logf("a pool published at a generation no record verified: its rule %v after its slice (median %v, longest %v over %d pools, each created in turn, two replicas with --reconcile-every 1h); %.0f rule creates; mends that wrote %.0f and %.0f, that found the rule written %.0f and %.0f",
		waits, sorted[len(sorted)/2].Round(time.Millisecond), sorted[len(sorted)-1].Round(time.Millisecond), len(waits), creates,
		k1[control.JudgedWritten]-j1[control.JudgedWritten], k2[control.JudgedWritten]-j2[control.JudgedWritten],
		k1[control.JudgedUnchanged]-j1[control.JudgedUnchanged], k2[control.JudgedUnchanged]-j2[control.JudgedUnchanged])

	createPod(t, ctx, api, "pod-0", "", tmpl)
	waitUnschedulable(t, ctx, api, "pod-0", "cannot allocate all claims")
	r := rule("b300-a")
	if r == nil || r.Spec.Taint.Key != control.TaintUnverified || r.Spec.Taint.Effect != resourceapi.DeviceTaintEffectNoSchedule || *r.Spec.DeviceSelector.Pool != "b300-a" {
		t.Fatalf("before verification, the rule on b300-a's devices: %+v", r)
	}
	t.Logf("before verification: pod-0 Pending; rule %s %s=%s on pool %s (%s)", r.Name, r.Spec.Taint.Key, r.Spec.Taint.Effect, *r.Spec.DeviceSelector.Pool, r.Annotations[control.ReasonAnnotation])

	// A third replica keeps an intake list this TPM is not on and a nonce time of a
	// second: it refuses to enrol the TPM, and a nonce over a second old (from another
	// replica: they share the key) as over its time, each naming why.
	intake := filepath.Join(work, "intake.txt")
	if err := os.WriteFile(intake, []byte("sha256:"+strings.Repeat("ab", 32)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r3 := launch(3, "--intake", intake, "--nonce-ttl", "1s")
	if res, err := node.Publish(ctx, hc, r3.url, r3.url); err != nil || res.Status != http.StatusForbidden || !strings.Contains(res.Body, "not on the intake list") {
		t.Fatalf("boot at the replica with an intake list: %v %+v", err, res)
	}
	stale := getNonceFrom(t, hc, r1.url)
	node.NextEnvelope(t)
	time.Sleep(1100 * time.Millisecond)
	a, err := node.Attest(stale)
	if err != nil {
		t.Fatal(err)
	}
	if st, body, err := controltest.Post(ctx, hc, r3.url, control.AttestationType, a); err != nil || st != http.StatusForbidden ||
		!strings.Contains(body, "accepted for 1s") {
		t.Fatalf("a nonce over 1s old at the replica with --nonce-ttl 1s: %v %d %s", err, st, body)
	}
	r3.cmd.Process.Kill()
	<-r3.done

	// The node's first boot is the boot's own code: `passage boot --root` (the binary
	// built from the main module) on a synthetic B300 whose hostname is b300-a, with
	// passage.net=off and passage.url at r1, its TPM the swtpm, trusting the replicas'
	// certificate as an initramfs's CA bundle would (SSL_CERT_FILE). Its publish stage
	// enrols the TPM (428, activation, the attestation again) and is verified with no
	// command run by hand; the taint goes and the pod binds.
	boot, err := node.Boot(ctx, passageBin, r1.url, []string{"SSL_CERT_FILE=" + filepath.Join(work, "tls.crt")})
	if err != nil {
		t.Fatal(err)
	}
	if boot.Publish.Status != stages.OK || !slices.Contains(boot.Publish.Changes, "enrolled: credential activated in the TPM, record b300-a") {
		t.Fatalf("first boot, passage boot --root: publish %s %s\nfindings %q\nchanges %q\n%s", boot.Publish.Status, boot.Publish.Error, boot.Publish.Findings, boot.Publish.Changes, boot.Console)
	}
	if st := record("b300-a"); st["verdict"] != control.VerdictVerified || fmt.Sprint(st["generation"]) != fmt.Sprint(boot.Generation) {
		t.Fatalf("record after the boot's own publish (generation %d): %v %v %v", boot.Generation, st["verdict"], st["generation"], st["reason"])
	}
	t.Logf("first boot, passage boot --root: publish %s; %s", boot.Publish.Status, strings.Join(boot.Publish.Changes, "; "))
	waitFor(t, ctx, 30*time.Second, "pod-0 bound after verification", func() (bool, string) {
		p, err := api.CoreV1().Pods(ns).Get(ctx, "pod-0", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return p.Spec.NodeName == "worker-a", "not bound"
	})
	if r := rule("b300-a"); r != nil {
		t.Fatalf("verified, the rule is still there: %+v", r.Spec.Taint)
	}

	// The boot's attestation replayed to the other replica: the verdict it already has
	// (the answer a retried try gets), nothing written.
	before, err := dyn.Resource(control.NodeResource).Get(ctx, "b300-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	stc, body, err := controltest.Post(ctx, hc, r2.url, control.AttestationType, boot.Attestation)
	if after, gerr := dyn.Resource(control.NodeResource).Get(ctx, "b300-a", metav1.GetOptions{}); gerr != nil || after.GetResourceVersion() != before.GetResourceVersion() {
		t.Fatalf("a replay wrote the record: %v", gerr)
	}
	if err != nil || stc != http.StatusOK || !strings.Contains(body, `"verdict":"verified"`) {
		t.Fatalf("replay to the other replica: %v %d %s", err, stc, body)
	}

	// The same attestation at both replicas at the same instant, many times: exactly one
	// status write records it (the API server's count of those that succeeded); the
	// other replica, its write
	// conflicting, reads the record again and answers the verdict it finds.
	admin, err := rest.HTTPClientFor(restConfig(t, c))
	if err != nil {
		t.Fatal(err)
	}
	statusWrites := func() float64 {
		return apiRequests(t, ctx, admin, c.Server)[[3]string{"ok", "PUT", "passagenodes/status"}]
	}
	for i := range 20 {
		w0 := statusWrites()
		nonce := getNonceFrom(t, hc, r1.url)
		node.NextEnvelope(t)
		a, err := node.Attest(nonce)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		codes := make([]int, 2)
		start := make(chan struct{})
		for j, u := range []string{r1.url, r2.url} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				codes[j], _, _ = controltest.Post(ctx, hc, u, control.AttestationType, a)
			}()
		}
		close(start)
		wg.Wait()
		for _, c := range codes {
			if c != http.StatusOK && c != http.StatusForbidden {
				t.Fatalf("round %d: the same attestation at both replicas: %v, want the verdict or a spent nonce", i, codes)
			}
		}
		if w := statusWrites() - w0; w != 1 || (codes[0] != http.StatusOK && codes[1] != http.StatusOK) {
			t.Fatalf("round %d: the same attestation at both replicas: %v, %.0f status writes; want one", i, codes, w)
		}
	}

	// An unapproved image: NoExecute with the verifier's reason; pod-0 is deleted by the
	// eviction controller. A later approved boot clears it and a new pod binds.
	ap, err := attest.ReadApproved(fixtures + "ovmf-secureboot.approved.json")
	if err != nil {
		t.Fatal(err)
	}
	node.Reboot(bytes.ReplaceAll(log, []byte(ap.Authenticode[0]), bytes.Repeat([]byte{0x5a}, 32)))
	res, err := node.Publish(ctx, hc, r2.url, r1.url)
	if err != nil || res.Status != http.StatusForbidden || !strings.Contains(res.Body, "not approved") {
		t.Fatalf("unapproved boot: %v %+v", err, res)
	}
	r = rule("b300-a")
	if r == nil || r.Spec.Taint.Key != control.TaintFailed || r.Spec.Taint.Effect != resourceapi.DeviceTaintEffectNoExecute {
		t.Fatalf("after the unapproved boot: %+v", r)
	}
	waitFor(t, ctx, 30*time.Second, "pod-0 evicted", func() (bool, string) {
		p, err := api.CoreV1().Pods(ns).Get(ctx, "pod-0", metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, ""
		}
		if err != nil {
			return false, err.Error()
		}
		return p.DeletionTimestamp != nil, "no deletionTimestamp"
	})
	st := record("b300-a")
	// The attack: the last verified boot's attestation and envelope (no secrets) sent
	// again to each replica after the failed verdict: refused, the verdict and its
	// NoExecute rule as they were.
	for _, u := range []string{r1.url, r2.url} {
		for _, body := range [][]byte{boot.Attestation, a} {
			if code, reason, err := controltest.Post(ctx, hc, u, control.AttestationType, body); err != nil || code/100 != 4 {
				t.Fatalf("an old verified attestation after the failure: %v %d %s", err, code, reason)
			}
		}
		if code, _, err := controltest.Post(ctx, hc, u, control.EnvelopeType, node.LastEnvelope); err != nil || code != http.StatusAccepted {
			t.Fatalf("an envelope after the failure: %v %d", err, code)
		}
	}
	if after := record("b300-a"); after["verdict"] != control.VerdictFailed || fmt.Sprint(after["generation"]) != fmt.Sprint(st["generation"]) {
		t.Fatalf("replays after the failed verdict moved the record: %v generation %v", after["verdict"], after["generation"])
	}
	// (The rule's status is kube-controller-manager's, which it writes as it evicts.)
	if r2 := rule("b300-a"); r2 == nil || r2.Spec.Taint.Key != control.TaintFailed || r2.Spec.Taint.Value != r.Spec.Taint.Value ||
		r2.Annotations[control.ReasonAnnotation] != r.Annotations[control.ReasonAnnotation] || r2.Generation != r.Generation {
		t.Fatalf("replays after the failed verdict moved the rule: %+v", r2)
	}
	t.Logf("unapproved boot: rule %s=%s:%s (%s); record %v: %v; pod-0 deleted by the eviction controller",
		r.Spec.Taint.Key, r.Spec.Taint.Value, r.Spec.Taint.Effect, r.Annotations[control.ReasonAnnotation], st["verdict"], st["reason"])
	forceDelete(t, ctx, api, "pod-0")

	// A replica killed (SIGKILL) between the nonce GET and the POST: the boot completes
	// on the other; the record keeps every generation, the nonce is used once.
	node.Reboot(log)
	node.AfterNonce = func() {
		r1.cmd.Process.Signal(syscall.SIGKILL)
		<-r1.done
	}
	res, err = node.Publish(ctx, hc, r1.url, r2.url)
	node.AfterNonce = nil
	if err != nil || res.Status != http.StatusOK {
		t.Fatalf("boot across a killed replica: %v %+v", err, res)
	}
	if st := record("b300-a"); st["verdict"] != control.VerdictVerified || st["nonce"] == nil {
		t.Fatalf("record after the killed replica: %v", st)
	}
	if r := rule("b300-a"); r != nil {
		t.Fatalf("approved boot, the rule is still there: %+v", r.Spec.Taint)
	}
	createPod(t, ctx, api, "pod-1", "", tmpl)
	waitFor(t, ctx, 30*time.Second, "pod-1 bound", func() (bool, string) {
		p, err := api.CoreV1().Pods(ns).Get(ctx, "pod-1", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return p.Spec.NodeName == "worker-a", "not bound"
	})

	// What an operator sees: the printer columns and the metrics promtool accepts.
	table := printerColumns(t, ctx, c)
	if !strings.Contains(table, "b300-a") || !strings.Contains(table, "verified") {
		t.Fatalf("kubectl get passagenodes: %s", table)
	}
	t.Logf("kubectl get passagenodes:\n%s", table)
	resp, err := http.Get(r2.metrics)
	if err != nil {
		t.Fatal(err)
	}
	exp, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	check := exec.Command("promtool", "check", "metrics")
	check.Stdin = bytes.NewReader(exp)
	if out, err := check.CombinedOutput(); err != nil {
		t.Fatalf("promtool check metrics: %v\n%s\n%s", err, out, exp)
	}
	// r2 verified the boot across the killed replica at least (its counters are its own).
	if !strings.Contains(string(exp), `passage_control_verdicts_total{verdict="verified"} `) ||
		strings.Contains(string(exp), `passage_control_verdicts_total{verdict="verified"} 0`+"\n") {
		t.Fatalf("metrics:\n%s", exp)
	}
}

func clientcmdConfig(path string) (*rest.Config, error) {
	return clientcmd.BuildConfigFromFlags("", path)
}

func restConfig(t testing.TB, c *harness.Cluster) *rest.Config {
	t.Helper()
	rc, err := clientcmdConfig(c.Admin)
	if err != nil {
		t.Fatal(err)
	}
	return rc
}

// applyCRDs creates deploy/passage-control-crd.yaml's definitions and waits until
// they are served.
func applyCRDs(t testing.TB, ctx context.Context, c *harness.Cluster) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "deploy", "passage-control-crd.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))
	crds := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	for i, doc := range strings.Split(string(b), "\n---\n") {
		var m map[string]any
		if err := yaml.Unmarshal([]byte(doc), &m); err != nil {
			t.Fatalf("passage-control-crd.yaml document %d: %v", i+1, err)
		}
		if _, err := dyn.Resource(crds).Create(ctx, &unstructured.Unstructured{Object: m}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("passage-control-crd.yaml document %d: %v", i+1, err)
		}
	}
	for _, gvr := range []schema.GroupVersionResource{control.NodeResource, control.EKResource} {
		waitFor(t, ctx, 30*time.Second, gvr.Resource+" served", func() (bool, string) {
			_, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{})
			return err == nil, fmt.Sprint(err)
		})
	}
}

// deployControlRBAC creates deploy/passage-control.yaml's namespace, account and role
// and writes a kubeconfig of the account: the replicas run with what the role grants.
func deployControlRBAC(t testing.TB, ctx context.Context, c *harness.Cluster, kubeconfig string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "deploy", "passage-control.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	api := c.Client
	var sa *corev1.ServiceAccount
	for i, doc := range strings.Split(string(b), "\n---\n") {
		obj, gvk, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatalf("deploy/passage-control.yaml document %d: %v", i+1, err)
		}
		switch o := obj.(type) {
		case *corev1.Namespace:
			if _, err = api.CoreV1().Namespaces().Create(ctx, o, metav1.CreateOptions{}); apierrors.IsAlreadyExists(err) {
				err = nil
			}
		case *corev1.ServiceAccount:
			sa = o
			_, err = api.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = api.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = api.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		}
		if err != nil {
			t.Fatalf("deploy/passage-control.yaml document %d (%s): %v", i+1, gvk.Kind, err)
		}
	}
	if sa == nil {
		t.Fatal("deploy/passage-control.yaml: no ServiceAccount")
	}
	if err := c.ServiceAccountKubeconfig(ctx, sa.Namespace, sa.Name, kubeconfig); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmdConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	as := kubernetes.NewForConfigOrDie(rc)
	if _, err := as.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("passage-control's account listing pods: %v, want forbidden", err)
	}
	// It reads the slices (control.Reconciler lists and watches them) and writes none:
	// they are the nodes'.
	if _, err := as.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatalf("passage-control's account listing slices: %v", err)
	}
	if w, err := as.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{}); err != nil {
		t.Fatalf("passage-control's account watching slices: %v", err)
	} else {
		w.Stop()
	}
	if err := as.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("passage-control's account deleting slices: %v, want forbidden", err)
	}
}

// printerColumns is `kubectl get passagenodes` as the API's Table answer gives it.
func printerColumns(t *testing.T, ctx context.Context, c *harness.Cluster) string {
	t.Helper()
	rc := restConfig(t, c)
	hc, err := rest.HTTPClientFor(rc)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequestWithContext(ctx, "GET", c.Server+"/apis/"+control.Group+"/"+control.Version+"/passagenodes", nil)
	req.Header.Set("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var tbl metav1.Table
	if err := json.NewDecoder(resp.Body).Decode(&tbl); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for _, col := range tbl.ColumnDefinitions {
		fmt.Fprintf(&out, "%s\t", strings.ToUpper(col.Name))
	}
	out.WriteString("\n")
	for _, row := range tbl.Rows {
		for _, cell := range row.Cells {
			fmt.Fprintf(&out, "%v\t", cell)
		}
		out.WriteString("\n")
	}
	want := []string{"Name", "Node", "Generation", "Verdict", "Reason", "Age"}
	for i, w := range want {
		if i >= len(tbl.ColumnDefinitions) || tbl.ColumnDefinitions[i].Name != w {
			t.Fatalf("printer columns %+v, want %v", tbl.ColumnDefinitions, want)
		}
	}
	return out.String()
}

func getNonceFrom(t testing.TB, hc *http.Client, url string) []byte {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	n, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %s %q", url, resp.Status, b)
	}
	return n
}

// replicaFiles writes what startReplica's replicas read from work: a serving
// certificate for 127.0.0.1 (tls.crt, tls.key) and the EK CA (ek-ca.pem). It returns the
// pool a client trusts the replicas with. Every replica of a test shares exchange.key,
// as a Deployment's share their Secret.
func replicaFiles(t testing.TB, work string, ekCA []byte) *x509.CertPool {
	t.Helper()
	key := make([]byte, control.MinKey)
	rand.Read(key)
	files := map[string][]byte{"ek-ca.pem": ekCA, "exchange.key": key}
	files["tls.crt"], files["tls.key"] = serving(t)
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(work, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(files["tls.crt"])
	return pool
}

// startReplica starts passage-control replica i as a process with the account's
// kubeconfig and work's tls.crt, tls.key and ek-ca.pem, the fixture's approved image, and
// extra arguments; it returns once the replica answers /healthz and kills it at the end.
func startReplica(t testing.TB, ctx context.Context, bin, kubeconfig, work string, i int, extra ...string) *replica {
	t.Helper()
	ports := freePorts(t, 2)
	r := &replica{url: fmt.Sprintf("https://127.0.0.1:%d/", ports[0]), metrics: fmt.Sprintf("http://127.0.0.1:%d/metrics", ports[1]),
		log: filepath.Join(work, fmt.Sprintf("control-%d.log", i)), done: make(chan struct{})}
	out, _ := os.Create(r.log)
	r.cmd = exec.Command(bin, "--kubeconfig", kubeconfig, "--listen", fmt.Sprintf("127.0.0.1:%d", ports[0]),
		"--metrics", fmt.Sprintf("127.0.0.1:%d", ports[1]), "--tls-cert", filepath.Join(work, "tls.crt"),
		"--tls-key", filepath.Join(work, "tls.key"), "--ek-ca", filepath.Join(work, "ek-ca.pem"),
		"--approved", fixtures+"ovmf-secureboot.approved.json", "--exchange-key", filepath.Join(work, "exchange.key"))
	r.cmd.Args = append(r.cmd.Args, extra...)
	r.cmd.Stdout, r.cmd.Stderr = out, out
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { r.cmd.Wait(); out.Close(); close(r.done) }()
	t.Cleanup(func() {
		r.cmd.Process.Kill()
		<-r.done
		if t.Failed() {
			t.Log(harness.Tail(r.log, 3000))
		}
	})
	waitFor(t, ctx, 30*time.Second, "passage-control "+r.url, func() (bool, string) {
		resp, err := http.Get(strings.TrimSuffix(r.metrics, "metrics") + "healthz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == 200, resp.Status
	})
	return r
}

// serving is a throw-away certificate for 127.0.0.1, the operator's in a real cluster.
func serving(t testing.TB) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "passage-control"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		KeyUsage: x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
}

func freePorts(t testing.TB, n int) []int {
	t.Helper()
	var out []int
	var ls []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return out
}

// controlCluster is what an exchange test starts from: passage-control built into a
// work directory, a control plane with passage's CRDs, and the kubeconfig of
// passage-control's service account bound to the shipped role.
func controlCluster(t *testing.T, ctx context.Context) (work, ctlBin string, c *harness.Cluster, kubeconfig string) {
	t.Helper()
	work = t.TempDir()
	ctlBin = goBuild(t, work, "passage-control")
	c = startCluster(t, ctx, work)
	applyCRDs(t, ctx, c)
	kubeconfig = filepath.Join(work, "passage-control.kubeconfig")
	deployControlRBAC(t, ctx, c, kubeconfig)
	return work, ctlBin, c, kubeconfig
}
