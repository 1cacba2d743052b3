package control

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

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
// It is one pass over every pool, listing what it compares: the Reconciler's pass while
// its watched caches cannot be judged from (a role without watch, the API server away),
// where a pass from the caches costs the API nothing; the Reconciler judges each pool
// on its events the same way (mend).
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
		want, _, err := s.mend(ctx, pool, gen)
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
// gen; it returns that rule and whether it wrote.
func (s *Server) mend(ctx context.Context, pool string, gen int64) (want Rule, wrote bool, err error) {
	for range mendTries {
		n, err := s.Store.Node(ctx, pool)
		if errors.Is(err, ErrNoRecord) {
			n, err = nil, nil
		}
		if err != nil {
			return want, wrote, err
		}
		now := RuleFor(n, gen)
		if now == want {
			return want, wrote, nil // unchanged since the write: the rule says it
		}
		want = now
		w, err := s.Taints.Mend(ctx, pool, pool, want)
		wrote = wrote || w
		if err != nil {
			return want, wrote, err
		}
		if !w {
			return want, wrote, nil
		}
		if s.Log != nil {
			s.Log.Printf("reconcile: device taint rule %s mended to %s (%s)", RuleName(pool), want.Verdict, manifest.Printable(want.Reason))
		}
	}
	return want, wrote, fmt.Errorf("device taint rule %s: its record's verdict moved on each of %d tries", RuleName(pool), mendTries)
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

// DefaultSettle bounds the random time a replica waits before it writes a rule an
// event showed to differ from its verdict (Reconciler.Settle).
const DefaultSettle = time.Second

// What the Reconciler made of a pool: passage_control_reconcile_judgements_total's
// result label.
const (
	// JudgedFollows: the cached rule says what the cached verdict does; nothing read or
	// written.
	JudgedFollows = "follows"
	// JudgedWritten: mended, the rule created, updated or deleted.
	JudgedWritten = "written"
	// JudgedUnchanged: read by name and found as the verdict says, nothing written (the
	// other replica wrote first, or the cache was behind).
	JudgedUnchanged = "unchanged"
	// JudgedUnpublished: no slice of the pool is cached; not judged (its rule would
	// select no device).
	JudgedUnpublished = "unpublished"
	// JudgedError: the API failed; judged again with backoff.
	JudgedError = "error"
)

// judgements are the results the metrics always show.
var judgements = []string{JudgedFollows, JudgedWritten, JudgedUnchanged, JudgedUnpublished, JudgedError}

// poolIndex is the slice cache's index of passage-dra's slices by their pool.
const poolIndex = "pool"

// Reconciler is Reconcile driven by the API's events: every replica watches the slices
// passage-dra publishes (field selector spec.driver), the records (as the table of
// their verdicts Verdicts lists: verdictWatch) and the DeviceTaintRules, and any change
// to one of them queues the pool it concerns (a slice's pool, a record's name, a rule's
// name less its prefix). A worker judges a queued pool from the caches alone: the rule RuleFor says
// for its cached record and the newest generation among its cached slices, against its
// cached rule (Says). Where they agree nothing is read or written; where they differ the
// replica waits Settle, judges again from the caches, and only then mends as a pass
// does (Server.mend: the record and the rule read by name, a write where the rule still
// differs), an error judged again with backoff. A pool with no slice cached is not
// judged. So a pool published at a generation no record verified carries its rule
// within the watch's delivery, Settle and one mend of its publication (README.md, "The
// reconciler"), not within a period.
//
// Every Every the replica judges every published pool again from its caches, which
// costs the API nothing: a safety net for a judgement dropped by a bug, and a retry
// sooner than the backoff's for a pool whose mend keeps failing, never the path a
// change takes. While the caches are not listed yet or one of the watches cannot be
// made (a role without watch, the API server away), each such pass is Reconcile's
// instead (the paged LIST of the slices, records and rules), so the rules follow the
// verdicts whether or not the watches do.
//
// There is no leader: each replica judges every event, and a write is idempotent. What
// keeps two replicas from both writing on one event is Settle: each waits its own
// random time before a write and looks at its cache again after it, by when the other
// replica's write has usually reached it and nothing is left to write.
type Reconciler struct {
	Server *Server
	// Client watches the slices and the rules; Table the records' table of verdicts (as
	// Store.Table lists it) or, when nil, Dynamic the records whole (client-go's fake
	// serves no tables). None may time out under a watch (no rest.Config.Timeout). Nil
	// Client and Dynamic are the Server's (Taints.Client, Store.Client).
	Client  kubernetes.Interface
	Dynamic dynamic.Interface
	Table   rest.Interface
	// Every is how often every published pool is judged again from the caches (0: 15 s).
	Every time.Duration
	// Settle is how long the replica waits before it writes a pool's rule (nil: a random
	// time below DefaultSettle, drawn for each write).
	Settle func() time.Duration
	// Workers judge pools at once (0: 4): a judgement that agrees costs no API call, a
	// mend three or four.
	Workers int

	once                   sync.Once
	queue                  workqueue.TypedRateLimitingInterface[string]
	slices, records, rules cache.SharedIndexInformer
	mu                     sync.Mutex
	due                    map[string]time.Time // the pools settling, and until when
	broken                 map[string]error     // by informer: its last watch, or a list since, failed
	listing                bool                 // the last pass listed
}

func (r *Reconciler) every() time.Duration {
	if r.Every > 0 {
		return r.Every
	}
	return 15 * time.Second
}

func (r *Reconciler) settle() time.Duration {
	if r.Settle != nil {
		return r.Settle()
	}
	return rand.N(DefaultSettle)
}

func (r *Reconciler) init() {
	r.once.Do(func() {
		r.queue = workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "passage-reconcile"})
		r.due, r.broken = map[string]time.Time{}, map[string]error{}
		kc := r.Client
		if kc == nil {
			kc = r.Server.Taints.Client
		}
		field := "spec.driver=" + resources.DriverName
		slices := kc.ResourceV1().ResourceSlices()
		r.slices = cache.NewSharedIndexInformer(r.watched("resource slices", kc, &cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.FieldSelector = field
				return slices.List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.FieldSelector = field
				return slices.Watch(ctx, o)
			},
		}), &resourcev1.ResourceSlice{}, 0, cache.Indexers{poolIndex: indexPool})
		// A judgement reads a slice's driver and pool: its devices (most of its bytes)
		// and managed fields are dropped as it enters the cache.
		r.slices.SetTransform(func(obj any) (any, error) {
			if sl, ok := obj.(*resourcev1.ResourceSlice); ok {
				sl.ManagedFields = nil
				sl.Spec = resourcev1.ResourceSliceSpec{Driver: sl.Spec.Driver, Pool: sl.Spec.Pool}
			}
			return obj, nil
		})
		rules := kc.ResourceV1().DeviceTaintRules()
		r.rules = cache.NewSharedIndexInformer(r.watched("device taint rules", kc, &cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return rules.List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				return rules.Watch(ctx, o)
			},
		}), &resourcev1.DeviceTaintRule{}, 0, cache.Indexers{})
		r.rules.SetTransform(func(obj any) (any, error) {
			if m, err := meta.Accessor(obj); err == nil {
				m.SetManagedFields(nil)
			}
			return obj, nil
		})
		var lw cache.ListerWatcher
		if r.Table != nil {
			lw = r.watched("records", noWatchList{}, verdictWatch(r.Table))
		} else {
			dyn := r.Dynamic
			if dyn == nil {
				dyn = r.Server.Store.Client
			}
			records := dyn.Resource(NodeResource)
			lw = r.watched("records", dyn, &cache.ListWatch{
				ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
					return records.List(ctx, o)
				},
				WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
					return records.Watch(ctx, o)
				},
			})
		}
		r.records = cache.NewSharedIndexInformer(lw, &unstructured.Unstructured{}, 0, cache.Indexers{})
		// Whole records (the dynamic client's) are kept as the table's rows are: what
		// RuleFor reads.
		r.records.SetTransform(func(obj any) (any, error) {
			if u, ok := obj.(*unstructured.Unstructured); ok {
				return verdictObject(verdictOf(u), u.GetResourceVersion()), nil
			}
			return obj, nil
		})

		r.slices.AddEventHandler(r.handlerFor(slicePool))
		r.records.AddEventHandler(r.handlerFor(func(obj any) string {
			key, _ := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
			return key
		}))
		r.rules.AddEventHandler(r.handlerFor(func(obj any) string {
			key, _ := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
			pool, _ := strings.CutPrefix(key, rulePrefix)
			if pool == key {
				return "" // not passage's
			}
			return pool
		}))
		r.Server.Metrics.watchReconciler(func() (int, int) {
			r.mu.Lock()
			defer r.mu.Unlock()
			return r.queue.Len(), len(r.due)
		}, func() bool { return r.notWatching() == "" })
	})
}

// handlerFor queues the pool of each object added, changed or deleted (poolOf: "" for
// none), the old object's too when a change moved it.
func (r *Reconciler) handlerFor(poolOf func(any) string) cache.ResourceEventHandler {
	add := func(obj any) {
		if pool := poolOf(obj); pool != "" {
			r.queue.Add(pool)
		}
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    add,
		UpdateFunc: func(old, obj any) { add(old); add(obj) },
		DeleteFunc: add,
	}
}

// slicePool is the pool of one of passage-dra's slices ("" for another driver's).
func slicePool(obj any) string {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	sl, ok := obj.(*resourcev1.ResourceSlice)
	if !ok || sl.Spec.Driver != resources.DriverName {
		return ""
	}
	return sl.Spec.Pool.Name
}

func indexPool(obj any) ([]string, error) {
	if pool := slicePool(obj); pool != "" {
		return []string{pool}, nil
	}
	return nil, nil
}

// watched is lw, noting whether its last watch could be made and, failing that,
// whether its lists can: while one of the three cannot, the caches may miss a change
// for as long, and passes list (notWatching). client says whether the reflector may
// ask for a watch list (client-go's fakes cannot serve one).
func (r *Reconciler) watched(what string, client any, lw *cache.ListWatch) cache.ListerWatcher {
	list, watchf := lw.ListWithContextFunc, lw.WatchFuncWithContext
	lw.ListWithContextFunc = func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
		l, err := list(ctx, o)
		if err != nil && ctx.Err() == nil {
			r.failed(what, "list", err)
		}
		return l, err
	}
	lw.WatchFuncWithContext = func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
		w, err := watchf(ctx, o)
		if err != nil {
			if ctx.Err() == nil {
				r.failed(what, "watch", err)
			}
			return nil, err
		}
		r.mu.Lock()
		delete(r.broken, what)
		r.mu.Unlock()
		return w, nil
	}
	return cache.ToListWatcherWithWatchListSemantics(lw, client)
}

// failed notes what's list or watch failing (verb), saying so once until its watch is
// made again.
func (r *Reconciler) failed(what, verb string, err error) {
	r.mu.Lock()
	_, was := r.broken[what]
	r.broken[what] = fmt.Errorf("%s of the %s: %w", verb, what, err)
	r.mu.Unlock()
	if !was {
		r.logf("reconcile: %s of the %s: %v (tried again; meanwhile each pass lists them)", verb, what, err)
	}
}

// Synced says whether the caches have listed the slices, the records and the rules.
func (r *Reconciler) Synced() bool {
	r.init()
	return r.synced()
}

func (r *Reconciler) synced() bool {
	return r.slices.HasSynced() && r.records.HasSynced() && r.rules.HasSynced()
}

// notWatching is why the caches cannot be judged from ("": they can).
func (r *Reconciler) notWatching() string {
	if !r.synced() {
		return "the resource slices, records and device taint rules are not listed and watched yet (does the role grant list and watch on each?)"
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	for _, what := range []string{"resource slices", "records", "device taint rules"} {
		if err := r.broken[what]; err != nil {
			errs = append(errs, err)
		}
	}
	if errs != nil {
		return errors.Join(errs...).Error()
	}
	return ""
}

// Run watches and judges until ctx ends.
func (r *Reconciler) Run(ctx context.Context) {
	r.init()
	for _, inf := range []cache.SharedIndexInformer{r.slices, r.records, r.rules} {
		go inf.RunWithContext(ctx)
	}
	go func() {
		<-ctx.Done()
		r.queue.ShutDown()
	}()
	workers := r.Workers
	if workers <= 0 {
		workers = 4
	}
	var wg sync.WaitGroup
	// No pool is judged before the three caches are listed: a record not yet cached
	// would read as none, and its verified pool would be tainted.
	wg.Go(func() {
		if !cache.WaitForCacheSync(ctx.Done(), r.synced) {
			return
		}
		r.logf("reconcile: watching the resource slices of %d pools, %d records and %d device taint rules",
			len(r.slices.GetIndexer().ListIndexFuncValues(poolIndex)), len(r.records.GetIndexer().ListKeys()), len(r.rules.GetIndexer().ListKeys()))
		var ww sync.WaitGroup
		for range workers {
			ww.Go(func() {
				for r.next(ctx) {
				}
			})
		}
		ww.Wait()
	})
	tick := time.NewTicker(r.every())
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-tick.C:
			r.pass(ctx)
		}
	}
}

// pass judges every published pool again: from the caches, or, while they cannot be
// judged from, by Reconcile's LIST.
func (r *Reconciler) pass(ctx context.Context) {
	why := r.notWatching()
	r.mu.Lock()
	was := r.listing
	r.listing = why != ""
	r.mu.Unlock()
	if why != "" {
		if !was {
			r.logf("reconcile: %s: each pass lists them", why)
		}
		pctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if _, err := r.Server.Reconcile(pctx, 500); err != nil {
			r.logf("%v", err)
		}
		return
	}
	if was {
		r.logf("reconcile: watching the resource slices, records and device taint rules again: passes judge from them")
	}
	tainted := 0
	for _, pool := range r.slices.GetIndexer().ListIndexFuncValues(poolIndex) {
		gen, ok := r.published(pool)
		if !ok {
			continue
		}
		if RuleFor(r.record(pool), gen).Verdict != VerdictVerified {
			tainted++
		}
		r.queue.Add(pool)
	}
	r.Server.Metrics.reconciled(tainted, nil)
}

// published is the newest generation among pool's cached slices; ok is false when it
// has none.
func (r *Reconciler) published(pool string) (gen int64, ok bool) {
	objs, _ := r.slices.GetIndexer().ByIndex(poolIndex, pool)
	for _, o := range objs {
		if sl, is := o.(*resourcev1.ResourceSlice); is && sl.Spec.Driver == resources.DriverName {
			gen, ok = max(gen, sl.Spec.Pool.Generation), true
		}
	}
	return gen, ok
}

// record is pool's cached record (nil: none).
func (r *Reconciler) record(pool string) *Node {
	o, ok, _ := r.records.GetIndexer().GetByKey(pool)
	if u, is := o.(*unstructured.Unstructured); ok && is {
		return verdictOf(u)
	}
	return nil
}

// rule is pool's cached rule (nil: none).
func (r *Reconciler) rule(pool string) *resourcev1.DeviceTaintRule {
	o, ok, _ := r.rules.GetIndexer().GetByKey(RuleName(pool))
	if rule, is := o.(*resourcev1.DeviceTaintRule); ok && is {
		return rule
	}
	return nil
}

func (r *Reconciler) next(ctx context.Context) bool {
	pool, shut := r.queue.Get()
	if shut {
		return false
	}
	defer r.queue.Done(pool)
	ctx, cancel := context.WithTimeout(ctx, VerdictTimeout)
	defer cancel()
	result, err := r.judge(ctx, pool)
	if result != "" {
		r.Server.Metrics.judged(result)
	}
	if err != nil {
		r.logf("reconcile: pool %q: %v (tried again)", pool, err)
		r.queue.AddRateLimited(pool)
		return true
	}
	r.queue.Forget(pool)
	return true
}

// judge judges pool from the caches, mending it once it has settled; "" is a pool
// left to settle (queued again for when it has).
func (r *Reconciler) judge(ctx context.Context, pool string) (string, error) {
	gen, ok := r.published(pool)
	if !ok {
		r.settled(pool)
		return JudgedUnpublished, nil
	}
	if Says(r.rule(pool), pool, RuleFor(r.record(pool), gen)) {
		r.settled(pool)
		return JudgedFollows, nil
	}
	if wait := r.settling(pool); wait > 0 {
		r.queue.AddAfter(pool, wait)
		return "", nil
	}
	_, wrote, err := r.Server.mend(ctx, pool, gen)
	switch {
	case err != nil:
		return JudgedError, err
	case wrote:
		return JudgedWritten, nil
	}
	return JudgedUnchanged, nil
}

// settling is how long pool, found to differ from its verdict, still waits before it
// is mended: a time drawn when it is first found so (Settle), 0 once it has passed.
//
// Why: both replicas see every event, and the one that verified a boot writes its rule
// itself just after its record's status (the other sees the status first). Without the
// wait, both replicas would mend a newly published pool at once, and the verifier's
// peer would mend a judged pool beside the verifier: each such race a second read of
// the record and the rule, and a second write where both found the rule wrong before
// either wrote (a refused create, a delete of nothing). After the wait the rule written
// meanwhile is in the cache, and the pool costs nothing more. Two draws of a uniform
// wait fall within w of each other with a probability of about 2w/DefaultSettle: a
// second read where w is one mend and its watch event (tens of milliseconds, more under
// load), a second write only where w is the time from one replica's read of the rule to
// its write landing (one of 80 pools on the 2-core machine, README.md). A longer wait
// makes both rarer and the bound longer. What it costs: a pool that needs a rule waits
// up to DefaultSettle longer for it, a third of a second on average with two replicas.
func (r *Reconciler) settling(pool string) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	until, ok := r.due[pool]
	if !ok {
		until = now.Add(r.settle())
		r.due[pool] = until
	}
	if now.Before(until) {
		return until.Sub(now)
	}
	delete(r.due, pool)
	return 0
}

func (r *Reconciler) settled(pool string) {
	r.mu.Lock()
	delete(r.due, pool)
	r.mu.Unlock()
}

func (r *Reconciler) logf(format string, args ...any) {
	if r.Server.Log != nil {
		r.Server.Log.Printf(format, args...)
	}
}
