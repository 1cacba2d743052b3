package control_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/dra/control"
	"github.com/passage-boot/passage/dra/resources"
)

// TestReconcile: the pools passage-dra publishes are tainted unless their record has
// verified the generation they carry. A pool no boot ever posted for gets the
// NoSchedule rule naming that; a verified one at its generation gets none; a newer
// generation published than verified gets the rule naming both; another driver's pool
// is not looked at; and a verification that lands while the rule is being written
// leaves no rule behind.
func TestReconcile(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	n := e.node(t, "b300-a")
	if res, err := n.Publish(ctx, e.hc, e.url, e.url); err != nil || res.Status != http.StatusOK {
		t.Fatalf("publish: %v %+v", err, res)
	}
	slice := func(name, driver, pool string, gen int64) {
		t.Helper()
		s := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourcev1.ResourceSliceSpec{Driver: driver, Pool: resourcev1.ResourcePool{Name: pool, Generation: gen, ResourceSliceCount: 1}}}
		if _, err := e.kc.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	slice("a-1", resources.DriverName, "b300-a", 1)
	slice("ghost-3", resources.DriverName, "ghost", 3)
	slice("other", "gpu.example.com", "elsewhere", 1)

	got, err := e.srv.Reconcile(ctx, 100)
	if err != nil || got != 1 {
		t.Fatalf("reconcile: %d tainted, %v; want the ghost's pool only", got, err)
	}
	if r := e.rule(t, "b300-a"); r != nil {
		t.Errorf("verified at its generation, yet tainted: %+v", r.Spec.Taint)
	}
	if r := e.rule(t, "elsewhere"); r != nil {
		t.Errorf("another driver's pool tainted: %+v", r.Spec.Taint)
	}
	r := e.rule(t, "ghost")
	if r == nil || r.Spec.Taint.Key != control.TaintUnverified || r.Spec.Taint.Effect != resourcev1.DeviceTaintEffectNoSchedule ||
		*r.Spec.DeviceSelector.Pool != "ghost" || !strings.Contains(r.Annotations[control.ReasonAnnotation], "no record: the node has not enrolled") {
		t.Fatalf("the pool nobody posted for: %+v", r)
	}

	// A newer generation published than verified: tainted, naming both.
	slice("a-2", resources.DriverName, "b300-a", 2)
	if _, err := e.srv.Reconcile(ctx, 100); err != nil {
		t.Fatal(err)
	}
	r = e.rule(t, "b300-a")
	if r == nil || r.Spec.Taint.Key != control.TaintUnverified || r.Annotations[control.ReasonAnnotation] != "generation 2 published, generation 1 verified" {
		t.Fatalf("generation 2 published, 1 verified: %+v", r)
	}
	// Reconciling again writes nothing.
	before := e.ruleWrites.Load()
	if _, err := e.srv.Reconcile(ctx, 100); err != nil || e.ruleWrites.Load() != before {
		t.Fatalf("a second reconcile: %v, %d rule writes", err, e.ruleWrites.Load()-before)
	}

	// The verifier lands between the reconcile's read and its write: it records
	// generation 3 verified and clears the rule just before the reconcile creates it.
	if err := e.srv.Taints.Clear(ctx, "b300-a"); err != nil {
		t.Fatal(err)
	}
	slice("a-3", resources.DriverName, "b300-a", 3)
	e.kc.(*kubefake.Clientset).PrependReactor("create", "devicetaintrules", func(a k8stesting.Action) (bool, runtime.Object, error) {
		rec, err := e.srv.Store.Node(ctx, "b300-a")
		if err != nil || rec.Status.Generation == 3 {
			return false, nil, err
		}
		rec.Status.Generation = 3
		_, err = e.srv.Store.UpdateStatus(ctx, rec)
		return false, nil, err
	})
	if _, err := e.srv.Reconcile(ctx, 100); err != nil {
		t.Fatal(err)
	}
	if r := e.rule(t, "b300-a"); r != nil {
		t.Fatalf("verified while the rule was written, the rule stays: %+v", r.Annotations)
	}
}
