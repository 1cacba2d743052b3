//go:build cluster

package harness_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/sha512"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/certificate/csr"
	"k8s.io/client-go/util/keyutil"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/softtpm"
	kubeletkey "github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/harness"
)

// TestClusterAdmit: the kubelet's client certificate, approved by passage-control only
// for a boot it verified and only for the key that boot made and attested, on the real
// API server (bootstrap tokens, a client CA), kube-controller-manager's csrsigning
// controller (and no approving controller) and two passage-control replicas (the deploy
// file's RBAC, --approve-grace 3s). Nodes attest through the boot's own exchange with
// software TPMs, each manifest carrying its boot's key (kubelet.Make, the file the
// kubelet loads); each kubelet's request is the kubelet's own code path: the request its
// bootstrap makes (certutil.MakeCSR, named by its digest), created with client-go's
// csr.RequestCertificate as the bootstrap token's user and awaited with
// csr.WaitForCertificate. Then:
//
//	(a) a verified boot's key: approved (reason PassageVerifiedBoot) and a certificate
//	    issued that authenticates as system:node:<name> in system:nodes (a
//	    SelfSubjectReview) and registers its Node;
//	(b) another key for the same verified node: never approved;
//	(c) a node whose attestation failed (an unapproved image), its attested key: never;
//	(d) a node that never attested: never;
//	(e) the node rebooted and verified at generation 2 with a new key: its request
//	    approved, a new request for the previous boot's key not;
//	(f) 20 times, a boot holding only the bootstrap token (all a boot that is not
//	    verified ever holds) registering its Node and publishing its slice: both
//	    forbidden by the API server, and a pod created for that node at that moment
//	    is not bound. TestRealNode shows the same of a real kubelet.
//
// "Never" is judged once both replicas have judged the request (their
// passage_control_csr_total, past the grace), as pending with no certificate. The API
// writes of passage-control (its resources and the requests' approval, which no one
// else writes here: csrapproving does not run) are at most one more per boot than the
// exchange's: 5 a first boot, 3 a reboot.
func TestClusterAdmit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	work := t.TempDir()
	ctlBin := goBuild(t, work, "passage-control")
	c := startSigningCluster(t, ctx, work)
	applyCRDs(t, ctx, c)
	ctlConfig := filepath.Join(work, "passage-control.kubeconfig")
	deployControlRBAC(t, ctx, c, ctlConfig)
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	pool := replicaFiles(t, work, ca.PEM())
	const grace = 3 * time.Second
	replicas := []*replica{
		startReplica(t, ctx, ctlBin, ctlConfig, work, 1, "--approve-grace", grace.String()),
		startReplica(t, ctx, ctlBin, ctlConfig, work, 2, "--approve-grace", grace.String()),
	}
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	raw, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	fw, err := softtpm.NewFirmware(raw)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := rest.HTTPClientFor(restConfig(t, c))
	if err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))
	// The kubelet's --bootstrap-kubeconfig: the bootstrap token alone.
	bootstrap, err := kubernetes.NewForConfig(c.TokenConfig(c.BootstrapToken))
	if err != nil {
		t.Fatal(err)
	}
	writes := func(reqs requests) (n float64, by map[string]float64) {
		by = map[string]float64{}
		for k, v := range reqs {
			if k[0] == "total" && writeVerbs[k[1]] && (ours(k[2]) || k[2] == "certificatesigningrequests/approval") {
				n += v
				by[k[1]+" "+k[2]] += v
			}
		}
		return n, by
	}
	judged := func(result string) int {
		n := 0
		for _, r := range replicas {
			n += csrCounts(t, r)[result]
		}
		return n
	}
	booted := 0
	boot := func(n *controltest.SoftNode) error {
		booted++
		_, err := n.Boot(ctx, hc, replicas[booted%2].url, netboot.DefaultPublish)
		return err
	}

	// (a) First boots, each with its key, then each kubelet's bootstrap.
	const nodes = 4
	soft := make([]*controltest.SoftNode, nodes)
	keys := make([]*ecdsa.PrivateKey, nodes)
	for i := range soft {
		ek, err := softtpm.GenerateEK()
		if err != nil {
			t.Fatal(err)
		}
		host := fmt.Sprintf("b300-%02d", i)
		if soft[i], err = controltest.NewSoftNode(ctx, ca, ek, fw, host, 1); err != nil {
			t.Fatal(err)
		}
		var digest string
		keys[i], digest = bootKey(t, work, host)
		soft[i].KubeletKey = digest
		if err := soft[i].Sign(ctx, host, 1); err != nil {
			t.Fatal(err)
		}
	}
	reqs0 := apiRequests(t, ctx, admin, c.Server)
	for _, n := range soft {
		if err := boot(n); err != nil {
			t.Fatal(err)
		}
	}
	for i, n := range soft {
		certPEM := kubeletBootstrap(t, ctx, bootstrap, keys[i], n.Hostname)
		keyPEM, _ := keyutil.MarshalPrivateKeyToPEM(keys[i])
		nc := kubernetes.NewForConfigOrDie(c.CertConfig(certPEM, keyPEM))
		r, err := nc.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("%s's certificate: %v", n.Hostname, err)
		}
		if u := r.Status.UserInfo; u.Username != "system:node:"+n.Hostname || !slices.Contains(u.Groups, "system:nodes") {
			t.Fatalf("%s's certificate authenticates as %q %v", n.Hostname, u.Username, u.Groups)
		}
		// What the kubelet does first with it: register its Node (the Node authorizer's).
		if _, err := nc.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Hostname}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("%s registering its Node: %v", n.Hostname, err)
		}
		u, err := dyn.Resource(control.NodeResource).Get(ctx, n.Hostname, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if st, _ := u.Object["status"].(map[string]any); st["verdict"] != control.VerdictVerified || st["kubeletKey"] != n.KubeletKey {
			t.Fatalf("record %s: %v", n.Hostname, st)
		}
	}
	reqs1 := apiRequests(t, ctx, admin, c.Server)
	first, firstBy := writes(reqs1.minus(reqs0))
	t.Logf("(a) %d first boots verified, each kubelet's request approved and its certificate system:node:<name>: passage-control's API writes %.0f (%.2f a boot: %v)",
		nodes, first, first/nodes, firstBy)
	if first > 5*nodes || firstBy["PUT certificatesigningrequests/approval"] != nodes {
		t.Fatalf("API writes for %d first boots and their kubelets: %.0f (%v); want at most %d, one approval each", nodes, first, firstBy, 5*nodes)
	}

	// (b)-(d): requests never approved.
	never := func(what, result string, key *ecdsa.PrivateKey, node string) {
		t.Helper()
		before := judged(result)
		name, uid := kubeletRequest(t, ctx, bootstrap, key, node, false)
		waitFor(t, ctx, grace+30*time.Second, what+": judged by both replicas", func() (bool, string) {
			n := judged(result)
			return n >= before+2, fmt.Sprintf("%d of 2 judgements %s", n-before, result)
		})
		got, err := c.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
		if err != nil || got.UID != uid {
			t.Fatalf("%s: %v", what, err)
		}
		if len(got.Status.Conditions) != 0 || len(got.Status.Certificate) != 0 {
			t.Fatalf("%s: %+v, want pending with no certificate", what, got.Status)
		}
		t.Logf("%s: pending, both replicas judged it %s", what, result)
	}
	otherKey, _ := bootKey(t, work, "other")
	never("(b) another key for verified b300-00", control.CSRKeyMismatch, otherKey, soft[0].Hostname)

	ek, err := softtpm.GenerateEK()
	if err != nil {
		t.Fatal(err)
	}
	bad, err := softtpm.NewFirmware(unapprovedLog(t, raw))
	if err != nil {
		t.Fatal(err)
	}
	failed, err := controltest.NewSoftNode(ctx, ca, ek, bad, "b300-failed", 1)
	if err != nil {
		t.Fatal(err)
	}
	failedKey, failedDigest := bootKey(t, work, "failed")
	failed.KubeletKey = failedDigest
	if err := failed.Sign(ctx, failed.Hostname, 1); err != nil {
		t.Fatal(err)
	}
	if err := boot(failed); err == nil || !strings.Contains(err.Error(), "not approved") {
		t.Fatalf("the unapproved boot: %v", err)
	}
	never("(c) b300-failed's attested key (attestation-failed)", control.CSRNotVerified, failedKey, failed.Hostname)
	ghostKey, _ := bootKey(t, work, "ghost")
	never("(d) b300-never, which never attested", control.CSRNoRecord, ghostKey, "b300-never")

	// (e) Reboots at generation 2 with new keys.
	reqs2 := apiRequests(t, ctx, admin, c.Server)
	old := keys[0]
	for i, n := range soft {
		var digest string
		keys[i], digest = bootKey(t, work, n.Hostname+"-2")
		n.KubeletKey = digest
		if err := n.Reboot(ctx, fw, n.Hostname, 2); err != nil {
			t.Fatal(err)
		}
		if err := boot(n); err != nil {
			t.Fatal(err)
		}
	}
	for i, n := range soft {
		kubeletBootstrap(t, ctx, bootstrap, keys[i], n.Hostname)
	}
	reqs3 := apiRequests(t, ctx, admin, c.Server)
	again, againBy := writes(reqs3.minus(reqs2))
	t.Logf("(e) %d reboots verified at generation 2 with new keys, each new request approved: passage-control's API writes %.0f (%.2f a boot: %v)",
		nodes, again, again/nodes, againBy)
	if again > 3*nodes || againBy["PUT certificatesigningrequests/approval"] != nodes {
		t.Fatalf("API writes for %d reboots and their kubelets: %.0f (%v); want at most %d, one approval each", nodes, again, againBy, 3*nodes)
	}
	never("(e) a new request for b300-00's previous boot's key", control.CSRKeyMismatch, old, soft[0].Hostname)

	// (f) What an unverified boot can do, 20 times over: it holds the bootstrap token
	// and nothing else, so the moment it would publish (its Node, then its slice) is
	// refused by the API server, and a pod created for that node at that moment is never
	// bound.
	createNamespace(t, ctx, c.Client)
	for i := range 20 {
		node := fmt.Sprintf("b300-unverified-%02d", i)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: node, Namespace: ns},
			Spec: corev1.PodSpec{NodeSelector: map[string]string{corev1.LabelHostname: node},
				Containers: []corev1.Container{{Name: "c", Image: "passage.test/none"}}}}
		if _, err := c.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		_, nerr := bootstrap.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node,
			Labels: map[string]string{corev1.LabelHostname: node}}}, metav1.CreateOptions{})
		_, serr := bootstrap.ResourceV1().ResourceSlices().Create(ctx, &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: node + "-units"},
			Spec: resourceapi.ResourceSliceSpec{Driver: resources.DriverName, NodeName: &node,
				Pool:    resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1},
				Devices: []resourceapi.Device{{Name: "gpu0"}}},
		}, metav1.CreateOptions{})
		if !apierrors.IsForbidden(nerr) || !apierrors.IsForbidden(serr) {
			t.Fatalf("(f) %s with the bootstrap token: Node %v, ResourceSlice %v; want both forbidden", node, nerr, serr)
		}
		time.Sleep(time.Second)
		p, err := c.Client.CoreV1().Pods(pod.Namespace).Get(ctx, node, metav1.GetOptions{})
		if err != nil || p.Spec.NodeName != "" {
			t.Fatalf("(f) the pod for %s: %v, bound to %q", node, err, p.Spec.NodeName)
		}
		if i == 0 {
			t.Logf("(f) an unverified boot's writes: Node: %v; ResourceSlice: %v", nerr, serr)
		}
	}
	t.Log("(f) 20 unverified boots: no Node, no slice written, each pod created for one unbound")
}

// startSigningCluster is startCluster with harness.Options{Signing: true}.
func startSigningCluster(t testing.TB, ctx context.Context, work string) *harness.Cluster {
	t.Helper()
	bin := os.Getenv("PASSAGE_CONTROL_PLANE")
	if bin == "" {
		t.Fatal("PASSAGE_CONTROL_PLANE: the directory of the control plane's binaries (make cluster-test builds them)")
	}
	cdir := filepath.Join(work, "cp")
	os.MkdirAll(cdir, 0o755)
	c, err := harness.StartWith(ctx, bin, cdir, harness.Options{Signing: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, l := range c.Logs() {
				t.Log(harness.Tail(l, 3000))
			}
		}
		c.Stop()
	})
	return c
}

// bootKey makes a kubelet key as the boot does (kubelet.Make; the TPM's bytes from
// crypto/rand here) in a directory of its own under work, and returns it and its digest.
func bootKey(t testing.TB, work, name string) (*ecdsa.PrivateKey, string) {
	t.Helper()
	dir := filepath.Join(work, "kubelet-"+name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	digest, err := kubeletkey.Make(dir, func(n int) ([]byte, error) {
		b := make([]byte, n)
		rand.Read(b)
		return b, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The kubelet's own loader takes the file as it is.
	data, generated, err := keyutil.LoadOrGenerateKeyFile(filepath.Join(dir, kubeletkey.KeyFile))
	if err != nil || generated {
		t.Fatalf("the kubelet's loader: generated %v, %v", generated, err)
	}
	k, err := keyutil.ParsePrivateKeyPEM(data)
	if err != nil {
		t.Fatal(err)
	}
	return k.(*ecdsa.PrivateKey), digest
}

// kubeletRequest makes the request the kubelet's TLS bootstrap makes with key
// (k8s.io/kubernetes v1.37 pkg/kubelet/certificate/bootstrap, requestNodeCertificate):
// subject O=system:nodes, CN=system:node:<node>, usages digital signature and client
// auth (the key is ECDSA), created through client (the bootstrap token's) with
// client-go's csr.RequestCertificate, named by the kubelet's digestedName when named is
// true (a kubelet asking again for the same key finds its request), else generated.
func kubeletRequest(t testing.TB, ctx context.Context, client kubernetes.Interface, key *ecdsa.PrivateKey, node string, named bool) (string, types.UID) {
	t.Helper()
	name, uid, err := requestNodeCertificate(ctx, client, key, node, named)
	if err != nil {
		t.Fatal(err)
	}
	return name, uid
}

func requestNodeCertificate(ctx context.Context, client kubernetes.Interface, key *ecdsa.PrivateKey, node string, named bool) (string, types.UID, error) {
	subject := &pkix.Name{Organization: []string{"system:nodes"}, CommonName: "system:node:" + node}
	der, err := certutil.MakeCSR(key, subject, nil, nil)
	if err != nil {
		return "", "", err
	}
	usages := []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}
	name := ""
	if named {
		name = digestedName(key, subject, usages)
	}
	reqName, uid, err := csr.RequestCertificateWithContext(ctx, client, der, name, certificatesv1.KubeAPIServerClientKubeletSignerName, nil, usages, key)
	if err != nil {
		return "", "", fmt.Errorf("request for %s: %w", node, err)
	}
	return reqName, uid, nil
}

// joinKubelet is the kubelet's TLS bootstrap with the boot's key: its request
// (requestNodeCertificate, named as the kubelet names it), then its wait for the
// certificate (csr.WaitForCertificate, up to wait); it returns the certificate (PEM).
func joinKubelet(ctx context.Context, client kubernetes.Interface, key *ecdsa.PrivateKey, node string, wait time.Duration) ([]byte, string, error) {
	name, uid, err := requestNodeCertificate(ctx, client, key, node, true)
	if err != nil {
		return nil, "", err
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	certPEM, err := csr.WaitForCertificate(wctx, client, name, uid)
	if err != nil {
		return nil, name, fmt.Errorf("%s's certificate (request %s): %w", node, name, err)
	}
	return certPEM, name, nil
}

// kubeletBootstrap is joinKubelet, judged: the request approved with reason
// PassageVerifiedBoot and the certificate for key.
func kubeletBootstrap(t testing.TB, ctx context.Context, client kubernetes.Interface, key *ecdsa.PrivateKey, node string) []byte {
	t.Helper()
	certPEM, name, err := joinKubelet(ctx, client, key, node, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	got, err := client.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var reason string
	for _, c := range got.Status.Conditions {
		if c.Type == certificatesv1.CertificateApproved {
			reason = c.Reason
		}
	}
	if reason != control.ApprovedReason {
		t.Fatalf("%s's request %s approved with reason %q, want %s", node, name, reason, control.ApprovedReason)
	}
	certs, err := certutil.ParseCertsPEM(certPEM)
	if err != nil || len(certs) == 0 {
		t.Fatalf("%s's certificate: %v", node, err)
	}
	spki, _ := x509.MarshalPKIXPublicKey(key.Public())
	if !slices.Equal(certs[0].RawSubjectPublicKeyInfo, spki) {
		t.Fatalf("%s's certificate is for another key", node)
	}
	return certPEM
}

// digestedName is the kubelet's name for its request (bootstrap.go's digestedName):
// SHA-512/256 over the public key, subject and usages, each base64url'd and delimited.
func digestedName(key *ecdsa.PrivateKey, subject *pkix.Name, usages []certificatesv1.KeyUsage) string {
	h := sha512.New512_256()
	write := func(b []byte) {
		h.Write([]byte(base64.RawURLEncoding.EncodeToString(b)))
		h.Write([]byte{'|'})
	}
	der, _ := x509.MarshalPKIXPublicKey(key.Public()) // an ECDSA key always marshals
	write(der)
	write([]byte(subject.CommonName))
	for _, o := range subject.Organization {
		write([]byte(o))
	}
	for _, u := range usages {
		write([]byte(u))
	}
	return "node-csr-" + base64.RawURLEncoding.EncodeToString(h.Sum(nil))
}

// csrCounts are a replica's passage_control_csr_total by result.
func csrCounts(t testing.TB, r *replica) map[string]int {
	t.Helper()
	resp, err := http.Get(r.metrics)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	out := map[string]int{}
	for _, l := range strings.Split(string(b), "\n") {
		rest, ok := strings.CutPrefix(l, `passage_control_csr_total{result="`)
		if !ok {
			continue
		}
		if i := strings.Index(rest, `"} `); i > 0 {
			var n int
			fmt.Sscan(rest[i+3:], &n)
			out[rest[:i]] = n
		}
	}
	return out
}

// unapprovedLog is the fixture's firmware log with its UKI's Authenticode hash
// replaced: the same firmware booting an image the replicas do not approve.
func unapprovedLog(t testing.TB, raw []byte) []byte {
	t.Helper()
	ap, err := attest.ReadApproved(fixtures + "ovmf-secureboot.approved.json")
	if err != nil {
		t.Fatal(err)
	}
	h := []byte(ap.Authenticode[0])
	if !bytes.Contains(raw, h) {
		t.Fatal("the fixture log does not hold the approved Authenticode hash")
	}
	return bytes.ReplaceAll(raw, h, bytes.Repeat([]byte{0x5a}, len(h)))
}
