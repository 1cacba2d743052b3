//go:build cluster

package harness_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/certificate"

	"github.com/passage-boot/passage/attest"
	kubeletkey "github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/recycle"
)

// signerBackdate is how far kube-controller-manager's csrsigning controller backdates
// NotBefore (k8s.io/kubernetes v1.37 pkg/controller/certificates/signer, sign:
// PermissiveSigningPolicy{Backdate: 5 * time.Minute, Short: 8 * time.Hour}); a
// certificate asked for less than Short keeps NotAfter = now + the asked lifetime.
const signerBackdate = 5 * time.Minute

// apiTimeout bounds every request of the API clients the renewal test makes.
const apiTimeout = 30 * time.Second

// TestClusterRenew: the kubelet's client certificate renewed by re-attestation
// (plugin.KubeletCert.Renew with the plugin's own Driver.AttestKubeletKey) on the real
// API server, kube-controller-manager's csrsigning controller and passage-control
// replicas as processes (the deploy file's RBAC). The node is noderig's b300-renew with
// a swtpm TPM, its boot's manifest carrying its kubelet key (kubelet.Make), attested
// through the turnaround's exchange by the plugin in process; the test plays the
// kubelet's bootstrap and leaves its --cert-dir as the kubelet does. Then:
//
//	(a) a renewal, as the node (the kubeconfig the bootstrap wrote, its certificate
//	    files the current pair): the record verified at the new generation with the new
//	    key, the node's request approved PassageVerifiedBoot, a certificate for the new
//	    key of the asked lifetime (plus the signer's backdating), due again at 70 to 90 %
//	    of its span, the current pair the new one and the previous pair's file gone;
//	(b) the replicas rolled out with an approved list that no longer has the node's
//	    image: the renewal fails at its re-attestation, no request is made, the pair is
//	    as it was and the record is attestation-failed at the generation that carried the
//	    refused key.
//
// The passage-control replicas sit behind a loopback TLS front (a Service's address):
// the plugin's passage.url does not change when they are replaced.
func TestClusterRenew(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	began := time.Now()
	step := func(format string, args ...any) {
		t.Helper()
		t.Logf("[%6.2fs] "+format, append([]any{time.Since(began).Seconds()}, args...)...)
	}
	work := t.TempDir()
	ctlBin := goBuild(t, work, "passage-control")
	c := startSigningCluster(t, ctx, work)
	applyCRDs(t, ctx, c)
	ctlConfig := filepath.Join(work, "passage-control.kubeconfig")
	deployControlRBAC(t, ctx, c, ctlConfig)
	admin := restConfig(t, c)
	admin.Timeout = apiTimeout
	api := kubernetes.NewForConfigOrDie(admin)
	dyn := dynamic.NewForConfigOrDie(admin)
	bc := c.TokenConfig(c.BootstrapToken)
	bc.Timeout = apiTimeout
	bootstrap := kubernetes.NewForConfigOrDie(bc)
	step("control plane (signing), CRDs and passage-control's RBAC")

	const host = "b300-renew"
	fw, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	keys := filepath.Join(work, "keys")
	rig := noderig.New(t, manifesttest.NodeUUID(1), host, 1, keys)
	ca, _ := rig.ForTurnaround(t, fw)
	pool := replicaFiles(t, work, ca.PEM(t))
	r1 := startReplica(t, ctx, ctlBin, ctlConfig, work, 1)
	front := newControlFront(t, work, pool, r1.url)
	step("passage-control replica 1 behind %s", front.URL)

	// The boot: its manifest carries the kubelet key it made, measured into PCR 13.
	bootPriv, bootDigest := bootKey(t, work, host)
	rig.M.Node.KubeletKey = bootDigest
	turnKeys := recycle.Keys{SigningKey: "/etc/passage/key", Dir: "/run/passage", TPM: "on"}
	gen := bootMeasured(t, rig, turnKeys)
	src := resources.Source{Keys: keys}
	hc := &http.Client{Timeout: apiTimeout, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	cfg := plugin.Config{Manifest: rig.Path, Source: src, Root: rig.Root, CDIDir: filepath.Join(rig.Dir, "cdi"),
		StateDir: filepath.Join(rig.Dir, "plugin"), Logf: t.Logf,
		Turnaround: &plugin.Turnaround{URL: front.URL + "/", Client: hc, Keys: turnKeys, Profile: "b300"}}
	if err := os.MkdirAll(cfg.StateDir, 0o750); err != nil {
		t.Fatal(err)
	}
	d, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.AttestCurrent(ctx); err != nil {
		t.Fatal(err)
	}
	if n := renewRecord(t, ctx, dyn, host); n.Status.Verdict != control.VerdictVerified || uint64(n.Status.Generation) != gen || n.Status.KubeletKey != bootDigest {
		t.Fatalf("the boot's record: %s at generation %d, key %s; want verified at %d with %s", n.Status.Verdict, n.Status.Generation, n.Status.KubeletKey, gen, bootDigest)
	}
	step("boot: generation %d verified with kubelet key %s", gen, bootDigest)

	// The kubelet's bootstrap: its request as the bootstrap token's user, the pair in its
	// --cert-dir (certificate.FileStore) and the kubeconfig naming the current pair for
	// both certificate and key (k8s.io/kubernetes v1.37 pkg/kubelet/certificate/bootstrap,
	// LoadClientCert and writeKubeconfigFromBootstrapping).
	bootCert := kubeletBootstrap(t, ctx, bootstrap, bootPriv, host)
	certDir := filepath.Join(work, "kubelet")
	store, err := certificate.NewFileStore(plugin.KubeletPair, certDir, certDir, "", "")
	if err != nil {
		t.Fatal(err)
	}
	bootKeyPEM, err := kubeletkey.PEM(bootPriv)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Update(bootCert, bootKeyPEM); err != nil {
		t.Fatal(err)
	}
	current := filepath.Join(certDir, plugin.KubeletPair+"-current.pem")
	kubeconfig := filepath.Join(certDir, "kubelet.conf")
	if err := clientcmd.WriteToFile(clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{"default-cluster": {Server: c.Server, CertificateAuthorityData: c.CA}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{"default-auth": {ClientCertificate: current, ClientKey: current}},
		Contexts:       map[string]*clientcmdapi.Context{"default-context": {Cluster: "default-cluster", AuthInfo: "default-auth", Namespace: "default"}},
		CurrentContext: "default-context",
	}, kubeconfig); err != nil {
		t.Fatal(err)
	}
	nc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	nc.Timeout = apiTimeout
	node := kubernetes.NewForConfigOrDie(nc)
	whoami(t, ctx, node, host)
	bootPair, _ := filepath.EvalSymlinks(current)
	bootCSRs := csrNames(t, ctx, api)
	step("bootstrap: request %v approved %s, pair %s", bootCSRs, control.ApprovedReason, filepath.Base(bootPair))
	// FileStore names a pair by the second it is written: the renewal's must be another.
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second)))

	// (a) The renewal.
	const lifetime = 15 * time.Minute
	k := &plugin.KubeletCert{Client: node, NodeName: host, CertDir: certDir, Lifetime: lifetime, Wait: time.Minute,
		Attest: d.AttestKubeletKey, Logf: t.Logf}
	asked := time.Now()
	cert, err := k.Renew(ctx)
	issued := time.Now()
	if err != nil {
		t.Fatalf("renewal: %v", err)
	}
	step("(a) renewed in %v", issued.Sub(asked).Round(time.Millisecond))
	v, err := resources.Verify(rig.Path, src)
	if err != nil {
		t.Fatal(err)
	}
	newKey, pairCert := renewPair(t, current)
	n := renewRecord(t, ctx, dyn, host)
	switch {
	case newKey == bootDigest:
		t.Fatalf("the current pair's key is the boot's, %s", bootDigest)
	case !pairCert.Equal(cert):
		t.Fatal("the current pair's certificate is not the one Renew returned")
	case v.Manifest.Generation <= gen || v.Manifest.Node.KubeletKey != newKey:
		t.Fatalf("manifest generation %d (the boot's %d), key %s; want a newer one with the pair's %s", v.Manifest.Generation, gen, v.Manifest.Node.KubeletKey, newKey)
	case n.Status.Verdict != control.VerdictVerified || uint64(n.Status.Generation) != v.Manifest.Generation || n.Status.KubeletKey != newKey:
		t.Fatalf("record %s at generation %d, key %s; want verified at %d with the pair's %s", n.Status.Verdict, n.Status.Generation, n.Status.KubeletKey, v.Manifest.Generation, newKey)
	}
	var renewal *certificatesv1.CertificateSigningRequest
	for _, r := range csrs(t, ctx, api) {
		if slices.Contains(bootCSRs, r.Name) {
			continue
		}
		if renewal != nil {
			t.Fatalf("requests %s and %s besides the bootstrap's", renewal.Name, r.Name)
		}
		renewal = &r
	}
	if renewal == nil {
		t.Fatal("no request but the bootstrap's")
	}
	if got := requestKey(t, renewal); got != newKey {
		t.Fatalf("request %s is for key %s, not the pair's %s", renewal.Name, got, newKey)
	}
	if renewal.Spec.Username != "system:node:"+host || approvedReason(renewal) != control.ApprovedReason ||
		renewal.Spec.ExpirationSeconds == nil || *renewal.Spec.ExpirationSeconds != int32(lifetime/time.Second) {
		t.Fatalf("request %s: requester %q, approved %q, expirationSeconds %v; want system:node:%s, %s, %d",
			renewal.Name, renewal.Spec.Username, approvedReason(renewal), renewal.Spec.ExpirationSeconds, host, control.ApprovedReason, int(lifetime/time.Second))
	}
	// Asked for less than the signer's Short, the certificate is valid from
	// now−backdate to now+lifetime, now the signer's, between the request and the
	// wait's end (X.509 keeps whole seconds).
	if got := cert.NotAfter.Sub(cert.NotBefore); got != lifetime+signerBackdate {
		t.Fatalf("certificate valid %v (%s to %s), want the asked %v and the signer's backdating %v", got, cert.NotBefore, cert.NotAfter, lifetime, signerBackdate)
	}
	if lo, hi := asked.Add(lifetime).Truncate(time.Second), issued.Add(lifetime); cert.NotAfter.Before(lo) || cert.NotAfter.After(hi) {
		t.Fatalf("certificate valid to %s, want the asked %v from its issue, between %s and %s", cert.NotAfter, lifetime, lo, hi)
	}
	// Renewed again by its own span, as the kubelet's rotation would: 70 to 90 % of
	// NotAfter−NotBefore after NotBefore.
	for _, j := range []float64{0, 1} {
		kj := *k
		kj.Jitter = func() float64 { return j }
		span := cert.NotAfter.Sub(cert.NotBefore)
		if due, want := kj.Due(cert), cert.NotBefore.Add(time.Duration(float64(span)*(0.7+0.2*j)).Round(time.Second)); !due.Equal(want) {
			t.Fatalf("due again at %s (jitter %v), want %s", due, j, want)
		}
	}
	if cert.Subject.CommonName != "system:node:"+host || !slices.Equal(cert.Subject.Organization, []string{"system:nodes"}) {
		t.Fatalf("certificate subject %s", cert.Subject)
	}
	newPair, _ := filepath.EvalSymlinks(current)
	if _, err := os.Lstat(bootPair); !os.IsNotExist(err) || newPair == bootPair {
		t.Fatalf("the boot's pair %s: %v (current now %s), want it gone", bootPair, err, newPair)
	}
	if got := dirNames(t, certDir); !slices.Equal(got, []string{filepath.Base(newPair), filepath.Base(current), "kubelet.conf"}) {
		t.Fatalf("the cert dir holds %v", got)
	}
	whoami(t, ctx, node, host)
	step("(a) record verified at generation %d with key %s; request %s by %s approved %s; certificate %s to %s (NotAfter−NotBefore %v: %v asked, %v backdated); pair %s, the boot's %s gone",
		n.Status.Generation, newKey, renewal.Name, renewal.Spec.Username, approvedReason(renewal),
		cert.NotBefore.UTC().Format(time.RFC3339), cert.NotAfter.UTC().Format(time.RFC3339), cert.NotAfter.Sub(cert.NotBefore), lifetime, signerBackdate,
		filepath.Base(newPair), filepath.Base(bootPair))

	// (b) The replicas replaced by ones whose approved list no longer has the node's
	// image (the fixture's Authenticode hash swapped for another).
	ap, err := attest.ReadApproved(fixtures + "ovmf-secureboot.approved.json")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(fixtures + "ovmf-secureboot.approved.json")
	if err != nil {
		t.Fatal(err)
	}
	image := []byte(hex.EncodeToString([]byte(ap.Authenticode[0])))
	withdrawn := filepath.Join(work, "approved-withdrawn.json")
	if !bytes.Contains(raw, image) {
		t.Fatal("the approved list does not hold its Authenticode hash in hex")
	}
	if err := os.WriteFile(withdrawn, bytes.ReplaceAll(raw, image, bytes.Repeat([]byte("5a"), len(image)/2)), 0o644); err != nil {
		t.Fatal(err)
	}
	r1.cmd.Process.Kill()
	<-r1.done
	r2 := startReplica(t, ctx, ctlBin, ctlConfig, work, 2, "--approved", withdrawn)
	front.to(t, r2.url)
	step("(b) replica 1 replaced by replica 2, whose approved list lacks the node's image")

	pairBefore, _ := os.ReadFile(newPair)
	filesBefore := dirNames(t, certDir)
	csrsBefore := csrNames(t, ctx, api)
	asked = time.Now()
	_, err = k.Renew(ctx)
	if err == nil || !strings.Contains(err.Error(), "re-attestation: verify") {
		t.Fatalf("a renewal whose attestation fails: %v; want it to fail at re-attestation: verify", err)
	}
	step("(b) refused in %v: %v", time.Since(asked).Round(time.Millisecond), err)
	if got := csrNames(t, ctx, api); !slices.Equal(got, csrsBefore) {
		t.Fatalf("requests %v after the refused renewal, %v before", got, csrsBefore)
	}
	for _, r := range csrs(t, ctx, api) {
		if approvedReason(&r) != "" && requestKey(t, &r) != bootDigest && requestKey(t, &r) != newKey {
			t.Fatalf("request %s approved for a key neither the boot's nor the renewal's", r.Name)
		}
	}
	if p, _ := filepath.EvalSymlinks(current); p != newPair {
		t.Fatalf("the current pair is %s, was %s", p, newPair)
	}
	if b, _ := os.ReadFile(current); !bytes.Equal(b, pairBefore) {
		t.Fatal("the current pair's contents changed")
	}
	if got := dirNames(t, certDir); !slices.Equal(got, filesBefore) {
		t.Fatalf("the cert dir holds %v, held %v", got, filesBefore)
	}
	failed, err := resources.Verify(rig.Path, src)
	if err != nil {
		t.Fatal(err)
	}
	n = renewRecord(t, ctx, dyn, host)
	if n.Status.Verdict != control.VerdictFailed || uint64(n.Status.Generation) != failed.Manifest.Generation ||
		failed.Manifest.Generation <= v.Manifest.Generation || n.Status.KubeletKey != failed.Manifest.Node.KubeletKey {
		t.Fatalf("record %s at generation %d with key %s (%s); want %s at %d, the refused generation's key %s",
			n.Status.Verdict, n.Status.Generation, n.Status.KubeletKey, n.Status.Reason, control.VerdictFailed,
			failed.Manifest.Generation, failed.Manifest.Node.KubeletKey)
	}
	if result, why := control.JudgeRecord(host, n.Status.KubeletKey, &n); result == control.CSRApproved {
		t.Fatalf("the approver would approve the refused generation's key: %s", why)
	}
	whoami(t, ctx, node, host)
	step("(b) no request made, the pair %s as it was (it works until %s), record %s at generation %d: %s",
		filepath.Base(newPair), cert.NotAfter.UTC().Format(time.RFC3339), n.Status.Verdict, n.Status.Generation, n.Status.Reason)
}

// controlFront is a loopback TLS front to one passage-control replica at a time, with
// the replicas' serving certificate: the address a Service gives the plugin.
type controlFront struct {
	*httptest.Server
	target atomic.Pointer[url.URL]
}

func newControlFront(t testing.TB, work string, pool *x509.CertPool, to string) *controlFront {
	t.Helper()
	crt, err := tls.LoadX509KeyPair(filepath.Join(work, "tls.crt"), filepath.Join(work, "tls.key"))
	if err != nil {
		t.Fatal(err)
	}
	f := &controlFront{}
	f.to(t, to)
	proxy := &httputil.ReverseProxy{
		Rewrite:   func(r *httputil.ProxyRequest) { r.SetURL(f.target.Load()) },
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ResponseHeaderTimeout: apiTimeout},
	}
	f.Server = httptest.NewUnstartedServer(proxy)
	f.TLS = &tls.Config{Certificates: []tls.Certificate{crt}}
	f.StartTLS()
	t.Cleanup(f.Close)
	return f
}

func (f *controlFront) to(t testing.TB, replica string) {
	t.Helper()
	u, err := url.Parse(replica)
	if err != nil {
		t.Fatal(err)
	}
	f.target.Store(u)
}

// bootMeasured replaces the rig's manifest with the one its boot writes with its TPM
// (keys): the next generation of the TPM's counter, signed by the TPM key and the key
// file, its digest logged and extended into PCR 13 (what an attestation quotes).
func bootMeasured(t testing.TB, r *noderig.Rig, keys recycle.Keys) uint64 {
	t.Helper()
	rec, err := recycle.OpenRecorder(r.Root, keys)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Close()
	m := *r.M
	m.BootID = noderig.BootID
	if m.Generation, m.GenerationSource, err = manifest.NextGeneration(rec.Counters...); err != nil {
		t.Fatal(err)
	}
	if _, err := manifest.WriteSigned(context.Background(), &m, rec.Dir, recycle.EnvelopeName, rec.Measurer, rec.Signers...); err != nil {
		t.Fatal(err)
	}
	return m.Generation
}

// renewRecord is the PassageNode named name as the API holds it.
func renewRecord(t testing.TB, ctx context.Context, dyn dynamic.Interface, name string) control.Node {
	t.Helper()
	u, err := dyn.Resource(control.NodeResource).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("record %s: %v", name, err)
	}
	b, err := json.Marshal(u.Object)
	if err != nil {
		t.Fatal(err)
	}
	n := control.Node{Name: u.GetName()}
	if err := json.Unmarshal(b, &n); err != nil {
		t.Fatalf("record %s: %v", name, err)
	}
	return n
}

// renewPair is the key digest and certificate of the pair at path, which must be a
// certificate and its own key.
func renewPair(t testing.TB, path string) (string, *x509.Certificate) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var cert *x509.Certificate
	var spki []byte
	for rest := b; ; {
		var p *pem.Block
		if p, rest = pem.Decode(rest); p == nil {
			break
		}
		switch p.Type {
		case "CERTIFICATE":
			if cert, err = x509.ParseCertificate(p.Bytes); err != nil {
				t.Fatal(err)
			}
		case "EC PRIVATE KEY":
			k, err := x509.ParseECPrivateKey(p.Bytes)
			if err != nil {
				t.Fatal(err)
			}
			spki, _ = x509.MarshalPKIXPublicKey(k.Public())
		}
	}
	if cert == nil || spki == nil || !bytes.Equal(spki, cert.RawSubjectPublicKeyInfo) {
		t.Fatalf("%s: not a certificate with its key", path)
	}
	return kubeletkey.DigestSPKI(spki), cert
}

// requestKey is the digest of the key a certificate request is for.
func requestKey(t testing.TB, r *certificatesv1.CertificateSigningRequest) string {
	t.Helper()
	p, _ := pem.Decode(r.Spec.Request)
	if p == nil {
		t.Fatalf("request %s: no PEM", r.Name)
	}
	cr, err := x509.ParseCertificateRequest(p.Bytes)
	if err != nil {
		t.Fatalf("request %s: %v", r.Name, err)
	}
	return kubeletkey.DigestSPKI(cr.RawSubjectPublicKeyInfo)
}

func approvedReason(r *certificatesv1.CertificateSigningRequest) string {
	for _, c := range r.Status.Conditions {
		if c.Type == certificatesv1.CertificateApproved {
			return c.Reason
		}
	}
	return ""
}

func csrs(t testing.TB, ctx context.Context, api kubernetes.Interface) []certificatesv1.CertificateSigningRequest {
	t.Helper()
	l, err := api.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return l.Items
}

func csrNames(t testing.TB, ctx context.Context, api kubernetes.Interface) []string {
	t.Helper()
	var out []string
	for _, r := range csrs(t, ctx, api) {
		out = append(out, r.Name)
	}
	slices.Sort(out)
	return out
}

func dirNames(t testing.TB, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// whoami fails t unless client authenticates as node's kubelet.
func whoami(t testing.TB, ctx context.Context, client kubernetes.Interface, node string) {
	t.Helper()
	r, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("the kubelet's kubeconfig: %v", err)
	}
	if u := r.Status.UserInfo; u.Username != "system:node:"+node || !slices.Contains(u.Groups, "system:nodes") {
		t.Fatalf("the kubelet's kubeconfig authenticates as %q %v", u.Username, u.Groups)
	}
}
