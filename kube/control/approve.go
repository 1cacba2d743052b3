package control

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log"
	"slices"
	"strings"
	"sync"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/manifest"
)

// KubeletSigner is the signer of the kubelet's client certificates, whose requests the
// Approver judges (Kubernetes' built-in kubernetes.io/kube-apiserver-client-kubelet,
// signed by kube-controller-manager's csrsigning controller).
const KubeletSigner = certificatesv1.KubeAPIServerClientKubeletSignerName

// ApprovedReason is the reason of the Approved condition the Approver writes.
const ApprovedReason = "PassageVerifiedBoot"

// What the Approver made of a certificate request: passage_control_csr_total's result
// label. Every result but CSRApproved leaves the request pending, written nothing.
const (
	CSRApproved = "approved"
	// CSRNotKubelet: not what a kubelet's bootstrap requests (subject, names, usages,
	// signature, signer), or its request does not parse.
	CSRNotKubelet = "not-kubelet-client"
	// CSRRequester: asked by neither a bootstrap token nor the node it names.
	CSRRequester = "requester"
	// CSRNoRecord: no PassageNode of the node's name: its boot never enrolled.
	CSRNoRecord = "no-record"
	// CSRNotVerified: the record's verdict is not verified (attestation-failed).
	CSRNotVerified = "not-verified"
	// CSRKeyMismatch: the request's key is not the one the record's verified boot
	// attested (another boot's, one no boot attested, or the boot attested none).
	CSRKeyMismatch = "key-mismatch"
	// CSRError: the record could not be read or the approval written; tried again.
	CSRError = "error"
)

// csrResults are the results the metrics always show.
var csrResults = []string{CSRApproved, CSRNotKubelet, CSRRequester, CSRNoRecord, CSRNotVerified, CSRKeyMismatch, CSRError}

// DefaultApproveGrace is Approver.Grace's default: longer than the replica that
// verified a boot takes to approve its kubelet's request when a storm of them queue.
// With 10 s and 4 workers a thousand reboots at once on two cores queued past it and
// both replicas approved 85 % of them (one write of each pair refused); with 30 s and 16
// workers, none (README.md, "The boot storm").
const DefaultApproveGrace = 30 * time.Second

// hintTTL is how long a replica remembers a key it verified: longer than a node takes
// from its verdict through the handoff to its kubelet's request.
const hintTTL = 30 * time.Minute

// keyIndex is the informer's index of pending requests by their key's digest.
const keyIndex = "kubeletKey"

// Approver approves the kubelet's client certificate requests of boots passage-control
// verified, each bound to the key its boot made and attested (initramfs/kubelet, the
// manifest's node.kubelet_key, the record's status.kubeletKey), and leaves every other
// request pending: it writes nothing but an approval, never a denial (a refusal anyone
// with a bootstrap token could provoke costs no write).
//
// A request is approved when, all of it checked without the API first: its signer is
// KubeletSigner; it is what the kubelet's bootstrap makes (subject exactly
// CN=system:node:<name>, O=system:nodes, no other name, usages digital signature and
// client auth, with key encipherment or not, its signature by its own key); its
// requester is a bootstrap token's user (system:bootstrap:*) or the node itself
// (system:node:<name>); and then, read by name, the record <name> is verified and the
// key it attested is the request's (sha256 of its SubjectPublicKeyInfo).
//
// Every replica watches the requests of KubeletSigner (one watch each, filtered by
// signer; its cache holds those requests, which kube-controller-manager's csrcleaner
// removes an hour after issue, a day if pending) and judges each pending one; approving
// is idempotent, so no leader is needed, and a replica killed at any instant loses
// nothing: every replica lists the pending requests when it starts. So that one boot
// costs one approval write and not one per replica, the replica that verified the boot
// approves at once (it remembers, in memory, the keys it verified in the last half
// hour: Verified), and the others only once a request has been pending Grace and is
// still pending in their cache, which by then holds the first one's approval. A
// request's judgement costs one GET of its record per replica that judges it (none
// for a replica that finds it approved after Grace), and nothing for one refused
// without the API; a request is judged again only when the record's boot is verified
// with its key (Verified looks it up in the cache's index by key) or its API calls
// failed.
type Approver struct {
	// Client reads and watches the requests and writes the approval. Its requests must
	// not time out under a watch (no rest.Config.Timeout).
	Client  kubernetes.Interface
	Store   *Store
	Metrics *Metrics
	Log     *log.Logger
	// Grace is how long a replica that did not verify a request's boot leaves it to the
	// one that did (0: DefaultApproveGrace).
	Grace time.Duration
	// Workers judge requests at once (0: 16): each judgement waits on a GET and a write,
	// so the API's latency, not the replica's CPU, bounds how many a worker does.
	Workers int
	Now     func() time.Time

	once     sync.Once
	queue    workqueue.TypedRateLimitingInterface[string]
	informer cache.SharedIndexInformer

	mu        sync.Mutex
	mine      map[string]hint   // by key digest
	keyOf     map[string]string // mine's key of each record
	nextSweep time.Time
}

// hint is a key this replica verified: the record that attested it, and until when it
// is remembered.
type hint struct {
	record string
	until  time.Time
}

func (a *Approver) now() time.Time {
	if a.Now != nil {
		return a.Now()
	}
	return time.Now()
}

func (a *Approver) grace() time.Duration {
	if a.Grace > 0 {
		return a.Grace
	}
	return DefaultApproveGrace
}

func (a *Approver) init() {
	a.once.Do(func() {
		a.queue = workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "passage-kubelet-csr"})
		a.mine, a.keyOf = map[string]hint{}, map[string]string{}
		field := "spec.signerName=" + KubeletSigner
		csrs := a.Client.CertificatesV1().CertificateSigningRequests()
		lw := &cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.FieldSelector = field
				return csrs.List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.FieldSelector = field
				return csrs.Watch(ctx, o)
			},
		}
		// A client that cannot stream its list (client-go's fake) says so to the reflector.
		a.informer = cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, a.Client),
			&certificatesv1.CertificateSigningRequest{}, 0, cache.Indexers{keyIndex: indexKey})
		// What a judgement reads is the spec and the status: the managed fields only cost
		// memory.
		a.informer.SetTransform(func(obj any) (any, error) {
			if m, err := meta.Accessor(obj); err == nil {
				m.SetManagedFields(nil)
			}
			return obj, nil
		})
		a.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    a.enqueue,
			UpdateFunc: func(_, obj any) { a.enqueue(obj) },
		})
	})
}

// indexKey indexes a pending request by its key's digest.
func indexKey(obj any) ([]string, error) {
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok || decided(csr) {
		return nil, nil
	}
	cr, err := parseRequest(csr.Spec.Request)
	if err != nil {
		return nil, nil
	}
	return []string{kubelet.DigestSPKI(cr.RawSubjectPublicKeyInfo)}, nil
}

func (a *Approver) enqueue(obj any) {
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok || decided(csr) {
		return
	}
	a.queue.Add(csr.Name)
}

// decided says whether a request needs no judgement: approved, denied or failed, or
// already issued.
func decided(csr *certificatesv1.CertificateSigningRequest) bool {
	if len(csr.Status.Certificate) > 0 {
		return true
	}
	for _, c := range csr.Status.Conditions {
		switch c.Type {
		case certificatesv1.CertificateApproved, certificatesv1.CertificateDenied, certificatesv1.CertificateFailed:
			return true
		}
	}
	return false
}

// Verified tells the approver that this replica has just recorded record's boot
// verified with the kubelet key digest: a pending request for that key is judged at
// once, here, and one that arrives within the next half hour too, without waiting Grace.
// It costs no API call (the cache's index by key). Nil-safe; a digest "" does nothing.
func (a *Approver) Verified(record, digest string) {
	if a == nil || digest == "" {
		return
	}
	a.init()
	now := a.now()
	a.mu.Lock()
	// The record's previous boot's key is no longer its: forgotten.
	if old, ok := a.keyOf[record]; ok && old != digest {
		delete(a.mine, old)
	}
	a.keyOf[record] = digest
	a.mine[digest] = hint{record: record, until: now.Add(hintTTL)}
	if now.After(a.nextSweep) {
		for k, h := range a.mine {
			if now.After(h.until) {
				delete(a.mine, k)
				delete(a.keyOf, h.record)
			}
		}
		a.nextSweep = now.Add(hintTTL / 4)
	}
	a.mu.Unlock()
	objs, err := a.informer.GetIndexer().ByIndex(keyIndex, digest)
	if err != nil {
		return
	}
	for _, o := range objs {
		a.enqueue(o)
	}
}

// verifiedHere says whether this replica verified digest for record.
func (a *Approver) verifiedHere(record, digest string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	h, ok := a.mine[digest]
	return ok && h.record == record && !a.now().After(h.until)
}

// Run watches the requests and judges them until ctx ends.
func (a *Approver) Run(ctx context.Context) {
	a.init()
	go a.informer.RunWithContext(ctx)
	go func() {
		<-ctx.Done()
		a.queue.ShutDown()
	}()
	synced := make(chan struct{})
	go func() {
		cache.WaitForCacheSync(ctx.Done(), a.informer.HasSynced)
		close(synced)
	}()
	select {
	case <-synced:
	case <-ctx.Done():
		return
	case <-time.After(time.Minute):
		a.logf("approver: the kubelet's certificate requests not listed after a minute (does the role grant certificatesigningrequests list and watch?); still trying")
		<-synced
	}
	workers := a.Workers
	if workers <= 0 {
		workers = 16
	}
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for a.next(ctx) {
			}
		})
	}
	wg.Wait()
}

// Synced says whether the approver's cache has listed the requests (tests).
func (a *Approver) Synced() bool {
	a.init()
	return a.informer.HasSynced()
}

func (a *Approver) next(ctx context.Context) bool {
	name, shut := a.queue.Get()
	if shut {
		return false
	}
	defer a.queue.Done(name)
	// Its client has no deadline of its own (it watches): each judgement's calls do.
	ctx, cancel := context.WithTimeout(ctx, VerdictTimeout)
	defer cancel()
	err := a.handle(ctx, name)
	if apierrors.IsConflict(err) {
		// Another writer's (another replica's approval, the signer): the cache catches
		// up, and the next look finds it decided or judges it again.
		a.queue.AddRateLimited(name)
		return true
	}
	if err != nil {
		a.Metrics.csr(CSRError)
		a.logf("approver: csr %s: %v (tried again)", name, err)
		a.queue.AddRateLimited(name)
		return true
	}
	a.queue.Forget(name)
	return true
}

// kubeletRequest is what a request asks, as the approver judges it.
type kubeletRequest struct {
	node, key, requester string
}

// Judge is what the approver makes of csr without the API: the node it names, its
// key's digest and its requester when it is a kubelet client request of an allowed
// requester; otherwise the result (CSRNotKubelet, CSRRequester) and why.
func Judge(csr *certificatesv1.CertificateSigningRequest) (node, key, result, why string) {
	r, result, why := judge(csr)
	return r.node, r.key, result, why
}

func judge(csr *certificatesv1.CertificateSigningRequest) (r kubeletRequest, result, why string) {
	r.requester = csr.Spec.Username
	if csr.Spec.SignerName != KubeletSigner {
		return r, CSRNotKubelet, fmt.Sprintf("signer %q, not %s", csr.Spec.SignerName, KubeletSigner)
	}
	cr, err := parseRequest(csr.Spec.Request)
	if err != nil {
		return r, CSRNotKubelet, err.Error()
	}
	r.key = kubelet.DigestSPKI(cr.RawSubjectPublicKeyInfo)
	name, ok := strings.CutPrefix(cr.Subject.CommonName, "system:node:")
	switch {
	case !ok:
		return r, CSRNotKubelet, fmt.Sprintf("subject CN %q, not system:node:<name>", cr.Subject.CommonName)
	case !slices.Equal(cr.Subject.Organization, []string{"system:nodes"}) || len(cr.Subject.Names) != 2:
		return r, CSRNotKubelet, fmt.Sprintf("subject %q: want exactly CN=system:node:<name>, O=system:nodes", cr.Subject.String())
	case len(cr.DNSNames)+len(cr.EmailAddresses)+len(cr.IPAddresses)+len(cr.URIs) > 0:
		return r, CSRNotKubelet, "subject alternative names: a kubelet's client certificate has none"
	}
	if err := CheckRecordName(name); err != nil {
		return r, CSRNotKubelet, fmt.Sprintf("node name %v", err)
	}
	r.node = name
	if !kubeletUsages(csr.Spec.Usages) {
		return r, CSRNotKubelet, fmt.Sprintf("usages %q: want digital signature and client auth (and key encipherment, or not)", csr.Spec.Usages)
	}
	if err := cr.CheckSignature(); err != nil {
		return r, CSRNotKubelet, fmt.Sprintf("signature: %v", err)
	}
	if !strings.HasPrefix(csr.Spec.Username, "system:bootstrap:") && csr.Spec.Username != "system:node:"+name {
		return r, CSRRequester, fmt.Sprintf("requested by %q: neither a bootstrap token (system:bootstrap:*) nor the node (system:node:%s)", csr.Spec.Username, name)
	}
	return r, "", ""
}

// maxRequest bounds the request a judgement parses (the API server's own bound on an
// object is larger; a kubelet's request is under 1 KiB).
const maxRequest = 64 << 10

func parseRequest(b []byte) (*x509.CertificateRequest, error) {
	if len(b) > maxRequest {
		return nil, fmt.Errorf("request of %d bytes, over %d", len(b), maxRequest)
	}
	p, _ := pem.Decode(b)
	if p == nil || p.Type != "CERTIFICATE REQUEST" {
		return nil, errors.New("request: not a PEM CERTIFICATE REQUEST")
	}
	cr, err := x509.ParseCertificateRequest(p.Bytes)
	if err != nil {
		return nil, fmt.Errorf("request: %v", err)
	}
	return cr, nil
}

// kubeletUsages are the usages the kubelet's bootstrap asks (k8s.io/kubernetes
// pkg/apis/certificates ValidateKubeletClientCSR: key encipherment only for an RSA key).
func kubeletUsages(us []certificatesv1.KeyUsage) bool {
	set := map[certificatesv1.KeyUsage]bool{}
	for _, u := range us {
		set[u] = true
	}
	want := set[certificatesv1.UsageDigitalSignature] && set[certificatesv1.UsageClientAuth]
	extra := len(set) - 2
	return want && (extra == 0 || extra == 1 && set[certificatesv1.UsageKeyEncipherment])
}

// JudgeRecord is what the approver makes of a kubelet request for node with key, given
// the node's record (nil: none): CSRApproved with the approval's message, or the result
// that leaves it pending and why.
func JudgeRecord(node, key string, n *Node) (result, why string) {
	switch {
	case n == nil:
		return CSRNoRecord, fmt.Sprintf("no record %s: the node never enrolled, so no boot of it was verified", node)
	case n.Status.Verdict != VerdictVerified:
		v := n.Status.Verdict
		if v == "" {
			v = "not judged"
		}
		return CSRNotVerified, fmt.Sprintf("record %s is %s at generation %d (%s)", node, v, n.Status.Generation, manifest.Printable(n.Status.Reason))
	case n.Status.KubeletKey == "":
		return CSRKeyMismatch, fmt.Sprintf("record %s's verified generation %d attested no kubelet key (a boot that does not switch_root, or signs without a TPM, makes none)", node, n.Status.Generation)
	case n.Status.KubeletKey != key:
		return CSRKeyMismatch, fmt.Sprintf("key %s is not the one record %s's verified generation %d attested (%s)", key, node, n.Status.Generation, manifest.Printable(n.Status.KubeletKey))
	}
	return CSRApproved, fmt.Sprintf("record %s verified at generation %d (boot %s): key %s is the one its attestation vouches for", node, n.Status.Generation, manifest.Printable(n.Status.BootID), key)
}

// handle judges the pending request name; an error is tried again later.
func (a *Approver) handle(ctx context.Context, name string) error {
	obj, ok, err := a.informer.GetIndexer().GetByKey(name)
	if err != nil || !ok {
		return err // gone
	}
	csr := obj.(*certificatesv1.CertificateSigningRequest)
	if decided(csr) {
		return nil
	}
	r, result, why := judge(csr)
	if result != "" {
		a.judged(csr, r, result, why)
		return nil
	}
	if !a.verifiedHere(r.node, r.key) {
		// The replica that verified the boot approves it; another waits Grace for it.
		if wait := a.grace() - a.now().Sub(csr.CreationTimestamp.Time); wait > 0 {
			a.queue.AddAfter(name, wait)
			return nil
		}
	}
	n, err := a.Store.Node(ctx, r.node)
	if errors.Is(err, ErrNoRecord) {
		n, err = nil, nil
	}
	if err != nil {
		return err
	}
	result, why = JudgeRecord(r.node, r.key, n)
	if result != CSRApproved {
		a.judged(csr, r, result, why)
		return nil
	}
	// Approved meanwhile (the other replica's write, seen while the record was read):
	// nothing to write.
	if obj, ok, _ := a.informer.GetIndexer().GetByKey(name); ok && decided(obj.(*certificatesv1.CertificateSigningRequest)) {
		return nil
	}
	c := csr.DeepCopy()
	c.Status.Conditions = append(c.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: ApprovedReason, Message: why,
		LastUpdateTime: metav1.NewTime(a.now())})
	if _, err := a.Client.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, c.Name, c, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("approve: %w", err)
	}
	a.judged(csr, r, CSRApproved, why)
	return nil
}

// judged counts and logs a judgement. Everything from the request is quoted: it is
// the requester's.
func (a *Approver) judged(csr *certificatesv1.CertificateSigningRequest, r kubeletRequest, result, why string) {
	a.Metrics.csr(result)
	verdict := "left pending (" + result + ")"
	if result == CSRApproved {
		verdict = "approved"
	}
	a.logf("approver: csr %q (node %q, key %s, requested by %q): %s: %s", csr.Name, r.node, r.key, r.requester, verdict, manifest.Printable(why))
}

func (a *Approver) logf(format string, args ...any) {
	if a.Log != nil {
		a.Log.Printf(format, args...)
	}
}
