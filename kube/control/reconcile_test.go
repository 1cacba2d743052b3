package control_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"strings"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/dra/resources"
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

// TestReconcilePassCost: a pass over pools whose rules already follow their verdicts
// reads the slices, the records and the rules in pages and nothing by name, whatever
// the number of pools; a pool whose rule went missing is then read and mended by name
// alone. Where the lists are refused (a role without list), every pool is mended by
// name and the rule still follows the verdict.
func TestReconcilePassCost(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const pools = 12
	for i := range pools {
		pool := fmt.Sprintf("ghost-%02d", i)
		s := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: pool},
			Spec: resourcev1.ResourceSliceSpec{Driver: resources.DriverName, Pool: resourcev1.ResourcePool{Name: pool, Generation: 1, ResourceSliceCount: 1}}}
		if _, err := e.kc.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := e.srv.Reconcile(ctx, 5); err != nil || got != pools {
		t.Fatalf("first pass: %d tainted, %v; want %d", got, err, pools)
	}
	kc := e.kc.(*kubefake.Clientset)
	dyn := e.dyn.(*dynamicfake.FakeDynamicClient)
	calls := func() map[string]int {
		out := map[string]int{}
		for _, a := range append(kc.Actions(), dyn.Actions()...) {
			out[a.GetVerb()+" "+a.GetResource().Resource]++
		}
		return out
	}
	pass := func(page int64) map[string]int {
		t.Helper()
		kc.ClearActions()
		dyn.ClearActions()
		if got, err := e.srv.Reconcile(ctx, page); err != nil || got != pools {
			t.Fatalf("pass: %d tainted, %v; want %d", got, err, pools)
		}
		return calls()
	}
	// The fake API answers a list whole (it keeps no pages): one LIST each.
	want := map[string]int{"list resourceslices": 1, "list passagenodes": 1, "list devicetaintrules": 1}
	if got := pass(5); !maps.Equal(got, want) {
		t.Fatalf("a pass with every rule as its verdict says: %v, want %v", got, want)
	}
	// One rule deleted behind its back: that pool alone is read and mended by name.
	if err := e.srv.Taints.Clear(ctx, "ghost-07"); err != nil {
		t.Fatal(err)
	}
	want = map[string]int{"list resourceslices": 1, "list passagenodes": 1, "list devicetaintrules": 1,
		"get passagenodes": 2, "get devicetaintrules": 1, "create devicetaintrules": 1}
	if got := pass(5); !maps.Equal(got, want) {
		t.Fatalf("a pass with one rule missing: %v, want %v", got, want)
	}
	if e.rule(t, "ghost-07") == nil {
		t.Fatal("ghost-07's rule not mended")
	}
	// The lists refused: each pool by name, and the missing rule still comes back.
	forbidden := func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(a.GetResource().GroupResource(), "", errors.New("no list"))
	}
	kc.PrependReactor("list", "devicetaintrules", forbidden)
	if err := e.srv.Taints.Clear(ctx, "ghost-03"); err != nil {
		t.Fatal(err)
	}
	kc.ClearActions()
	dyn.ClearActions()
	got, err := e.srv.Reconcile(ctx, 5)
	if err == nil || !strings.Contains(err.Error(), "each pool read by name") || got != pools {
		t.Fatalf("lists refused: %d tainted, %v", got, err)
	}
	// Each pool's record and rule by name, and the mended pool's record read again.
	if c := calls(); c["get passagenodes"] != pools+1 || c["get devicetaintrules"] != pools || c["create devicetaintrules"] != 1 {
		t.Fatalf("lists refused: %v, want each pool's record and rule read by name", c)
	}
	if e.rule(t, "ghost-03") == nil {
		t.Fatal("lists refused: ghost-03's rule not mended")
	}
}
