package control

import (
	"context"
	"fmt"
	"strings"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/passage-boot/passage/kube/dra/resources"
)

// Taint keys the control plane puts on a node's devices (DeviceTaintRule, one per node).
const (
	// TaintUnverified (NoSchedule): the node's manifest has no accepted attestation yet.
	TaintUnverified = Group + "/unverified"
	// TaintFailed (NoExecute): an attestation the node's own TPM made was refused; its
	// value is the refused check, the rule's ReasonAnnotation the verifier's words.
	TaintFailed = Group + "/attestation-failed"
)

// ReasonAnnotation on a rule carries the whole reason (a taint value is at most 63
// characters of a label value).
const ReasonAnnotation = Group + "/reason"

// RuleName is the DeviceTaintRule of a record.
const rulePrefix = "passage-"

func RuleName(record string) string { return rulePrefix + record }

// Taints writes the DeviceTaintRule that makes the scheduler follow a record's verdict.
// A DeviceTaintRule and not taints in the slices: the slices are the node's own
// (passage-dra publishes them with the node's credentials, and its publisher puts back
// what it publishes), so a taint there could be removed by the very node it judges, and
// two writers would fight over one object; a rule is cluster-scoped, written only with
// the control plane's RBAC, selects the pool whatever slices it has, and exists before
// the node's plugin publishes anything when the node's boot posted (the Reconciler puts
// it on a pool whose node never did).
type Taints struct {
	Client kubernetes.Interface
	// Writes counts the API writes (the benchmark's figure).
	Writes func()
}

func (t *Taints) wrote() {
	if t.Writes != nil {
		t.Writes()
	}
}

// Rule is what a record's DeviceTaintRule should say: the verdict it follows (verified:
// no rule), the refused check (attestation-failed) and the reason it carries.
type Rule struct {
	Verdict, Check, Reason string
}

// RuleFor is the one function that decides a pool's rule, from its record alone (nil:
// there is none) and the newest generation the pool publishes (0: none known, as when the
// verifier judges): attestation-failed is NoExecute with the check and the verifier's
// reason whatever is published since (only a newer verified generation leaves it);
// verified is no rule unless a newer generation is published than verified; anything
// else (no record, not enrolled, unverified) is NoSchedule. The verifier applies it to
// the record it has just written, the reconciler to every published pool's record as
// the pool, its record or its rule changes, so the two never disagree about what a
// verdict means.
func RuleFor(n *Node, published int64) Rule {
	if n == nil {
		return Rule{Verdict: VerdictUnverified, Reason: fmt.Sprintf("generation %d published; no record: the node has not enrolled", published)}
	}
	switch n.Status.Verdict {
	case VerdictFailed:
		return Rule{Verdict: VerdictFailed, Check: failedCheck(n.Status.Reason), Reason: n.Status.Reason}
	case VerdictVerified:
		if published <= n.Status.Generation {
			return Rule{Verdict: VerdictVerified}
		}
		return Rule{Verdict: VerdictUnverified, Reason: fmt.Sprintf("generation %d published, generation %d verified", published, n.Status.Generation)}
	}
	if n.Status.Reason != "" {
		return Rule{Verdict: VerdictUnverified, Reason: n.Status.Reason}
	}
	return Rule{Verdict: VerdictUnverified, Reason: fmt.Sprintf("generation %d published and not attested", published)}
}

// failedCheck is the refused check an attestation-failed reason names: the verifier
// writes "generation N: <check>: <why>" (failedReason).
func failedCheck(reason string) string {
	_, rest, ok := strings.Cut(reason, ": ")
	if !ok || !strings.HasPrefix(reason, "generation ") {
		return ""
	}
	check, _, ok := strings.Cut(rest, ": ")
	if !ok {
		return ""
	}
	return check
}

// failedReason is a failed verdict's reason, naming the check so that RuleFor reads it
// back from the record: attest's refusals already begin with it.
func failedReason(gen int64, check string, err error) string {
	if s := err.Error(); strings.HasPrefix(s, check+": ") {
		return fmt.Sprintf("generation %d: %s", gen, s)
	}
	return fmt.Sprintf("generation %d: %s: %v", gen, check, err)
}

// Set makes the record's rule say r, for a verdict just written: no rule when verified
// (one delete, whatever is there), otherwise the rule read and created or updated
// unless it already says r (one read and at most one write, a conflict repeating them).
func (t *Taints) Set(ctx context.Context, record, pool string, r Rule) error {
	if r.Verdict == VerdictVerified {
		return t.Clear(ctx, record)
	}
	_, err := t.put(ctx, record, pool, r)
	return err
}

// Mend makes the record's rule say r, reading it first and writing only what differs:
// one read, and a create, update or delete when the rule is not what r says. wrote says
// whether it wrote.
func (t *Taints) Mend(ctx context.Context, record, pool string, r Rule) (wrote bool, err error) {
	if r.Verdict != VerdictVerified {
		return t.put(ctx, record, pool, r)
	}
	name := RuleName(record)
	_, err = t.Client.ResourceV1().DeviceTaintRules().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("device taint rule %s: %w", name, err)
	}
	return true, t.Clear(ctx, record)
}

// put creates or updates the record's rule to say r (not verified), unless it does.
func (t *Taints) put(ctx context.Context, record, pool string, r Rule) (wrote bool, err error) {
	rules := t.Client.ResourceV1().DeviceTaintRules()
	name := RuleName(record)
	want := ruleOf(record, pool, r)
	reason := r.Reason
	for range 3 {
		cur, err := rules.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			t.wrote()
			_, err = rules.Create(ctx, want, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				continue
			}
			if err != nil {
				return true, fmt.Errorf("device taint rule %s: create: %w", name, err)
			}
			return true, nil
		}
		if err != nil {
			return wrote, fmt.Errorf("device taint rule %s: %w", name, err)
		}
		if Says(cur, pool, r) {
			return wrote, nil
		}
		// The old timeAdded kept: the API server bumps it when the effect changes
		// (devicetaintrule's PrepareForUpdate), which a client's nil would prevent.
		added := cur.Spec.Taint.TimeAdded
		cur.Spec = want.Spec
		cur.Spec.Taint.TimeAdded = added
		if cur.Annotations == nil {
			cur.Annotations = map[string]string{}
		}
		cur.Annotations[ReasonAnnotation] = reason
		t.wrote()
		wrote = true
		_, err = rules.Update(ctx, cur, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			continue
		}
		if err != nil {
			return true, fmt.Errorf("device taint rule %s: update: %w", name, err)
		}
		return true, nil
	}
	return wrote, fmt.Errorf("device taint rule %s: conflicts on every try", name)
}

// ruleOf is the rule r (not verified) puts on pool for record.
func ruleOf(record, pool string, r Rule) *resourcev1.DeviceTaintRule {
	taint := resourcev1.DeviceTaint{Key: TaintUnverified, Effect: resourcev1.DeviceTaintEffectNoSchedule}
	if r.Verdict == VerdictFailed {
		taint = resourcev1.DeviceTaint{Key: TaintFailed, Value: labelValue(r.Check), Effect: resourcev1.DeviceTaintEffectNoExecute}
	}
	driver := resources.DriverName
	return &resourcev1.DeviceTaintRule{
		ObjectMeta: metav1.ObjectMeta{Name: RuleName(record), Annotations: map[string]string{ReasonAnnotation: r.Reason},
			Labels: map[string]string{Group + "/record": labelValue(record)}},
		Spec: resourcev1.DeviceTaintRuleSpec{
			DeviceSelector: &resourcev1.DeviceTaintSelector{Driver: &driver, Pool: &pool},
			Taint:          taint,
		},
	}
}

// Says reports whether cur, a pool's rule as read (nil: there is none), already says r:
// none for verified; otherwise its taint, its reason and a selector of exactly the pool.
func Says(cur *resourcev1.DeviceTaintRule, pool string, r Rule) bool {
	if r.Verdict == VerdictVerified || cur == nil {
		return (r.Verdict == VerdictVerified) == (cur == nil)
	}
	want := ruleOf("", pool, r).Spec
	sel := cur.Spec.DeviceSelector
	return cur.Spec.Taint.Key == want.Taint.Key && cur.Spec.Taint.Value == want.Taint.Value && cur.Spec.Taint.Effect == want.Taint.Effect &&
		cur.Annotations[ReasonAnnotation] == r.Reason && sel != nil && sel.Pool != nil && *sel.Pool == pool &&
		sel.Driver != nil && *sel.Driver == *want.DeviceSelector.Driver && sel.Device == nil
}

// Rules are the DeviceTaintRules there are, by name, read in pages of page (at most
// maxSweepPages of them): what the reconciler compares each pool's verdict with.
func (t *Taints) Rules(ctx context.Context, page int64) (map[string]*resourcev1.DeviceTaintRule, error) {
	out := map[string]*resourcev1.DeviceTaintRule{}
	opts := metav1.ListOptions{Limit: page}
	for range maxSweepPages {
		l, err := t.Client.ResourceV1().DeviceTaintRules().List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("device taint rules: %w", err)
		}
		for i := range l.Items {
			out[l.Items[i].Name] = &l.Items[i]
		}
		if opts.Continue = l.Continue; opts.Continue == "" {
			return out, nil
		}
	}
	return nil, fmt.Errorf("device taint rules: over %d pages of %d listed", maxSweepPages, page)
}

// Clear deletes the record's rule, if there is one.
func (t *Taints) Clear(ctx context.Context, record string) error {
	name := RuleName(record)
	t.wrote()
	err := t.Client.ResourceV1().DeviceTaintRules().Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("device taint rule %s: delete: %w", name, err)
	}
	return nil
}

// labelValue makes s a label value (the taint's value): lower-case alphanumerics and
// '-', at most 63, starting and ending alphanumeric.
func labelValue(s string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(s) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			if b.Len() > 0 && !strings.HasSuffix(b.String(), "-") {
				b.WriteByte('-')
			}
		}
	}
	v := b.String()
	if len(v) > 63 {
		v = v[:63]
	}
	v = strings.TrimRight(v, "-")
	if v == "" {
		v = "refused"
	}
	return v
}
