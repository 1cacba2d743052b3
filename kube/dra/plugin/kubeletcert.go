package plugin

import (
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/client-go/kubernetes"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/certificate"
	"k8s.io/client-go/util/certificate/csr"

	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/recycle"
)

// KubeletPair is the kubelet's name for its client certificate and key pair in its
// --cert-dir: the bootstrap and its own rotation write <pair>-<time>.pem and point
// <pair>-current.pem at it (client-go's certificate.FileStore), and the kubeconfig it
// writes names <pair>-current.pem for both.
const KubeletPair = "kubelet-client"

// RenewSteps are a renewal's timed steps, in order: the generation with the new key
// signed (sign), quoted (attest) and verified by the control plane (verify), the slices
// republished at it (publish), the certificate request created (request), approved and
// issued (issue), and the pair written (store).
var RenewSteps = []string{"sign", "attest", "verify", "publish", "request", "issue", "store"}

// MinKubeletCertLifetime is the shortest lifetime a request may ask: the API server
// refuses spec.expirationSeconds under 600.
const MinKubeletCertLifetime = 10 * time.Minute

// KubeletCert renews the kubelet's client certificate by re-attestation, on the node,
// while the kubelet runs with rotateCertificates off: at a jittered point between 70 and
// 90 % of the current certificate's lifetime (or of Lifetime, when that is shorter), it
// has a new kubelet key attested (Attest: a new signed generation of the same boot whose
// node.kubelet_key is the new key's, verified by passage-control, which then records it
// as the record's key), requests a certificate for that key as the node
// (CN=system:node:<name>, O=system:nodes, usages digital signature and client auth,
// signer kubernetes.io/kube-apiserver-client-kubelet, spec.expirationSeconds Lifetime:
// exactly what passage-control's Approver approves for a verified key), waits for it
// to be approved and issued, and writes the pair into CertDir as the kubelet's own
// rotation does (certificate.FileStore, KubeletPair). The kubelet's client reads its
// kubeconfig's certificate files again at most once a second and closes its
// connections when the pair changed (client-go transport, ReloadTLSFiles), so it takes
// the new certificate with no restart. The new key is in memory until the pair is
// written; a renewal that fails leaves the current pair as it was, and is tried again
// after Backoff, doubling up to MaxBackoff: a node whose re-attestation keeps failing
// loses its credentials when the current certificate expires.
type KubeletCert struct {
	// Client is the node's: the kubelet's kubeconfig, whose certificate files are
	// CertDir's current pair (so a request's requester is system:node:<NodeName>).
	Client   kubernetes.Interface
	NodeName string
	// CertDir is the kubelet's --cert-dir, at the same path as the kubelet sees it: the
	// FileStore's symbolic link names its target by its absolute path.
	CertDir string
	// Lifetime is the certificate asked for (spec.expirationSeconds); the signer's
	// --cluster-signing-duration caps it.
	Lifetime time.Duration
	// Wait bounds the wait for approval and issue (0: 5 min).
	Wait time.Duration
	// Backoff is the wait after a failed renewal, doubling up to MaxBackoff (0: 30 s,
	// 10 min), each jittered down to half.
	Backoff, MaxBackoff time.Duration
	// Attest makes a new kubelet key, has a generation carrying its digest verified
	// and returns the key and the generation verified; times gets its steps
	// (Driver.AttestKubeletKey).
	Attest func(ctx context.Context, times map[string]time.Duration) (*ecdsa.PrivateKey, uint64, error)
	Logf   func(format string, args ...any)
	// Now and Jitter are the clock and the point of the lifetime renewed at, in [0, 1)
	// (tests); nil: time.Now and a uniform draw.
	Now    func() time.Time
	Jitter func() float64
}

func (k *KubeletCert) logf(format string, args ...any) {
	if k.Logf != nil {
		k.Logf(format, args...)
	}
}

func (k *KubeletCert) now() time.Time {
	if k.Now != nil {
		return k.Now()
	}
	return time.Now()
}

// CurrentPath is the pair the kubelet's kubeconfig names.
func (k *KubeletCert) CurrentPath() string {
	return filepath.Join(k.CertDir, KubeletPair+"-current.pem")
}

// Current is the certificate of the kubelet's current pair.
func (k *KubeletCert) Current() (*x509.Certificate, error) {
	b, err := manifest.ReadRegular(k.CurrentPath(), MaxFile)
	if err != nil {
		return nil, fmt.Errorf("kubelet certificate: %w", err)
	}
	certs, err := certutil.ParseCertsPEM(b)
	if err != nil {
		return nil, fmt.Errorf("kubelet certificate %s: %w", k.CurrentPath(), err)
	}
	return certs[0], nil
}

// SignerBackdate is how far kube-controller-manager's csrsigning controller dates a
// certificate's NotBefore before its issue; asked for under 8 hours, its NotAfter stays
// the issue plus the lifetime asked, so it spans the lifetime and the backdating
// (k8s.io/kubernetes pkg/controller/certificates/signer, sign).
const SignerBackdate = 5 * time.Minute

// Due is when cert is renewed: NotBefore plus 70 to 90 % (jittered, as the kubelet's
// own rotation) of its lifetime, or of Lifetime when the certificate spans more than
// Lifetime and the signer's backdating (a bootstrap certificate the signer issued for
// its whole duration is renewed as if it were asked for Lifetime; one a renewal asked
// for Lifetime is renewed by its own span, as the kubelet's rotation would).
func (k *KubeletCert) Due(cert *x509.Certificate) time.Time {
	life := cert.NotAfter.Sub(cert.NotBefore)
	if k.Lifetime > 0 && k.Lifetime+SignerBackdate < life {
		life = k.Lifetime
	}
	j := rand.Float64()
	if k.Jitter != nil {
		j = k.Jitter()
	}
	return cert.NotBefore.Add(time.Duration(float64(life) * (0.7 + 0.2*j)).Round(time.Second))
}

// KubeletUsages are what the Approver accepts of an ECDSA key's request (and the
// kubelet's bootstrap asks): key encipherment is for RSA keys only.
var KubeletUsages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}

// Renew renews the certificate once: the new key attested, its request, the
// certificate issued for it, the pair written. An error says at which step; the pair
// in CertDir is then the one before.
func (k *KubeletCert) Renew(ctx context.Context) (*x509.Certificate, error) {
	if k.Lifetime < MinKubeletCertLifetime {
		return nil, fmt.Errorf("kubelet certificate: lifetime %v, under the API server's minimum %v", k.Lifetime, MinKubeletCertLifetime)
	}
	times := map[string]time.Duration{}
	key, gen, err := k.Attest(ctx, times)
	if err != nil {
		return nil, fmt.Errorf("kubelet certificate: re-attestation: %w (%s)", err, stepLine(RenewSteps, times))
	}
	start := time.Now()
	der, err := certutil.MakeCSR(key, &pkix.Name{CommonName: "system:node:" + k.NodeName, Organization: []string{"system:nodes"}}, nil, nil)
	if err != nil {
		return nil, fmt.Errorf("kubelet certificate: request: %w", err)
	}
	life := k.Lifetime
	name, uid, err := csr.RequestCertificateWithContext(ctx, k.Client, der, "", certificatesv1.KubeAPIServerClientKubeletSignerName, &life, KubeletUsages, key)
	times["request"] = time.Since(start)
	if err != nil {
		return nil, fmt.Errorf("kubelet certificate: generation %d verified; request: %w", gen, err)
	}
	start = time.Now()
	wait := k.Wait
	if wait <= 0 {
		wait = 5 * time.Minute
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	certPEM, err := csr.WaitForCertificate(wctx, k.Client, name, uid)
	cancel()
	times["issue"] = time.Since(start)
	if err != nil {
		return nil, fmt.Errorf("kubelet certificate: generation %d verified; request %s not issued within %v: %w", gen, name, wait, err)
	}
	certs, err := certutil.ParseCertsPEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("kubelet certificate: request %s: %w", name, err)
	}
	spki, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return nil, err
	}
	if !slices.Equal(certs[0].RawSubjectPublicKeyInfo, spki) {
		return nil, fmt.Errorf("kubelet certificate: request %s issued a certificate for another key", name)
	}
	start = time.Now()
	keyPEM, err := kubelet.PEM(key)
	if err != nil {
		return nil, err
	}
	old, _ := filepath.EvalSymlinks(k.CurrentPath())
	pairs := func() map[string]bool {
		m := map[string]bool{}
		ps, _ := filepath.Glob(filepath.Join(k.CertDir, KubeletPair+"-*.pem"))
		for _, p := range ps {
			m[p] = true
		}
		return m
	}
	had := pairs()
	store, err := certificate.NewFileStore(KubeletPair, k.CertDir, k.CertDir, "", "")
	if err == nil {
		_, err = store.Update(certPEM, keyPEM)
	}
	times["store"] = time.Since(start)
	if err != nil {
		// The pair Update wrote before it failed to point the link at it holds the new
		// key, which the kubelet never takes now: it goes.
		for p := range pairs() {
			if !had[p] {
				os.Remove(p)
			}
		}
		return nil, fmt.Errorf("kubelet certificate: request %s issued; not stored in %s: %w", name, k.CertDir, err)
	}
	// The previous pair's key is of no use to anyone once the kubelet reads the new
	// one: it goes (the kubelet's memory keeps it until its client reloads, within a
	// second).
	if now, _ := filepath.EvalSymlinks(k.CurrentPath()); old != "" && now != old && filepath.Dir(old) == filepath.Dir(now) &&
		strings.HasPrefix(filepath.Base(old), KubeletPair+"-") {
		if err := os.Remove(old); err != nil {
			k.logf("kubelet certificate: the previous pair %s not removed: %v", old, err)
		}
	}
	c := certs[0]
	k.logf("kubelet certificate renewed: generation %d, key %s, request %s, valid %s to %s (%s)", gen, digestOf(spki), name,
		c.NotBefore.UTC().Format(time.RFC3339), c.NotAfter.UTC().Format(time.RFC3339), stepLine(RenewSteps, times))
	return c, nil
}

func digestOf(spki []byte) string { return kubelet.DigestSPKI(spki) }

// Run renews the certificate whenever it is due until ctx ends; a Lifetime of 0 does
// nothing. A certificate that cannot be read (the kubelet not bootstrapped yet) is read
// again after Backoff.
func (k *KubeletCert) Run(ctx context.Context) {
	if k.Lifetime == 0 {
		return
	}
	backoff, maxBackoff := k.Backoff, k.MaxBackoff
	if backoff <= 0 {
		backoff = 30 * time.Second
	}
	if maxBackoff < backoff {
		maxBackoff = max(10*time.Minute, backoff)
	}
	wait := backoff
	pause := func(err error) bool {
		p := wait - time.Duration(rand.Int64N(int64(wait/2)+1))
		k.logf("%v; tried again in %s", err, p.Round(time.Millisecond))
		if wait *= 2; wait > maxBackoff || wait <= 0 {
			wait = maxBackoff
		}
		return sleepCtx(ctx, p)
	}
	for ctx.Err() == nil {
		cur, err := k.Current()
		if err != nil {
			if !pause(err) {
				return
			}
			continue
		}
		due := k.Due(cur)
		k.logf("kubelet certificate valid to %s: renewed at %s", cur.NotAfter.UTC().Format(time.RFC3339), due.UTC().Format(time.RFC3339))
		if !sleepCtx(ctx, due.Sub(k.now())) {
			return
		}
		for {
			_, err := k.Renew(ctx)
			if err == nil {
				wait = backoff
				break
			}
			if ctx.Err() != nil {
				return
			}
			if left := cur.NotAfter.Sub(k.now()); left <= 0 {
				err = fmt.Errorf("%w; the current certificate expired at %s: the kubelet has no credentials until a renewal succeeds or the node reboots", err, cur.NotAfter.UTC().Format(time.RFC3339))
			}
			if !pause(err) {
				return
			}
		}
	}
}

// AttestKubeletKey is KubeletCert.Attest on the plugin's node: a new kubelet key's
// generation (recycle.Renew, with the turnaround's keys and TPM, the key's seed from
// the TPM's generator), the turnaround's exchange for it (deliver: a fresh nonce, the
// quote, the POSTs, the control plane's verdict), the verified generation recorded and
// the slices republished at it (so passage-control's reconciler does not hold the pool
// unverified). No unit is touched. It needs the turnaround (its TPM and control plane).
func (d *Driver) AttestKubeletKey(ctx context.Context, times map[string]time.Duration) (*ecdsa.PrivateKey, uint64, error) {
	t := d.cfg.Turnaround
	if t == nil || d.turn.rec == nil {
		return nil, 0, errors.New("no turnaround (no control plane URL or no TPM) to attest a new key with")
	}
	rec := d.turn.rec
	o := recycle.Options{Root: d.cfg.Root, Writes: &d.turn.writes, Who: "passage-dra kubelet certificate", Log: logWriter{d, "kubelet certificate: "}}
	rec.Fill(&o)
	start := time.Now()
	r, err := recycle.Renew(ctx, o, rec.TPM.Random)
	times["sign"] = time.Since(start)
	if err != nil {
		return nil, 0, fmt.Errorf("sign: %w", err)
	}
	gen, step, err := d.deliver(ctx, times)
	if err == nil && gen < r.Manifest.Generation {
		step, err = "verify", fmt.Errorf("the control plane verified generation %d, older than %d that carries the new key", gen, r.Manifest.Generation)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", step, err)
	}
	d.verifiedGeneration(gen)
	start = time.Now()
	err = d.Reload(ctx)
	times["publish"] = time.Since(start)
	if err != nil {
		// Verified: the certificate is requested all the same; the next reload publishes.
		d.logf("kubelet certificate: generation %d verified; slices not republished yet (the next reload does): %v", gen, err)
	}
	return r.Key, gen, nil
}

// HasTurnaround says whether the plugin has a turnaround to attest with (its control
// plane and TPM): AttestKubeletKey needs it.
func (d *Driver) HasTurnaround() bool { return d.cfg.Turnaround != nil && d.turn.rec != nil }
