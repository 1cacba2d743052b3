package control

import (
	"context"
	"errors"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/passage-boot/passage/dra/resources"
)

// Reconcile puts the unverified rule on every pool passage-dra publishes whose record
// has not verified the generation its slices carry: a node whose boot never reached
// passage.url (the control plane was down, the publish gave up), a record the sweep
// deleted, a newer generation published than the one verified. The envelope POST sets
// the rule when a node does post; this is the other half, so that no device is
// schedulable on the strength of an attestation that was never made (the issue's
// "schedulable only while ... verified"). A pool's generation is its manifest's
// (resources.Render); a record names its pool (the manifest's hostname).
//
// Every replica reconciles; each write is idempotent (Taints.Set writes only what
// differs). A verification landing between the record's read and the rule's write is
// caught by reading the record again after the write and clearing the rule if it is
// now verified at the pool's generation: the verifier clears after writing its verdict,
// so whichever of the two writes last, the rule ends as the verdict says. It returns
// the pools it found untaintable by their records (tainted now or already).
func (s *Server) Reconcile(ctx context.Context, page int64) (int, error) {
	pools, err := s.pools(ctx, page)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	tainted := 0
	var errs []error
	for pool, gen := range pools {
		reason, ok, err := s.unverified(ctx, pool, gen)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !ok {
			continue
		}
		tainted++
		// A rule already there (the envelope's, the verifier's) is left as it says.
		if _, err := s.Taints.Client.ResourceV1().DeviceTaintRules().Get(ctx, RuleName(pool), metav1.GetOptions{}); err == nil {
			continue
		} else if !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("reconcile: device taint rule %s: %w", RuleName(pool), err))
			continue
		}
		if err := s.Taints.Set(ctx, pool, pool, VerdictUnverified, "", reason); err != nil {
			errs = append(errs, err)
			continue
		}
		// Verified meanwhile: the rule just written is stale.
		if _, still, err := s.unverified(ctx, pool, gen); err != nil {
			errs = append(errs, err)
		} else if !still {
			tainted--
			if err := s.Taints.Clear(ctx, pool); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return tainted, errors.Join(errs...)
}

// unverified says whether pool's devices at generation gen lack a verification, and
// why. A refused attestation is not reconciled here: its NoExecute rule is the
// verifier's, with the check and reason only it has.
func (s *Server) unverified(ctx context.Context, pool string, gen int64) (string, bool, error) {
	n, err := s.Store.Node(ctx, pool)
	switch {
	case errors.Is(err, ErrNoRecord):
		return fmt.Sprintf("generation %d published; no record: the node has not enrolled", gen), true, nil
	case err != nil:
		return "", false, fmt.Errorf("reconcile: %w", err)
	}
	switch n.Status.Verdict {
	case VerdictFailed:
		return "", false, nil
	case VerdictVerified:
		if n.Status.Generation >= gen {
			return "", false, nil
		}
		return fmt.Sprintf("generation %d published, generation %d verified", gen, n.Status.Generation), true, nil
	}
	if n.Status.Reason != "" {
		return n.Status.Reason, true, nil
	}
	return fmt.Sprintf("generation %d published and not attested", gen), true, nil
}

// pools are the pools passage-dra publishes slices for, each at its newest generation,
// read in at most maxSweepPages pages of page slices.
func (s *Server) pools(ctx context.Context, page int64) (map[string]int64, error) {
	pools := map[string]int64{}
	opts := metav1.ListOptions{Limit: page, FieldSelector: "spec.driver=" + resources.DriverName}
	for range maxSweepPages {
		l, err := s.Taints.Client.ResourceV1().ResourceSlices().List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("resource slices: %w", err)
		}
		for _, sl := range l.Items {
			if sl.Spec.Driver != resources.DriverName {
				continue
			}
			pools[sl.Spec.Pool.Name] = max(pools[sl.Spec.Pool.Name], sl.Spec.Pool.Generation)
		}
		if opts.Continue = l.Continue; opts.Continue == "" {
			return pools, nil
		}
	}
	return nil, fmt.Errorf("resource slices: over %d pages of %d listed", maxSweepPages, page)
}
