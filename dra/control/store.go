package control

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/metadata"

	"github.com/passage-boot/passage/attest"
)

// Store is the control plane's state, all of it in the Kubernetes API. It keeps nothing
// between calls but counters of its own writes (for the metrics and the benchmark).
type Store struct {
	Client dynamic.Interface
	// NonceTTL is how long an issued nonce is accepted (0: attest.DefaultNonceTTL).
	NonceTTL time.Duration
	// MaxNonces bounds the PassageNonces in the API (0: DefaultMaxNonces): a nonce GET is
	// unauthenticated and each one is an object in etcd until the sweep deletes it, twice
	// its time later, so with no bound a loop of GETs fills etcd's quota and stops every
	// write of the cluster. Past it, IssueNonce refuses (ErrTooManyNonces) until the
	// sweep makes room, as attest.NonceStore refuses at its MaxOutstanding.
	MaxNonces int64
	// Meta reads the records' metadata only: the unenrolled records are counted and
	// swept without reading the envelopes they hold.
	Meta metadata.Interface
	// MaxUnenrolled bounds the records not yet enrolled (0: DefaultMaxUnenrolled): an
	// envelope POST is unauthenticated and, for a hostname with no record, creates one
	// holding that envelope (up to MaxBody) and a DeviceTaintRule, so with no bound a
	// loop of POSTs for made-up hostnames fills etcd. Past it, a POST that would create a
	// record is refused (ErrTooManyUnenrolled); the records already there are served.
	MaxUnenrolled int64
	// UnenrolledTTL is how long a record may stay unenrolled before the sweep deletes it
	// (0: DefaultUnenrolledTTL).
	UnenrolledTTL time.Duration
	Now           func() time.Time
	writes        atomic.Int64
}

// DefaultMaxUnenrolled is MaxUnenrolled when zero: new nodes enrolling at once (each is
// unenrolled for the second or so its first publish takes); at most 1 GiB of envelopes
// at MaxBody each, about 40 MiB at a B300 manifest's size.
const DefaultMaxUnenrolled = 1024

// DefaultUnenrolledTTL is UnenrolledTTL when zero: a first boot enrols within its
// publish stage (seconds); an hour is many boots' retries.
const DefaultUnenrolledTTL = time.Hour

// ErrTooManyUnenrolled is the envelope POST's refusal at MaxUnenrolled.
var ErrTooManyUnenrolled = errors.New("too many records not yet enrolled")

// unenrolled selects the records with no enrolment: an enrolled record carries EKLabel.
var unenrolled = "!" + EKLabel

func (s *Store) maxUnenrolled() int64 {
	if s.MaxUnenrolled > 0 {
		return s.MaxUnenrolled
	}
	return DefaultMaxUnenrolled
}

func (s *Store) unenrolledTTL() time.Duration {
	if s.UnenrolledTTL > 0 {
		return s.UnenrolledTTL
	}
	return DefaultUnenrolledTTL
}

// CheckRoom says whether one more unenrolled record may be created: the count is read
// from the API (metadata only, at most MaxUnenrolled of them), so every replica holds
// the same bound; replicas racing may pass it by as many POSTs as are in flight at once.
func (s *Store) CheckRoom(ctx context.Context) error {
	max := s.maxUnenrolled()
	var count int64
	opts := metav1.ListOptions{LabelSelector: unenrolled, Limit: min(max, 500)}
	for range maxSweepPages {
		l, err := s.Meta.Resource(NodeResource).List(ctx, opts)
		if err != nil {
			return fmt.Errorf("records not yet enrolled: count: %w", err)
		}
		if count += int64(len(l.Items)); count >= max {
			return fmt.Errorf("records: %d not yet enrolled, at most %d: %w", count, max, ErrTooManyUnenrolled)
		}
		if opts.Continue = l.Continue; opts.Continue == "" {
			break
		}
	}
	return nil
}

// SweepUnenrolled deletes the records created longer than UnenrolledTTL ago that are
// still not enrolled, each delete conditional on the resourceVersion read (a record
// enrolled or written meanwhile stays), walking them page pages at a time by their
// metadata. It returns the names deleted, with the error that stopped the walk if one
// did.
func (s *Store) SweepUnenrolled(ctx context.Context, page int64) ([]string, error) {
	var gone []string
	opts := metav1.ListOptions{LabelSelector: unenrolled, Limit: page}
	for range maxSweepPages {
		l, err := s.Meta.Resource(NodeResource).List(ctx, opts)
		if err != nil {
			return gone, fmt.Errorf("records not yet enrolled: list: %w", err)
		}
		for i := range l.Items {
			m := &l.Items[i]
			if _, enrolled := m.Labels[EKLabel]; enrolled || s.now().Sub(m.CreationTimestamp.Time) < s.unenrolledTTL() {
				continue
			}
			rv := m.ResourceVersion
			s.writes.Add(1)
			err := s.Client.Resource(NodeResource).Delete(ctx, m.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{ResourceVersion: &rv}})
			if err == nil {
				gone = append(gone, m.Name)
			}
		}
		if opts.Continue = l.Continue; opts.Continue == "" {
			return gone, nil
		}
	}
	return gone, fmt.Errorf("records not yet enrolled: over %d pages of %d listed; the rest wait for the next sweep", maxSweepPages, page)
}

// DefaultMaxNonces is MaxNonces when zero: a fleet of tens of thousands of nodes all
// booting within a nonce's kept time (twice NonceTTL), a few tens of MB in etcd.
const DefaultMaxNonces = 65536

// ErrTooManyNonces is IssueNonce's refusal at MaxNonces.
var ErrTooManyNonces = errors.New("too many nonces outstanding")

// Writes is how many API writes this store made.
func (s *Store) Writes() int64 { return s.writes.Load() }

func (s *Store) now() time.Time {
	if s.Now != nil {
		return s.Now()
	}
	return time.Now()
}

func (s *Store) ttl() time.Duration {
	if s.NonceTTL > 0 {
		return s.NonceTTL
	}
	return attest.DefaultNonceTTL
}

// IssueNonce makes a fresh nonce and creates its PassageNonce: an issued nonce exists
// only as that object, so any replica can accept it.
func (s *Store) IssueNonce(ctx context.Context) ([]byte, error) {
	n := make([]byte, attest.NonceSize)
	if _, err := rand.Read(n); err != nil {
		return nil, err
	}
	name := hex.EncodeToString(n)
	// The count is the API server's (a list of one: the items left are counted, not
	// sent), so every replica holds the same bound; replicas racing may pass it by as
	// many GETs as are in flight at once.
	max := s.MaxNonces
	if max <= 0 {
		max = DefaultMaxNonces
	}
	l, err := s.Client.Resource(NonceResource).List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		return nil, fmt.Errorf("nonces: count: %w", err)
	}
	count := int64(len(l.Items))
	if r := l.GetRemainingItemCount(); r != nil {
		count += *r
	}
	if count >= max {
		return nil, fmt.Errorf("nonces: %d in the API, at most %d: %w", count, max, ErrTooManyNonces)
	}
	u, err := toObject(NonceResource, "PassageNonce", name, "", nil, map[string]any{"spec": Nonce{Issued: s.now().UTC()}})
	if err != nil {
		return nil, err
	}
	s.writes.Add(1)
	if _, err := s.Client.Resource(NonceResource).Create(ctx, u, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("nonce %s: create: %w", name, err)
	}
	return n, nil
}

// NonceRefusal is a nonce the store will not accept, with why.
type NonceRefusal struct {
	Nonce  string
	Reason string
}

func (e *NonceRefusal) Error() string { return "nonce " + e.Nonce + ": " + e.Reason }

func (s *Store) getNonce(ctx context.Context, name string) (*unstructured.Unstructured, *Nonce, error) {
	u, err := s.Client.Resource(NonceResource).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil, &NonceRefusal{Nonce: name, Reason: fmt.Sprintf("never issued by this control plane (or expired: nonces live %s)", s.ttl())}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("nonce %s: %w", name, err)
	}
	var o struct {
		Spec Nonce `json:"spec"`
	}
	if err := fromObject(u, &o); err != nil {
		return nil, nil, err
	}
	return u, &o.Spec, nil
}

func (s *Store) judgeNonce(name string, n *Nonce) error {
	switch {
	case n.Used != nil:
		return &NonceRefusal{Nonce: name, Reason: fmt.Sprintf("already used (at %s, for record %s): a replay", n.Used.UTC().Format(time.RFC3339), n.Record)}
	case s.now().Sub(n.Issued) > s.ttl():
		return &NonceRefusal{Nonce: name, Reason: fmt.Sprintf("issued %s ago, over %s", s.now().Sub(n.Issued).Round(time.Second), s.ttl())}
	}
	return nil
}

// CheckNonce says whether nonce was issued, is unused and within its time, writing
// nothing: an enrolment challenge does not use the nonce up.
func (s *Store) CheckNonce(ctx context.Context, nonce []byte) error {
	name := hex.EncodeToString(nonce)
	_, n, err := s.getNonce(ctx, name)
	if err != nil {
		return err
	}
	return s.judgeNonce(name, n)
}

// UseNonce uses nonce up for record: one update carrying the resourceVersion read. Of
// any number of replicas racing to use it, the API server lets exactly one update win
// (the others get a conflict, re-read it used, and refuse).
// It returns when the nonce was issued.
func (s *Store) UseNonce(ctx context.Context, nonce []byte, record string) (time.Time, error) {
	name := hex.EncodeToString(nonce)
	for range 3 {
		u, n, err := s.getNonce(ctx, name)
		if err != nil {
			return time.Time{}, err
		}
		if err := s.judgeNonce(name, n); err != nil {
			return time.Time{}, err
		}
		issued := n.Issued
		now := s.now().UTC()
		n.Used, n.Record = &now, record
		upd, err := toObject(NonceResource, "PassageNonce", name, u.GetResourceVersion(), nil, map[string]any{"spec": n})
		if err != nil {
			return time.Time{}, err
		}
		s.writes.Add(1)
		_, err = s.Client.Resource(NonceResource).Update(ctx, upd, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			continue // re-read: another replica used it (the next read says so)
		}
		if apierrors.IsNotFound(err) {
			return time.Time{}, &NonceRefusal{Nonce: name, Reason: "expired while being used"}
		}
		if err != nil {
			return time.Time{}, fmt.Errorf("nonce %s: use: %w", name, err)
		}
		return issued, nil
	}
	return time.Time{}, &NonceRefusal{Nonce: name, Reason: "contended: used by another request"}
}

// maxSweepPages bounds one sweep's walk of the nonces (its context bounds its time).
const maxSweepPages = 10000

// Sweep deletes nonces past twice their time (a used one is kept that long so a replay
// is refused as "already used"), each delete conditional on the resourceVersion read.
// It walks every nonce, page pages of them at a time: the list is in name order, the
// names are random, so a sweep that looked only at a first page would see the same
// young nonces every time and leave the expired ones past it for ever. It returns how
// many it deleted, with the error that stopped the walk if one did.
func (s *Store) Sweep(ctx context.Context, page int64) (int, error) {
	n := 0
	opts := metav1.ListOptions{Limit: page}
	for range maxSweepPages {
		l, err := s.Client.Resource(NonceResource).List(ctx, opts)
		if err != nil {
			return n, fmt.Errorf("nonces: list: %w", err)
		}
		for i := range l.Items {
			u := &l.Items[i]
			var o struct {
				Spec Nonce `json:"spec"`
			}
			if err := fromObject(u, &o); err != nil || s.now().Sub(o.Spec.Issued) < 2*s.ttl() {
				continue
			}
			rv := u.GetResourceVersion()
			s.writes.Add(1)
			err := s.Client.Resource(NonceResource).Delete(ctx, u.GetName(), metav1.DeleteOptions{Preconditions: &metav1.Preconditions{ResourceVersion: &rv}})
			if err == nil {
				n++
			}
		}
		if opts.Continue = l.GetContinue(); opts.Continue == "" {
			return n, nil
		}
	}
	return n, fmt.Errorf("nonces: over %d pages of %d listed; the rest wait for the next sweep", maxSweepPages, page)
}

// ErrNoRecord is a record that does not exist.
var ErrNoRecord = errors.New("no such record")

// Node reads a record.
func (s *Store) Node(ctx context.Context, name string) (*Node, error) {
	u, err := s.Client.Resource(NodeResource).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("record %s: %w", name, ErrNoRecord)
	}
	if err != nil {
		return nil, fmt.Errorf("record %s: %w", name, err)
	}
	return nodeOf(u)
}

func nodeOf(u *unstructured.Unstructured) (*Node, error) {
	n := &Node{}
	if err := fromObject(u, n); err != nil {
		return nil, err
	}
	n.Name, n.ResourceVersion, n.Labels = u.GetName(), u.GetResourceVersion(), u.GetLabels()
	return n, nil
}

// ByLabel finds the records whose label key has value (at most 2 read: more than one
// is itself the answer).
func (s *Store) ByLabel(ctx context.Context, key, value string) ([]*Node, error) {
	l, err := s.Client.Resource(NodeResource).List(ctx, metav1.ListOptions{LabelSelector: key + "=" + value, Limit: 2})
	if err != nil {
		return nil, fmt.Errorf("records with %s=%s: %w", key, value, err)
	}
	var out []*Node
	for i := range l.Items {
		n, err := nodeOf(&l.Items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// Create creates a record (spec and labels; the status is written after, through the
// status subresource).
func (s *Store) Create(ctx context.Context, n *Node) (*Node, error) {
	u, err := toObject(NodeResource, "PassageNode", n.Name, "", n.Labels, map[string]any{"spec": n.Spec})
	if err != nil {
		return nil, err
	}
	s.writes.Add(1)
	out, err := s.Client.Resource(NodeResource).Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("record %s: create: %w", n.Name, err)
	}
	return nodeOf(out)
}

// Update writes the record's spec and labels if it is still at the resourceVersion
// read (a conflict is returned as such: the caller reads again).
func (s *Store) Update(ctx context.Context, n *Node) (*Node, error) {
	u, err := toObject(NodeResource, "PassageNode", n.Name, n.ResourceVersion, n.Labels, map[string]any{"spec": n.Spec, "status": n.Status})
	if err != nil {
		return nil, err
	}
	s.writes.Add(1)
	out, err := s.Client.Resource(NodeResource).Update(ctx, u, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("record %s: update: %w", n.Name, err)
	}
	return nodeOf(out)
}

// UpdateStatus writes the record's status if it is still at the resourceVersion read.
func (s *Store) UpdateStatus(ctx context.Context, n *Node) (*Node, error) {
	u, err := toObject(NodeResource, "PassageNode", n.Name, n.ResourceVersion, n.Labels, map[string]any{"spec": n.Spec, "status": n.Status})
	if err != nil {
		return nil, err
	}
	s.writes.Add(1)
	out, err := s.Client.Resource(NodeResource).UpdateStatus(ctx, u, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("record %s: update status: %w", n.Name, err)
	}
	return nodeOf(out)
}

// ListNodes lists every record (for the metrics), page by page.
func (s *Store) ListNodes(ctx context.Context) ([]*Node, error) {
	var out []*Node
	opts := metav1.ListOptions{Limit: 500}
	for range 10000 {
		l, err := s.Client.Resource(NodeResource).List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("records: list: %w", err)
		}
		for i := range l.Items {
			n, err := nodeOf(&l.Items[i])
			if err != nil {
				return nil, err
			}
			out = append(out, n)
		}
		if opts.Continue = l.GetContinue(); opts.Continue == "" {
			break
		}
	}
	return out, nil
}

// labelOf is a digest as a label value: the first 63 hex digits of sha256(b).
func labelOf(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])[:63]
}
