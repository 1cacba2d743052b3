package control_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/kube/dra/resources"
)

// refuseOnce makes the fake API refuse the next verb on resource with err (as an API
// server refuses a write it is not allowed, or one it had no time for); armed says
// whether it has not refused yet.
func (e *env) refuseOnce(verb, resource string, err error) (armed *atomic.Bool) {
	armed = &atomic.Bool{}
	armed.Store(true)
	e.kc.(*kubefake.Clientset).PrependReactor(verb, resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		if armed.CompareAndSwap(true, false) {
			return true, nil, err
		}
		return false, nil, nil
	})
	return armed
}

func (e *env) publishSlice(t *testing.T, name, pool string, gen int64) {
	t.Helper()
	s := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourcev1.ResourceSliceSpec{Driver: resources.DriverName, Pool: resourcev1.ResourcePool{Name: pool, Generation: gen, ResourceSliceCount: 1}}}
	if _, err := e.kc.ResourceV1().ResourceSlices().Create(context.Background(), s, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// failedRule checks that name's rule is the NoExecute of its record's failed verdict.
func (e *env) failedRule(t *testing.T, name, when string) *resourcev1.DeviceTaintRule {
	t.Helper()
	rec := e.record(t, name)
	r := e.rule(t, name)
	if rec.Status.Verdict != control.VerdictFailed || r == nil || r.Spec.Taint.Key != control.TaintFailed ||
		r.Spec.Taint.Effect != resourcev1.DeviceTaintEffectNoExecute || r.Spec.Taint.Value != "pcr-4" ||
		r.Annotations[control.ReasonAnnotation] != rec.Status.Reason {
		t.Fatalf("%s: record %s %q, rule %+v; want the failed verdict's NoExecute", when, rec.Status.Verdict, rec.Status.Reason, r)
	}
	return r
}

// TestRuleFollowsVerdict (issue #55, 7): a verdict whose rule write fails after its
// status was written is still enforced. An unapproved boot whose rule create is refused
// once: 503, the record attestation-failed and no rule; the boot's retry of the same
// attestation puts the NoExecute rule there (it is not skipped because the status
// already holds the verdict), and so does a reconcile pass with no retry. A verified
// boot whose rule delete is refused once keeps the old NoExecute until the reconcile
// pass deletes it; the verified attestation sent again deletes nothing. A pass over
// rules that say their verdicts writes nothing.
func TestRuleFollowsVerdict(t *testing.T) {
	ctx := context.Background()
	refused := apierrors.NewForbidden(resourcev1.Resource("devicetaintrules"), "passage-b300-a", errors.New("permission withdrawn"))

	t.Run("the boot retries", func(t *testing.T) {
		e := newEnv(t)
		n := e.node(t, "b300-a")
		if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
			t.Fatalf("first boot: %v, %s", err, outcome(res))
		}
		armed := e.refuseOnce("create", "devicetaintrules", refused)
		n.Reboot(unapproved(t, e.log, e.ap))
		res, err := n.Publish(ctx, e.hc, e.url, e.url)
		if err != nil || res.Status != http.StatusServiceUnavailable || armed.Load() {
			t.Fatalf("unapproved boot with the rule's create refused: %v, %s (refused: %v)", err, outcome(res), !armed.Load())
		}
		if rec, r := e.record(t, "b300-a"), e.rule(t, "b300-a"); rec.Status.Verdict != control.VerdictFailed || r != nil {
			t.Fatalf("after the refused rule write: record %s, rule %+v; want attestation-failed and no rule yet", rec.Status.Verdict, r)
		}
		st, body := e.post(t, control.AttestationType, res.Attestation)
		if st != http.StatusForbidden || !strings.Contains(body, "not approved") {
			t.Fatalf("the boot's retry: %d %s", st, body)
		}
		e.failedRule(t, "b300-a", "after the boot's retry")
		// Once mended, the same retry writes nothing.
		before := e.ruleWrites.Load()
		if st, _ := e.post(t, control.AttestationType, res.Attestation); st != http.StatusForbidden || e.ruleWrites.Load() != before {
			t.Fatalf("a retry with the rule in place: %d, %d rule writes", st, e.ruleWrites.Load()-before)
		}

	})
	// No retry: the reconciler puts it there.
	t.Run("the reconciler mends", func(t *testing.T) {
		e := newEnv(t)
		n := e.node(t, "b300-a")
		if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
			t.Fatalf("first boot: %v, %s", err, outcome(res))
		}
		e.publishSlice(t, "a-1", "b300-a", 1)
		e.refuseOnce("create", "devicetaintrules", refused)
		n.Reboot(unapproved(t, e.log, e.ap))
		if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusServiceUnavailable {
			t.Fatalf("unapproved boot with the rule's create refused: %v, %s", err, outcome(res))
		}
		if got, err := e.srv.Reconcile(ctx, 100); err != nil || got != 1 {
			t.Fatalf("reconcile: %d tainted, %v; want b300-a", got, err)
		}
		failed := e.failedRule(t, "b300-a", "after a reconcile pass")
		t.Logf("mended by the reconciler: %s=%s:%s (%s)", failed.Spec.Taint.Key, failed.Spec.Taint.Value, failed.Spec.Taint.Effect, failed.Annotations[control.ReasonAnnotation])

	})
	t.Run("a refused delete", func(t *testing.T) {
		e := newEnv(t)
		n := e.node(t, "b300-a")
		if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
			t.Fatalf("first boot: %v, %s", err, outcome(res))
		}
		e.publishSlice(t, "a-1", "b300-a", 1)
		n.Reboot(unapproved(t, e.log, e.ap))
		if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusForbidden {
			t.Fatalf("unapproved boot: %v, %s", err, outcome(res))
		}
		e.failedRule(t, "b300-a", "after the unapproved boot")
		// An approved boot whose rule delete is refused: verified, the NoExecute stays; the
		// boot's retry leaves it (anyone may send that again); the reconciler deletes it.
		armed := e.refuseOnce("delete", "devicetaintrules", refused)
		n.Reboot(e.log)
		res, err := n.Publish(ctx, e.hc, e.url, e.url)
		if err != nil || res.Status != http.StatusServiceUnavailable || armed.Load() {
			t.Fatalf("approved boot with the rule's delete refused: %v, %s", err, outcome(res))
		}
		if st, body := e.post(t, control.AttestationType, res.Attestation); st != http.StatusOK {
			t.Fatalf("the boot's retry: %d %s", st, body)
		}
		if rec := e.record(t, "b300-a"); rec.Status.Verdict != control.VerdictVerified || rec.Status.Generation != 3 || e.rule(t, "b300-a") == nil {
			t.Fatalf("after the refused delete: record %s generation %d, rule %v; want verified 3 and the old rule still there",
				rec.Status.Verdict, rec.Status.Generation, e.rule(t, "b300-a"))
		}
		if got, err := e.srv.Reconcile(ctx, 100); err != nil || got != 0 {
			t.Fatalf("reconcile: %d tainted, %v; want none", got, err)
		}
		if r := e.rule(t, "b300-a"); r != nil {
			t.Fatalf("verified at generation 3 with generation 1 published, a reconcile pass leaves %+v", r.Spec.Taint)
		}

		// A wrong rule (an unverified one left on a verified pool, a NoSchedule where the
		// verdict is NoExecute) is updated; a pass with every rule right writes nothing.
		e.publishSlice(t, "a-4", "b300-a", 4)
		if _, err := e.srv.Reconcile(ctx, 100); err != nil {
			t.Fatal(err)
		}
		if r := e.rule(t, "b300-a"); r == nil || r.Spec.Taint.Key != control.TaintUnverified || r.Annotations[control.ReasonAnnotation] != "generation 4 published, generation 3 verified" {
			t.Fatalf("generation 4 published, 3 verified: %+v", r)
		}
		before := e.ruleWrites.Load()
		if _, err := e.srv.Reconcile(ctx, 100); err != nil || e.ruleWrites.Load() != before {
			t.Fatalf("a pass with the rules right: %v, %d rule writes", err, e.ruleWrites.Load()-before)
		}
	})
}

// outcome is a publish's result without its attestation's bytes.
func outcome(res *controltest.Result) string {
	if res == nil {
		return "no result"
	}
	return fmt.Sprintf("%d enrolled=%v %q", res.Status, res.Enrolled, res.Body)
}

// TestLostRecordCreate (issue #55, 8): the record's create is made and its answer lost
// (the API server wrote it; the replica saw an error). The activation reads the record
// back and is answered as the enrolment it was, the TPM's claim kept; the same TPM
// cannot then enrol under a second name.
func TestLostRecordCreate(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	dyn := e.dyn.(*dynamicfake.FakeDynamicClient)
	var lost atomic.Int64
	dyn.PrependReactor("create", "passagenodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if lost.Add(1) != 1 {
			return false, nil, nil
		}
		if err := dyn.Tracker().Create(a.GetResource(), a.(k8stesting.CreateAction).GetObject(), ""); err != nil {
			t.Error(err)
		}
		return true, nil, errors.New("read tcp 127.0.0.1:40000->127.0.0.1:6443: read: connection reset by peer")
	})
	n := e.node(t, "b300-a")
	res, err := n.Publish(ctx, e.hc, e.url, e.url)
	if lost.Load() == 0 {
		t.Fatal("the record's create was never made")
	}
	claims, err2 := e.dyn.Resource(control.EKResource).List(ctx, metav1.ListOptions{})
	if err2 != nil {
		t.Fatal(err2)
	}
	if len(claims.Items) != 1 {
		t.Fatalf("after the lost answer (publish: %v, %s): %d EK claims, want the TPM's one", err, outcome(res), len(claims.Items))
	}
	if rec := e.record(t, "b300-a"); len(rec.Spec.EKPublic) == 0 {
		t.Fatal("the record made is not enrolled")
	}
	if err != nil || res.Status != http.StatusOK || !res.Enrolled {
		t.Fatalf("first boot with the record's answer lost: %v, %s; want enrolled and verified", err, outcome(res))
	}
	// The same TPM as another name: refused by its claim.
	n.Hostname = "b300-b"
	res, err = n.Publish(ctx, e.hc, e.url, e.url)
	if err != nil || res.Status != http.StatusForbidden || !strings.Contains(res.Body, "this TPM is enrolled as another record") {
		t.Fatalf("the TPM of b300-a enrolling as b300-b: %v, %s", err, outcome(res))
	}
	if _, err := e.srv.Store.Node(ctx, "b300-b"); !errors.Is(err, control.ErrNoRecord) {
		t.Fatalf("b300-b: %v, want no record", err)
	}
}
