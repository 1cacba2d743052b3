package control

import (
	"context"
	"fmt"
	"strings"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/passage-boot/passage/dra/resources"
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
// the node's plugin publishes anything when the node's boot posted (Server.Reconcile puts
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

// Set makes the record's rule say verdict: NoSchedule unverified, NoExecute
// attestation-failed with the check and reason, or no rule when verified.
func (t *Taints) Set(ctx context.Context, record, pool, verdict, check, reason string) error {
	if verdict == VerdictVerified {
		return t.Clear(ctx, record)
	}
	rules := t.Client.ResourceV1().DeviceTaintRules()
	name := RuleName(record)
	taint := resourcev1.DeviceTaint{Key: TaintUnverified, Effect: resourcev1.DeviceTaintEffectNoSchedule}
	if verdict == VerdictFailed {
		taint = resourcev1.DeviceTaint{Key: TaintFailed, Value: labelValue(check), Effect: resourcev1.DeviceTaintEffectNoExecute}
	}
	driver := resources.DriverName
	want := &resourcev1.DeviceTaintRule{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{ReasonAnnotation: reason},
			Labels: map[string]string{Group + "/record": labelValue(record)}},
		Spec: resourcev1.DeviceTaintRuleSpec{
			DeviceSelector: &resourcev1.DeviceTaintSelector{Driver: &driver, Pool: &pool},
			Taint:          taint,
		},
	}
	for range 3 {
		cur, err := rules.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			t.wrote()
			_, err = rules.Create(ctx, want, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				continue
			}
			if err != nil {
				return fmt.Errorf("device taint rule %s: create: %w", name, err)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("device taint rule %s: %w", name, err)
		}
		if cur.Spec.Taint.Key == taint.Key && cur.Spec.Taint.Value == taint.Value && cur.Spec.Taint.Effect == taint.Effect &&
			cur.Annotations[ReasonAnnotation] == reason && cur.Spec.DeviceSelector != nil && cur.Spec.DeviceSelector.Pool != nil && *cur.Spec.DeviceSelector.Pool == pool {
			return nil
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
		_, err = rules.Update(ctx, cur, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			continue
		}
		if err != nil {
			return fmt.Errorf("device taint rule %s: update: %w", name, err)
		}
		return nil
	}
	return fmt.Errorf("device taint rule %s: conflicts on every try", name)
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
