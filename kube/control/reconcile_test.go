package control_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
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

// replica runs a Reconciler on e's fake API as one more replica would (its own Server
// value and metrics over the same API and store) until the test ends: every is its
// period, settle its wait before a write.
func (e *env) replica(t *testing.T, name string, every, settle time.Duration) (*control.Reconciler, *control.Metrics) {
	t.Helper()
	srv := *e.srv
	srv.Metrics = control.NewMetrics()
	srv.Log = log.New(testLog{t}, name+": ", 0)
	r := &control.Reconciler{Server: &srv, Every: every, Settle: func() time.Duration { return settle }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	waitUntil(t, 10*time.Second, name+"'s caches", r.Synced)
	return r, srv.Metrics
}

// setVerdict writes record name's status as the verifier would, creating the record
// first if there is none.
func (e *env) setVerdict(t *testing.T, name, verdict string, gen int64, reason string) {
	t.Helper()
	ctx := context.Background()
	n, err := e.srv.Store.Node(ctx, name)
	if errors.Is(err, control.ErrNoRecord) {
		n, err = e.srv.Store.Create(ctx, &control.Node{Name: name, Spec: control.NodeSpec{Node: name}})
	}
	if err != nil {
		t.Fatal(err)
	}
	n.Status.Verdict, n.Status.Generation, n.Status.Reason = verdict, gen, reason
	if _, err := e.srv.Store.UpdateStatus(ctx, n); err != nil {
		t.Fatal(err)
	}
}

// metric is the value of one series of m's exposition (e.g.
// `passage_control_reconcile_judgements_total{result="written"}`).
func metric(t *testing.T, m *control.Metrics, series string) float64 {
	t.Helper()
	var b bytes.Buffer
	if err := m.Write(&b); err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(b.String(), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no series %s in:\n%s", series, b.String())
	return 0
}

func judged(t *testing.T, m *control.Metrics, result string) float64 {
	t.Helper()
	return metric(t, m, `passage_control_reconcile_judgements_total{result="`+result+`"}`)
}

// calls are the API calls made on the fake API since it was last cleared, "verb
// resource", less those in skip.
func (e *env) calls(skip ...string) map[string]int {
	out := map[string]int{}
	for _, a := range append(e.kc.(*kubefake.Clientset).Actions(), e.dyn.(*dynamicfake.FakeDynamicClient).Actions()...) {
		c := a.GetVerb() + " " + a.GetResource().Resource
		if a.GetSubresource() != "" {
			c += "/" + a.GetSubresource()
		}
		if !slices.Contains(skip, c) {
			out[c]++
		}
	}
	return out
}

// ruleNow is pool's rule as the fake API holds it, read without a call (nil: none).
func (e *env) ruleNow(t *testing.T, pool string) *resourcev1.DeviceTaintRule {
	t.Helper()
	o, err := e.kc.(*kubefake.Clientset).Tracker().Get(resourcev1.SchemeGroupVersion.WithResource("devicetaintrules"), "", control.RuleName(pool))
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return o.(*resourcev1.DeviceTaintRule)
}

func (e *env) clearCalls() {
	e.kc.(*kubefake.Clientset).ClearActions()
	e.dyn.(*dynamicfake.FakeDynamicClient).ClearActions()
}

// TestReconcilerEvent: a pool published at a generation no record verified gets its
// rule from the slice's event, with no pass (the period is an hour): the record and the
// rule read by name and the rule created, nothing listed. Another driver's slice is not
// judged.
func TestReconcilerEvent(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	_, m := e.replica(t, "replica", time.Hour, 0)
	e.clearCalls()
	other := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "other"},
		Spec: resourcev1.ResourceSliceSpec{Driver: "gpu.example.com", Pool: resourcev1.ResourcePool{Name: "elsewhere", Generation: 1, ResourceSliceCount: 1}}}
	if _, err := e.kc.ResourceV1().ResourceSlices().Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.publishSlice(t, "ghost-3", "ghost", 3)
	// The mend is done when it is counted (after the record's second read).
	waitUntil(t, 10*time.Second, "the ghost's rule", func() bool {
		return e.ruleNow(t, "ghost") != nil && judged(t, m, control.JudgedWritten) >= 1
	})
	r := e.ruleNow(t, "ghost")
	if r.Spec.Taint.Key != control.TaintUnverified || r.Spec.Taint.Effect != resourcev1.DeviceTaintEffectNoSchedule ||
		r.Annotations[control.ReasonAnnotation] != "generation 3 published; no record: the node has not enrolled" {
		t.Fatalf("the pool nobody posted for: %s=%s (%s)", r.Spec.Taint.Key, r.Spec.Taint.Effect, r.Annotations[control.ReasonAnnotation])
	}
	if e.ruleNow(t, "elsewhere") != nil {
		t.Fatal("another driver's pool judged")
	}
	// The record read again after the write (mend): a verdict landing meanwhile.
	want := map[string]int{"get passagenodes": 2, "get devicetaintrules": 1, "create devicetaintrules": 1}
	if got := e.calls("create resourceslices"); !maps.Equal(got, want) {
		t.Errorf("the event cost %v, want %v", got, want)
	}
	if p := metric(t, m, `passage_control_reconcile_passes_total{result="ok"}`) + metric(t, m, `passage_control_reconcile_passes_total{result="error"}`); p != 0 {
		t.Errorf("%v passes ran; the rule is the event's", p)
	}
	if w := judged(t, m, control.JudgedWritten); w != 1 {
		t.Errorf("%v judgements written, want 1", w)
	}
}

// TestReconcilerFollows: pools whose rules already follow their verdicts cost nothing,
// on an event or a pass: a verified pool with no rule, a ghost pool with its rule. Their
// slices and records change (events) and passes run every 50 ms, all judged from the
// caches: no read, no write, no list.
func TestReconcilerFollows(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.setVerdict(t, "b300-a", control.VerdictVerified, 1, "")
	e.publishSlice(t, "a-1", "b300-a", 1)
	e.publishSlice(t, "ghost-2", "ghost", 2)
	if err := e.srv.Taints.Set(ctx, "ghost", "ghost", control.RuleFor(nil, 2)); err != nil {
		t.Fatal(err)
	}
	_, m := e.replica(t, "replica", 50*time.Millisecond, 0)
	waitUntil(t, 10*time.Second, "the pools judged", func() bool { return judged(t, m, control.JudgedFollows) >= 2 })
	e.clearCalls()
	passes := metric(t, m, `passage_control_reconcile_passes_total{result="ok"}`)
	follows := judged(t, m, control.JudgedFollows)
	// Events: each slice relabelled, the record's status written again as it was.
	for _, name := range []string{"a-1", "ghost-2"} {
		s, err := e.kc.ResourceV1().ResourceSlices().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		s.Labels = map[string]string{"touched": "yes"}
		if _, err := e.kc.ResourceV1().ResourceSlices().Update(ctx, s, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	e.setVerdict(t, "b300-a", control.VerdictVerified, 1, "")
	waitUntil(t, 10*time.Second, "three events and three passes judged", func() bool {
		return judged(t, m, control.JudgedFollows) >= follows+3+2*3 &&
			metric(t, m, `passage_control_reconcile_passes_total{result="ok"}`) >= passes+3
	})
	theirs := []string{"get resourceslices", "update resourceslices", "get passagenodes", "update passagenodes/status"}
	if got := e.calls(theirs...); len(got) != 0 {
		t.Errorf("pools that follow their verdicts cost %v, want nothing", got)
	}
	for _, r := range []string{control.JudgedWritten, control.JudgedUnchanged, control.JudgedError} {
		if n := judged(t, m, r); n != 0 {
			t.Errorf("%v judgements %s, want none", n, r)
		}
	}
	if w := metric(t, m, "passage_control_reconcile_watching"); w != 1 {
		t.Errorf("passage_control_reconcile_watching %v, want 1", w)
	}
	if tainted := metric(t, m, "passage_control_reconcile_tainted_pools"); tainted != 1 {
		t.Errorf("passage_control_reconcile_tainted_pools %v, want 1 (the ghost)", tainted)
	}
}

// TestReconcilerVerdictChange: a change of verdict (the record's status written) judges
// its pool again, with no pass: generation 2 published and 1 verified is NoSchedule;
// generation 2 verified deletes the rule; attestation-failed makes it NoExecute.
func TestReconcilerVerdictChange(t *testing.T) {
	e := newEnv(t)
	e.setVerdict(t, "b300-a", control.VerdictVerified, 1, "")
	e.publishSlice(t, "a-1", "b300-a", 1)
	e.publishSlice(t, "a-2", "b300-a", 2)
	_, m := e.replica(t, "replica", time.Hour, 0)
	waitUntil(t, 10*time.Second, "the unverified rule", func() bool {
		r := e.ruleNow(t, "b300-a")
		return r != nil && r.Annotations[control.ReasonAnnotation] == "generation 2 published, generation 1 verified"
	})
	e.setVerdict(t, "b300-a", control.VerdictVerified, 2, "")
	waitUntil(t, 10*time.Second, "the rule deleted once generation 2 is verified", func() bool { return e.ruleNow(t, "b300-a") == nil })
	reason := "generation 3: pcr-4: not an approved boot"
	e.setVerdict(t, "b300-a", control.VerdictFailed, 3, reason)
	waitUntil(t, 10*time.Second, "the NoExecute rule", func() bool {
		r := e.ruleNow(t, "b300-a")
		return r != nil && r.Spec.Taint.Key == control.TaintFailed && r.Spec.Taint.Value == "pcr-4" &&
			r.Spec.Taint.Effect == resourcev1.DeviceTaintEffectNoExecute && r.Annotations[control.ReasonAnnotation] == reason &&
			judged(t, m, control.JudgedWritten) >= 3
	})
	if p := metric(t, m, `passage_control_reconcile_passes_total{result="ok"}`); p != 0 {
		t.Errorf("%v passes ran; the rules are the events'", p)
	}
	if w := judged(t, m, control.JudgedWritten); w != 3 {
		t.Errorf("%v judgements written, want 3 (create, delete, update)", w)
	}
}

// TestReconcilerRetry: a mend the API refuses is judged again with backoff, with no
// pass, until the rule is there.
func TestReconcilerRetry(t *testing.T) {
	e := newEnv(t)
	_, m := e.replica(t, "replica", time.Hour, 0)
	armed := e.refuseOnce("create", "devicetaintrules", apierrors.NewServiceUnavailable("etcd away"))
	e.publishSlice(t, "ghost-1", "ghost", 1)
	waitUntil(t, 10*time.Second, "the ghost's rule, after the refusal", func() bool {
		return e.ruleNow(t, "ghost") != nil && judged(t, m, control.JudgedWritten) >= 1
	})
	if armed.Load() {
		t.Fatal("the create was never refused")
	}
	if n, w := judged(t, m, control.JudgedError), judged(t, m, control.JudgedWritten); n != 1 || w != 1 {
		t.Errorf("judgements: %v error, %v written; want 1 and 1", n, w)
	}
}

// TestReconcilerReplicas: two replicas see the same event; the one whose wait ends
// first writes the rule, and the other, looking at its cache after its own wait, finds
// it there: one write in all, nothing more read.
func TestReconcilerReplicas(t *testing.T) {
	e := newEnv(t)
	_, m1 := e.replica(t, "replica 1", time.Hour, 0)
	// Replica 2's wait is long enough for replica 1's five writes on a loaded machine.
	_, m2 := e.replica(t, "replica 2", time.Hour, 2*time.Second)
	// Replica 1's creates take 50 ms: replica 2 judges each pool before its rule is
	// there, and waits.
	e.kc.(*kubefake.Clientset).PrependReactor("create", "devicetaintrules", func(k8stesting.Action) (bool, runtime.Object, error) {
		time.Sleep(50 * time.Millisecond)
		return false, nil, nil
	})
	e.clearCalls()
	const pools = 5
	published := time.Now()
	for i := range pools {
		e.publishSlice(t, fmt.Sprintf("ghost-%d", i), fmt.Sprintf("ghost-%d", i), 1)
	}
	waitUntil(t, 10*time.Second, "the rules", func() bool {
		for i := range pools {
			if e.ruleNow(t, fmt.Sprintf("ghost-%d", i)) == nil {
				return false
			}
		}
		return true
	})
	waitUntil(t, 10*time.Second, "replica 1's writes, replica 2's judgements after its wait", func() bool {
		return time.Since(published) > 2*time.Second && judged(t, m1, control.JudgedWritten) >= pools &&
			metric(t, m2, "passage_control_reconcile_settling_pools") == 0
	})
	if got := e.calls("create resourceslices"); got["create devicetaintrules"] != pools || got["get devicetaintrules"] != pools {
		t.Errorf("two replicas on %d pools: %v; want one read and one create of each rule", pools, got)
	}
	if w1, w2 := judged(t, m1, control.JudgedWritten), judged(t, m2, control.JudgedWritten)+judged(t, m2, control.JudgedUnchanged); w1 != pools || w2 != 0 {
		t.Errorf("replica 1 wrote %v, replica 2 mended %v; want %d and 0", w1, w2, pools)
	}
}

// TestReconcilerLists: a replica whose role does not let it watch the slices (an old
// role) has no cache to judge from: each pass lists, as Reconcile does, and the rule
// still follows the verdict.
func TestReconcilerLists(t *testing.T) {
	e := newEnv(t)
	e.kc.(*kubefake.Clientset).PrependWatchReactor("resourceslices", func(a k8stesting.Action) (bool, watch.Interface, error) {
		return true, nil, apierrors.NewForbidden(a.GetResource().GroupResource(), "", errors.New("no watch"))
	})
	srv := *e.srv
	srv.Metrics = control.NewMetrics()
	var logged bytes.Buffer
	var mu sync.Mutex
	srv.Log = log.New(writerFunc(func(b []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return logged.Write(b) }), "", 0)
	r := &control.Reconciler{Server: &srv, Every: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	e.publishSlice(t, "ghost-1", "ghost", 1)
	waitUntil(t, 10*time.Second, "the ghost's rule from a listing pass", func() bool { return e.ruleNow(t, "ghost") != nil })
	if w := metric(t, srv.Metrics, "passage_control_reconcile_watching"); w != 0 {
		t.Errorf("passage_control_reconcile_watching %v, want 0", w)
	}
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(logged.String(), "watch of the resource slices: ") || !strings.Contains(logged.String(), "each pass lists them") {
		t.Errorf("the log does not say why each pass lists:\n%s", logged.String())
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }
