package control

import (
	"context"
	"errors"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/manifest"
)

// Reconcile makes every pool passage-dra publishes carry the rule its record's verdict
// says (RuleFor, the verifier's function too), comparing it with the rule there and
// mending either way: a missing rule created, a stale one deleted, a wrong one
// updated. So a rule follows its verdict whatever failed in between: a verdict whose
// rule write failed after its status was written (an API refusal, a timeout,
// throttling), a verified record whose rule delete failed, a node whose boot never
// reached passage.url (the control plane was down, the publish gave up), a record the
// sweep deleted, a newer generation published than the one verified. No device is
// schedulable on the strength of an attestation that was never made, and none stays
// schedulable after one that failed. A pool's generation is its manifest's
// (resources.Render); a record names its pool (the manifest's hostname). A record
// whose node publishes no slices has no devices for its rule to select; its rule is
// mended on the first pass that sees its pool.
//
// What a pass costs the API: the pages (one LIST each of page objects) of the slices,
// of the records and of the rules; then, only for a pool whose listed rule is not what
// its listed record's verdict says, 1 read of its record and 1 of its rule, a write where
// the rule still differs, and the record read again. A fleet whose rules follow their
// verdicts costs a pass its pages alone, whatever its size: 10,000 pools in pages of 500
// are 60 LISTs, where a read of each pool's record and rule was 20,000 GETs.
//
// Every replica reconciles, from scratch on every pass; each write is idempotent.
// A verdict landing between the record's read and the rule's write is caught by
// reading the record again after any write and mending again if its rule changed: the
// verifier writes its status before its rule, so whichever of the two rule writes comes
// last, the rule ends as the record says. It returns the pools whose record leaves
// them tainted (tainted now or already).
func (s *Server) Reconcile(ctx context.Context, page int64) (int, error) {
	tainted, err := s.reconcile(ctx, page)
	s.Metrics.reconciled(tainted, err)
	return tainted, err
}

func (s *Server) reconcile(ctx context.Context, page int64) (int, error) {
	pools, err := s.pools(ctx, page)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	// Every record and every rule, listed once: a pool whose rule already says what its
	// record's verdict does costs nothing more. Where either list fails (a role without
	// list, an API hiccup) every pool is mended the exact way, one by one: the rule
	// still follows the verdict, at a pass's old cost.
	records, rerr := s.Store.Verdicts(ctx, page)
	rules, lerr := s.Taints.Rules(ctx, page)
	listed := rerr == nil && lerr == nil
	tainted := 0
	var errs []error
	if !listed {
		errs = append(errs, fmt.Errorf("reconcile: each pool read by name: %w", errors.Join(rerr, lerr)))
	}
	for pool, gen := range pools {
		if listed {
			if want := RuleFor(records[pool], gen); Says(rules[RuleName(pool)], pool, want) {
				if want.Verdict != VerdictVerified {
					tainted++
				}
				continue
			}
		}
		want, err := s.mend(ctx, pool, gen)
		if err != nil {
			errs = append(errs, fmt.Errorf("reconcile: %w", err))
		}
		if want.Verdict != VerdictVerified {
			tainted++
		}
	}
	return tainted, errors.Join(errs...)
}

// mendTries bounds how often one pass mends one pool whose verdict keeps moving under it.
const mendTries = 3

// mend makes pool's rule say what its record's verdict does at published generation
// gen; it returns that rule.
func (s *Server) mend(ctx context.Context, pool string, gen int64) (Rule, error) {
	var want Rule
	for range mendTries {
		n, err := s.Store.Node(ctx, pool)
		if errors.Is(err, ErrNoRecord) {
			n, err = nil, nil
		}
		if err != nil {
			return want, err
		}
		now := RuleFor(n, gen)
		if now == want {
			return want, nil // unchanged since the write: the rule says it
		}
		want = now
		wrote, err := s.Taints.Mend(ctx, pool, pool, want)
		if err != nil {
			return want, err
		}
		if !wrote {
			return want, nil
		}
		if s.Log != nil {
			s.Log.Printf("reconcile: device taint rule %s mended to %s (%s)", RuleName(pool), want.Verdict, manifest.Printable(want.Reason))
		}
	}
	return want, fmt.Errorf("device taint rule %s: its record's verdict moved on each of %d tries", RuleName(pool), mendTries)
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
