package plugin_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/util/certificate"

	kubeletkey "github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
)

// signer is kube-controller-manager's csrsigning controller in miniature: a CA that
// issues a request's certificate for its spec.expirationSeconds.
type signer struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newSigner(t *testing.T) *signer {
	t.Helper()
	k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes-client-ca"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, k.Public(), k)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return &signer{cert: c, key: k}
}

// issue is the certificate of pub for node, valid life from now.
func (s *signer) issue(t *testing.T, node string, pub any, life time.Duration) []byte {
	t.Helper()
	now := time.Now().Truncate(time.Second)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(now.UnixNano()), Subject: pkix.Name{CommonName: "system:node:" + node, Organization: []string{"system:nodes"}},
		NotBefore: now, NotAfter: now.Add(life), KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, s.cert, pub, s.key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// approverAPI is the API server as the node's kubelet credentials reach it: a request
// created is the node's (Username system:node:<node>), judged at once by
// passage-control's own judgement (control.Judge, then control.JudgeRecord of the record
// record returns) and, when approved, issued by s for its expirationSeconds.
type approverAPI struct {
	*fake.Clientset
	mu      sync.Mutex
	created []*certificatesv1.CertificateSigningRequest
	results []string
}

func newApproverAPI(t *testing.T, s *signer, node string, record func(name string) *control.Node) *approverAPI {
	a := &approverAPI{Clientset: fake.NewClientset()}
	a.PrependReactor("create", "certificatesigningrequests", func(act k8stesting.Action) (bool, runtime.Object, error) {
		csr := act.(k8stesting.CreateAction).GetObject().(*certificatesv1.CertificateSigningRequest)
		a.mu.Lock()
		defer a.mu.Unlock()
		csr.Name = fmt.Sprintf("%s%d", csr.GenerateName, len(a.created))
		csr.UID = types.UID(csr.Name)
		csr.Spec.Username = "system:node:" + node
		a.created = append(a.created, csr.DeepCopy())
		name, key, result, why := control.Judge(csr)
		if result == "" {
			result, why = control.JudgeRecord(name, key, record(name))
		}
		a.results = append(a.results, result+": "+why)
		if result == control.CSRApproved {
			csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
				Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: control.ApprovedReason, Message: why})
			p, _ := pem.Decode(csr.Spec.Request)
			cr, err := x509.ParseCertificateRequest(p.Bytes)
			if err != nil {
				return true, nil, err
			}
			csr.Status.Certificate = s.issue(t, name, cr.PublicKey, time.Duration(*csr.Spec.ExpirationSeconds)*time.Second)
		}
		return false, nil, nil
	})
	return a
}

// kubeletDir is a kubelet's --cert-dir after its bootstrap: the pair of key, issued by
// s for an hour, written as the kubelet writes it (certificate.FileStore).
func kubeletDir(t *testing.T, s *signer, node string, key *ecdsa.PrivateKey) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "kubelet")
	store, err := certificate.NewFileStore(plugin.KubeletPair, dir, dir, "", "")
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, _ := kubeletkey.PEM(key)
	if _, err := store.Update(s.issue(t, node, key.Public(), time.Hour), keyPEM); err != nil {
		t.Fatal(err)
	}
	// Named as a pair written long before: FileStore names pairs by the second, and a
	// renewal in the same second would write over this one.
	cur := filepath.Join(dir, plugin.KubeletPair+"-current.pem")
	target, _ := filepath.EvalSymlinks(cur)
	early := filepath.Join(dir, plugin.KubeletPair+"-2026-01-01-00-00-00.pem")
	if err := os.Rename(target, early); err != nil {
		t.Fatal(err)
	}
	os.Remove(cur)
	if err := os.Symlink(early, cur); err != nil {
		t.Fatal(err)
	}
	return dir
}

// pairOf is the key and certificate of the kubelet's current pair.
func pairOf(t *testing.T, k *plugin.KubeletCert) (key string, cert *x509.Certificate) {
	t.Helper()
	b, err := os.ReadFile(k.CurrentPath())
	if err != nil {
		t.Fatal(err)
	}
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
			pk, err := x509.ParseECPrivateKey(p.Bytes)
			if err != nil {
				t.Fatal(err)
			}
			spki, _ = x509.MarshalPKIXPublicKey(pk.Public())
		}
	}
	if cert == nil || spki == nil || !reflect.DeepEqual(spki, cert.RawSubjectPublicKeyInfo) {
		t.Fatalf("%s: not a certificate with its key", k.CurrentPath())
	}
	return kubeletkey.DigestSPKI(spki), cert
}

func files(t *testing.T, dir string) []string {
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

// TestKubeletCertRenew: on a node whose boot passage-control verified with its kubelet
// key, a renewal writes a generation that carries every unit unchanged and a new key's
// digest, which the control plane verifies and records as the node's key; the slices
// are rendered at that generation; the node's request for the key (subject, usages,
// signer, expirationSeconds) is what passage-control's judgement approves, and the pair
// written in the kubelet's --cert-dir is the new key with a certificate of the asked
// lifetime; the previous pair is gone. A second renewal the control plane refuses (a
// 403) gets no certificate: the pair and the record's key stay as they were.
func TestKubeletCertRenew(t *testing.T) {
	r := newTurnRig(t)
	var refuse sync.Mutex
	refusing := false
	r.front(t, func(w http.ResponseWriter, req *http.Request) bool {
		refuse.Lock()
		defer refuse.Unlock()
		if refusing && req.Method == http.MethodPost {
			http.Error(w, "record b300: quote: refused", http.StatusForbidden)
			return true
		}
		return false
	})
	bootKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	bootDigest, _ := kubeletkey.Digest(bootKey.Public())
	r.M.Node.KubeletKey = bootDigest
	gen := r.bootMeasured(t)
	d, err := plugin.New(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := d.AttestCurrent(ctx); err != nil {
		t.Fatal(err)
	}
	host := r.M.Node.Hostname
	rec := func(name string) *control.Node {
		n, err := r.srv.Store.Node(ctx, name)
		if err != nil {
			return nil
		}
		return n
	}
	if n := rec(host); n.Status.KubeletKey != bootDigest || uint64(n.Status.Generation) != gen {
		t.Fatalf("the boot's record: key %q generation %d", n.Status.KubeletKey, n.Status.Generation)
	}
	before, err := resources.Verify(r.cfg.Manifest, r.cfg.Source)
	if err != nil {
		t.Fatal(err)
	}
	s := newSigner(t)
	api := newApproverAPI(t, s, host, rec)
	k := &plugin.KubeletCert{Client: api, NodeName: host, CertDir: kubeletDir(t, s, host, bootKey), Lifetime: 15 * time.Minute,
		Wait: 10 * time.Second, Attest: d.AttestKubeletKey, Logf: r.logs.logf}
	oldPair, _ := filepath.EvalSymlinks(k.CurrentPath())

	cert, err := k.Renew(ctx)
	if err != nil {
		t.Fatalf("renewal: %v\n%s", err, r.logs)
	}
	after, err := resources.Verify(r.cfg.Manifest, r.cfg.Source)
	if err != nil {
		t.Fatal(err)
	}
	newKey, cur := pairOf(t, k)
	n := rec(host)
	switch {
	case after.Manifest.Generation <= gen || uint64(n.Status.Generation) != after.Manifest.Generation || n.Status.Verdict != control.VerdictVerified:
		t.Errorf("record %s at generation %d, the manifest at %d (the boot's %d)", n.Status.Verdict, n.Status.Generation, after.Manifest.Generation, gen)
	case after.Manifest.Node.KubeletKey != newKey || n.Status.KubeletKey != newKey || newKey == bootDigest:
		t.Errorf("manifest key %s, record's %s, the pair's %s (the boot's %s): want the pair's in both, not the boot's",
			after.Manifest.Node.KubeletKey, n.Status.KubeletKey, newKey, bootDigest)
	case !reflect.DeepEqual(after.Manifest.Units, before.Manifest.Units):
		t.Errorf("the renewal changed units:\n got %+v\nwant %+v", after.Manifest.Units, before.Manifest.Units)
	case uint64(d.Objects().Generation) != after.Manifest.Generation:
		t.Errorf("slices rendered at generation %d, want %d", d.Objects().Generation, after.Manifest.Generation)
	case !cur.Equal(cert) || cur.NotAfter.Sub(cur.NotBefore) != 15*time.Minute:
		t.Errorf("the pair's certificate valid %v (%s to %s), want the renewal's for 15m", cur.NotAfter.Sub(cur.NotBefore), cur.NotBefore, cur.NotAfter)
	}
	if len(api.created) != 1 || !strings.HasPrefix(api.results[0], control.CSRApproved) {
		t.Fatalf("requests %d, judged %v", len(api.created), api.results)
	}
	c := api.created[0]
	if c.Spec.SignerName != control.KubeletSigner || c.Spec.ExpirationSeconds == nil || *c.Spec.ExpirationSeconds != 900 ||
		!reflect.DeepEqual(c.Spec.Usages, []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}) {
		t.Errorf("request: signer %s, expirationSeconds %v, usages %v", c.Spec.SignerName, c.Spec.ExpirationSeconds, c.Spec.Usages)
	}
	if _, err := os.Lstat(oldPair); !os.IsNotExist(err) {
		t.Errorf("the previous pair %s (the boot's key) is still there: %v", oldPair, err)
	}
	for _, l := range strings.Split(r.logs.String(), "\n") {
		if strings.Contains(l, "kubelet certificate renewed") {
			t.Log(l)
		}
	}

	// Refused: no request, the pair and the record's key as they were.
	refuse.Lock()
	refusing = true
	refuse.Unlock()
	pairBefore, _ := os.ReadFile(k.CurrentPath())
	_, err = k.Renew(ctx)
	if err == nil || !strings.Contains(err.Error(), "re-attestation") || !strings.Contains(err.Error(), "403") {
		t.Fatalf("a refused re-attestation: %v", err)
	}
	t.Logf("refused: %v", err)
	if pairAfter, _ := os.ReadFile(k.CurrentPath()); string(pairAfter) != string(pairBefore) || len(api.created) != 1 {
		t.Errorf("refused, yet the pair changed or a request was made (%d requests)", len(api.created))
	}
	if n := rec(host); n.Status.KubeletKey != newKey {
		t.Errorf("refused, yet the record's key is %s, not %s", n.Status.KubeletKey, newKey)
	}
}

// TestKubeletCertFails: a renewal that fails at any step leaves the kubelet's current
// pair as it was, writes no other file beside it, and says why: the re-attestation
// failed (no request made); the request never approved (another key than the record's:
// pending until the wait ends); the pair not writable (its current link a regular file).
func TestKubeletCertFails(t *testing.T) {
	const host = "b300-a"
	s := newSigner(t)
	bootKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	for _, tc := range []struct {
		name   string
		attest error
		record func(key string) string // the record's key, given the renewal's
		broken bool
		says   string
	}{
		{name: "attestation refused", attest: errors.New("verify: generation 3: attestation: 403 Forbidden"), says: "re-attestation: verify"},
		{name: "never approved", record: func(string) string { return "sha256:" + strings.Repeat("0", 64) }, says: "not issued within"},
		{name: "not writable", record: func(k string) string { return k }, broken: true, says: "not stored"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var recordKey string
			api := newApproverAPI(t, s, host, func(name string) *control.Node {
				return &control.Node{Name: name,
					Status: control.NodeStatus{Verdict: control.VerdictVerified, Generation: 3, KubeletKey: recordKey}}
			})
			k := &plugin.KubeletCert{Client: api, NodeName: host, CertDir: kubeletDir(t, s, host, bootKey), Lifetime: time.Hour, Wait: 500 * time.Millisecond,
				Attest: func(ctx context.Context, times map[string]time.Duration) (*ecdsa.PrivateKey, uint64, error) {
					if tc.attest != nil {
						return nil, 0, tc.attest
					}
					key, digest, err := kubeletkey.New(func(n int) ([]byte, error) { b := make([]byte, n); rand.Read(b); return b, nil })
					recordKey = tc.record(digest)
					return key, 3, err
				}}
			if tc.broken {
				target, _ := filepath.EvalSymlinks(k.CurrentPath())
				b, _ := os.ReadFile(target)
				os.Remove(k.CurrentPath())
				if err := os.WriteFile(k.CurrentPath(), b, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			pairBefore, _ := os.ReadFile(k.CurrentPath())
			filesBefore := files(t, k.CertDir)
			_, err := k.Renew(context.Background())
			if err == nil || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("renewal: %v; want it to say %q", err, tc.says)
			}
			t.Logf("%v", err)
			if pairAfter, _ := os.ReadFile(k.CurrentPath()); string(pairAfter) != string(pairBefore) {
				t.Error("the current pair changed")
			}
			if got := files(t, k.CertDir); !reflect.DeepEqual(got, filesBefore) {
				t.Errorf("files %v after, %v before", got, filesBefore)
			}
			if key, _ := pairOf(t, k); key != mustDigest(t, bootKey) {
				t.Errorf("the current pair's key %s, not the boot's", key)
			}
			if tc.attest != nil && len(api.created) != 0 {
				t.Errorf("%d requests made after a failed re-attestation", len(api.created))
			}
			if tc.record != nil {
				// Whatever the record said, the request is one the approver's own judgement
				// takes for a kubelet's, from the node itself.
				node, key, result, why := control.Judge(api.created[0])
				if result != "" || node != host || key == "" {
					t.Errorf("the request judged %s: %s", result, why)
				}
			}
		})
	}
}

func mustDigest(t *testing.T, k *ecdsa.PrivateKey) string {
	t.Helper()
	d, err := kubeletkey.Digest(k.Public())
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestKubeletCertDue: renewed between 70 and 90 % of the current certificate's
// lifetime, or of the asked lifetime when that is shorter by more than the signer's
// backdating.
func TestKubeletCertDue(t *testing.T) {
	nb := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		life, asked time.Duration
		jitter      float64
		want        time.Duration
	}{
		{24 * time.Hour, 24 * time.Hour, 0, 16*time.Hour + 48*time.Minute},
		{24 * time.Hour, 24 * time.Hour, 1, 21*time.Hour + 36*time.Minute},
		{365 * 24 * time.Hour, 10 * time.Hour, 0.5, 8 * time.Hour},
		{time.Hour, 10 * time.Hour, 0.5, 48 * time.Minute},
		// A renewal's certificate asked for 15m, as kube-controller-manager issues it:
		// NotBefore backdated 5m, NotAfter the issue plus 15m. Renewed by its own span (9
		// to 13 min after its issue), not as a bootstrap certificate (5.5 to 8.5).
		{20 * time.Minute, 15 * time.Minute, 0, 14 * time.Minute},
		{20 * time.Minute, 15 * time.Minute, 1, 18 * time.Minute},
	} {
		k := &plugin.KubeletCert{Lifetime: tc.asked, Jitter: func() float64 { return tc.jitter }}
		if got := k.Due(&x509.Certificate{NotBefore: nb, NotAfter: nb.Add(tc.life)}).Sub(nb); got != tc.want {
			t.Errorf("lifetime %v asked %v jitter %v: due after %v, want %v", tc.life, tc.asked, tc.jitter, got, tc.want)
		}
	}
}
