//go:build cluster

package harness_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport/linuxudstpm"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/harness"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/kube/internal/simnode"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/recycle"
)

// tenantBlock is what a tenant leaves on its unit's NVMe, in the namespace's first and
// last block: the turnaround must erase it before anyone else is given the unit.
var tenantBlock = bytes.Repeat([]byte("TENANT-A-SECRET!"), simnode.BlockSize/16)

const lastLBA = 1<<16 - 1 // simnode's namespace's last block

// turnEnv is one node, b300-a, whose passage-dra process (built with -tags passagesim:
// vfiotest's kernel and simnode's NVMe controllers beneath its --root, a swtpm its TPM)
// turns released units around against a passage-control replica on the real control
// plane, the test playing the node's kubelet.
type turnEnv struct {
	c        *harness.Cluster
	api      *kubernetes.Clientset
	dyn      dynamic.Interface
	rig      *noderig.Rig
	n        *node
	k        *kubelet
	bin      string
	args     []string
	src      resources.Source
	template string
	sock     string // the swtpm's socket
	metrics  string // the plugin's --metrics-file
	pods     int    // pods made so far (their names)
}

func newTurnEnv(t testing.TB, ctx context.Context) *turnEnv {
	t.Helper()
	work := t.TempDir()
	ctlBin := goBuild(t, work, "passage-control")
	// The build tag reaches goBuild's go build through GOFLAGS.
	t.Setenv("GOFLAGS", "-tags=passagesim")
	draBin := goBuild(t, work, "passage-dra")
	e := &turnEnv{bin: draBin}
	e.c = startCluster(t, ctx, work)
	e.api = e.c.Client
	e.dyn = dynamic.NewForConfigOrDie(restConfig(t, e.c))
	createNamespace(t, ctx, e.api)
	applyCRDs(t, ctx, e.c)
	ctlConfig := filepath.Join(work, "passage-control.kubeconfig")
	deployControlRBAC(t, ctx, e.c, ctlConfig)
	pluginConfig := filepath.Join(work, "passage-dra.kubeconfig")
	deployRBAC(t, ctx, e.c, pluginConfig)

	fw, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	keys := filepath.Join(work, "keys")
	e.rig = noderig.New(t, manifesttest.NodeUUID(1), "b300-a", 1, keys)
	ca, sock := e.rig.ForTurnaround(t, fw)
	e.sock = sock
	// The boot's manifest measured into PCR 13 by its TPM, as a boot writes it: the
	// plugin attests it when it starts, and only a verified boot's pool is offered (the
	// reconciler's watch puts the unverified rule on it within a second otherwise).
	bootMeasured(t, e.rig, recycle.Keys{SigningKey: "/etc/passage/key", Dir: "/run/passage", TPM: "on"})
	e.src = resources.Source{Keys: keys, NodeUUID: e.rig.M.Node.DMIUUID}
	replicaFiles(t, work, ca.PEM(t))
	r := startReplica(t, ctx, ctlBin, ctlConfig, work, 1)

	addNode(t, ctx, e.api, "b300-a")
	e.n = &node{name: "b300-a", rig: e.rig, dir: filepath.Join(work, "b300-a")}
	e.metrics = filepath.Join(e.n.dir, "metrics", "passage-dra.prom")
	os.MkdirAll(filepath.Dir(e.metrics), 0o755)
	e.args = []string{"plugin", "--pub", keys, "--manifest", e.rig.Path, "--root", e.rig.Root, "--cdi-dir", e.n.cdi(),
		"--registry-dir", filepath.Join(e.n.dir, "registry"), "--plugin-dir", e.n.plugin(), "--kubeconfig", pluginConfig,
		"--reload", "1s", "--metrics-file", e.metrics,
		"--passage-url", r.url, "--passage-ca", filepath.Join(work, "tls.crt"), "--tpm", "on",
		"--recycle-tries", "2", "--recycle-backoff", "200ms", "--recycle-poll", "100ms"}
	e.n.run(t, e.bin, e.args...)

	v, err := resources.Verify(e.rig.Path, e.src)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := resources.Render(v, resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.api.ResourceV1().DeviceClasses().Create(ctx, objs.Class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, tmpl := range objs.Templates {
		if _, err := e.api.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	e.template = objs.Shapes[0].TemplateName()
	waitFor(t, ctx, 60*time.Second, "b300-a's 32 devices published", func() (bool, string) {
		n := len(pools(t, ctx, e.api)["b300-a"])
		return n == 32, fmt.Sprint(n)
	})
	waitFor(t, ctx, 60*time.Second, "b300-a's boot verified", func() (bool, string) {
		u, err := e.dyn.Resource(control.NodeResource).Get(ctx, "b300-a", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		verdict, _, _ := unstructured.NestedString(u.Object, "status", "verdict")
		return verdict == control.VerdictVerified, verdict
	})
	e.k = kubeletOf(t, ctx, e.n)
	return e
}

// newPods creates n pods, each claiming a unit from the template.
func (e *turnEnv) newPods(t testing.TB, ctx context.Context, n int) []string {
	t.Helper()
	var out []string
	for range n {
		name := fmt.Sprintf("vm-%d", e.pods)
		e.pods++
		createPod(t, ctx, e.api, name, "", e.template)
		out = append(out, name)
	}
	return out
}

// bound waits until every pod is bound, prepares each one's claim as the kubelet does,
// and returns each pod's unit.
func (e *turnEnv) bound(t testing.TB, ctx context.Context, pods []string) map[string]string {
	t.Helper()
	waitFor(t, ctx, 90*time.Second, fmt.Sprintf("%v bound", pods), func() (bool, string) {
		for _, name := range pods {
			if p, err := e.api.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{}); err != nil || p.Spec.NodeName == "" {
				return false, name + " not bound"
			}
		}
		return true, ""
	})
	out := map[string]string{}
	for _, name := range pods {
		cl := podClaim(t, ctx, e.api, name)
		_, unit := wholeUnit(t, cl, map[string]*noderig.Rig{"b300-a": e.rig}, "")
		if r := prepare(t, ctx, e.k, cl); r.Error != "" {
			t.Fatalf("prepare %s (%s): %s", cl.Name, unit, r.Error)
		}
		out[name] = unit
	}
	return out
}

// release is the kubelet's part when pods holding units are deleted: the pod is deleted
// (gracefully: it stays, terminating), the kubelet unprepares its claim, then removes
// the pod. w is told first, with the claim that held each unit.
func (e *turnEnv) release(t testing.TB, ctx context.Context, w *offerWatch, pods []string) {
	t.Helper()
	var claims []*resourceapi.ResourceClaim
	for _, name := range pods {
		cl := podClaim(t, ctx, e.api, name)
		_, unit := wholeUnit(t, cl, map[string]*noderig.Rig{"b300-a": e.rig}, "")
		w.release(unit, cl.UID, e.generation(t))
		claims = append(claims, cl)
	}
	for _, name := range pods {
		if err := e.api.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	req := &drapb.NodeUnprepareResourcesRequest{}
	for _, cl := range claims {
		req.Claims = append(req.Claims, &drapb.Claim{Namespace: ns, Name: cl.Name, Uid: string(cl.UID)})
	}
	resp, err := e.k.dra.NodeUnprepareResources(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for _, cl := range claims {
		if r := resp.Claims[string(cl.UID)]; r == nil || r.Error != "" {
			t.Fatalf("unprepare %s: %+v", cl.Name, r)
		}
	}
	for _, name := range pods {
		forceDelete(t, ctx, e.api, name)
	}
}

func (e *turnEnv) unitIndex(unit string) int { return unitIndex(e.rig, unit) }

func (e *turnEnv) nvme(unit string) pci.Address {
	return e.rig.Tree.Addr(noderig.UnitNames(e.unitIndex(unit))[3])
}

// dirty writes (write) or reads back (!write) the tenant's blocks on the unit's NVMe;
// it says whether they hold the tenant's data.
func (e *turnEnv) tenant(t testing.TB, unit string, write bool) bool {
	t.Helper()
	for _, lba := range []uint64{0, lastLBA} {
		if write {
			if err := simnode.Write(e.rig.Root, e.nvme(unit), lba, tenantBlock); err != nil {
				t.Fatal(err)
			}
			continue
		}
		b, err := simnode.Read(context.Background(), e.rig.Root, e.nvme(unit), lba)
		if err != nil {
			t.Fatalf("read back %s's NVMe block %d: %v", unit, lba, err)
		}
		if bytes.Equal(b, tenantBlock) {
			return true
		}
	}
	return write
}

// generation is the node's manifest's generation now.
func (e *turnEnv) generation(t testing.TB) uint64 {
	t.Helper()
	v, err := resources.Verify(e.rig.Path, e.src)
	if err != nil {
		t.Fatal(err)
	}
	return v.Manifest.Generation
}

// record is the control plane's record of the node: its verdict and generation.
func (e *turnEnv) record(ctx context.Context) (string, uint64, error) {
	u, err := e.dyn.Resource(control.NodeResource).Get(ctx, "b300-a", metav1.GetOptions{})
	if err != nil {
		return "", 0, err
	}
	st, _ := u.Object["status"].(map[string]any)
	verdict, _ := st["verdict"].(string)
	var gen uint64
	switch g := st["generation"].(type) {
	case int64:
		gen = uint64(g)
	case float64:
		gen = uint64(g)
	}
	return verdict, gen, nil
}

// units is the plugin's units.json: the released units by state.
func (e *turnEnv) units() (map[string]plugin.UnitState, error) {
	var f struct {
		Units map[string]plugin.UnitState `json:"units"`
	}
	b, err := os.ReadFile(filepath.Join(e.n.plugin(), "units.json"))
	if err != nil {
		return nil, err
	}
	return f.Units, json.Unmarshal(b, &f)
}

// offerWatch watches the node's slices and the tenant's claims through the API (watches,
// from before the first release to the end) and judges every event that offers a
// released unit again (its devices untainted in the pool's newest slices after they had
// left them) or allocates it (to a claim other than the one that held it): at that
// moment the unit's NVMe must read back without the tenant's data, the control plane's
// record must have accepted the attestation of a generation at least two past the one
// the unit was released under (the recycle's not-ready and ready ones), and the plugin's
// units.json must no longer list it. What it cannot rule out: a state that was wrong at the event and
// right by the time the test read it.
type offerWatch struct {
	e        *turnEnv
	mu       sync.Mutex
	released map[string]*releasedUnit
	slices   map[string]*resourceapi.ResourceSlice
	problems []string
	trace    []string // what the slice events offered, for a failure's message
	stop     context.CancelFunc
	done     sync.WaitGroup
}

type releasedUnit struct {
	gen                uint64
	holder             types.UID
	at                 time.Time // the release (the pod's deletion)
	withdrawn          bool      // seen out of the slices
	offered, allocated time.Time
	allocatedTo        string // the claim it was allocated to
}

func (e *turnEnv) watchOffers(t testing.TB, ctx context.Context) *offerWatch {
	t.Helper()
	w := &offerWatch{e: e, released: map[string]*releasedUnit{}, slices: map[string]*resourceapi.ResourceSlice{}}
	ctx, w.stop = context.WithCancel(ctx)
	sw, err := e.api.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cw, err := e.api.ResourceV1().ResourceClaims(ns).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, wi := range []watch.Interface{sw, cw} {
		w.done.Go(func() {
			defer wi.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case ev, ok := <-wi.ResultChan():
					if !ok {
						if ctx.Err() == nil {
							w.problem("a watch ended before the test did")
						}
						return
					}
					w.event(ctx, ev)
				}
			}
		})
	}
	t.Cleanup(w.close)
	return w
}

func (w *offerWatch) close() {
	w.stop()
	w.done.Wait()
}

func (w *offerWatch) problem(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.problems = append(w.problems, fmt.Sprintf(format, args...))
}

// release tells w the unit is being released by the claim holder under generation gen.
// A prepared unit is already out of the slices (the plugin takes it out at prepare).
func (w *offerWatch) release(unit string, holder types.UID, gen uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, offered := w.offered()
	w.released[unit] = &releasedUnit{gen: gen, holder: holder, at: time.Now(), withdrawn: !offered[unit]}
}

// offered are the units whose devices are untainted in the pool's newest slices, and
// that generation; w.mu held.
func (w *offerWatch) offered() (int64, map[string]bool) {
	var newest int64
	for _, s := range w.slices {
		newest = max(newest, s.Spec.Pool.Generation)
	}
	offered := map[string]bool{}
	for _, s := range w.slices {
		for _, d := range s.Spec.Devices {
			if s.Spec.Pool.Generation == newest && len(d.Taints) == 0 {
				offered[w.unitOf(d.Name)] = true
			}
		}
	}
	return newest, offered
}

func (w *offerWatch) unitOf(device string) string {
	unit, _, _ := strings.Cut(device, "-")
	return unit
}

func (w *offerWatch) event(ctx context.Context, ev watch.Event) {
	if ev.Type == watch.Error {
		w.problem("watch error: %v", ev.Object)
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	switch o := ev.Object.(type) {
	case *resourceapi.ResourceSlice:
		if o.Spec.Driver != resources.DriverName || o.Spec.Pool.Name != "b300-a" {
			return
		}
		if ev.Type == watch.Deleted {
			delete(w.slices, o.Name)
		} else {
			w.slices[o.Name] = o
		}
		newest, offered := w.offered()
		w.trace = append(w.trace, fmt.Sprintf("%s %s %s: newest generation %d offers %d units %v", time.Now().Format("15:04:05.000"), ev.Type, o.Name, newest, len(offered), offered))
		for unit, r := range w.released {
			switch {
			case !offered[unit]:
				r.withdrawn = true
			case r.withdrawn && r.offered.IsZero():
				r.offered = time.Now()
				w.judge(ctx, unit, r, "offered in slice generation "+strconv.FormatInt(newest, 10))
			}
		}
	case *resourceapi.ResourceClaim:
		if ev.Type == watch.Deleted || o.Status.Allocation == nil {
			return
		}
		for _, res := range o.Status.Allocation.Devices.Results {
			r := w.released[w.unitOf(res.Device)]
			if r == nil || o.UID == r.holder || !r.allocated.IsZero() {
				continue
			}
			r.allocated, r.allocatedTo = time.Now(), o.Name
			w.judge(ctx, w.unitOf(res.Device), r, "allocated to claim "+o.Name)
		}
	}
}

// judge checks the released unit as it is offered or allocated; w.mu held.
func (w *offerWatch) judge(ctx context.Context, unit string, r *releasedUnit, what string) {
	e := w.e
	for _, lba := range []uint64{0, lastLBA} {
		b, err := simnode.Read(ctx, e.rig.Root, e.nvme(unit), lba)
		if err != nil || bytes.Equal(b, tenantBlock) {
			w.problems = append(w.problems, fmt.Sprintf("%s %s with its NVMe's block %d not erased (%v)", unit, what, lba, err))
		}
	}
	// The record's generation is the newest the control plane accepted an attestation of;
	// its verdict is about the newest envelope POSTed, which another unit's recycle may
	// have sent since (unverified until its attestation): only failed is wrong here.
	if verdict, gen, err := e.record(ctx); err != nil || verdict == control.VerdictFailed || verdict == "" || gen < r.gen+2 {
		w.problems = append(w.problems, fmt.Sprintf("%s %s while the control plane's record says %q at generation %d (%v), released under %d", unit, what, verdict, gen, err, r.gen))
	}
	if u, err := e.units(); err != nil || u[unit].State != "" {
		w.problems = append(w.problems, fmt.Sprintf("%s %s while units.json says %+v (%v)", unit, what, u[unit], err))
	}
}

// returned fails the test with what the watch found wrong, and checks that each unit
// was offered again and allocated to a claim of another pod; it returns each unit's
// turnaround (release to allocation) and forgets the units.
func (w *offerWatch) returned(t testing.TB, units ...string) map[string]time.Duration {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.problems) > 0 {
		t.Fatalf("while units turned around:\n%s", strings.Join(w.problems, "\n"))
	}
	out := map[string]time.Duration{}
	for _, u := range units {
		r := w.released[u]
		if r == nil || r.offered.IsZero() || r.allocated.IsZero() {
			t.Fatalf("%s: never seen offered and allocated again by the watches: %+v\nslice events:\n%s", u, r, strings.Join(w.trace, "\n"))
		}
		out[u] = r.allocated.Sub(r.at)
		delete(w.released, u)
	}
	return out
}

// restart starts the node's plugin again and registers it once it serves (its log says
// it publishes a second time).
func (e *turnEnv) restart(t testing.TB, ctx context.Context) {
	t.Helper()
	starts := func() int {
		b, _ := os.ReadFile(e.n.log)
		return bytes.Count(b, []byte(": node b300-a: publishing "))
	}
	n := starts()
	e.n.run(t, e.bin, e.args...)
	waitFor(t, ctx, 60*time.Second, "the restarted plugin serving", func() (bool, string) {
		return starts() > n, ""
	})
	e.k = kubeletOf(t, ctx, e.n)
}

// waitLog waits for the plugin's log to say s.
func (e *turnEnv) waitLog(t testing.TB, ctx context.Context, d time.Duration, s string) {
	t.Helper()
	waitFor(t, ctx, d, "the plugin's log saying "+s, func() (bool, string) {
		b, _ := os.ReadFile(e.n.log)
		return bytes.Contains(b, []byte(s)), ""
	})
}

// TestClusterTurnaround: passage-dra's turnaround on the real control plane (see
// README.md, "The tests"): a unit released is erased, re-signed, verified by passage-control
// and allocated to a waiting pod with no command run, never before; eight at once with
// one failing erase; a plugin SIGKILLed mid-recycle.
func TestClusterTurnaround(t *testing.T) {
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	e := newTurnEnv(t, ctx)
	rigs := map[string]*noderig.Rig{"b300-a": e.rig}

	// Every unit taken; a ninth pod waits.
	pods := e.newPods(t, ctx, 8)
	units := e.bound(t, ctx, pods)
	waiting := e.newPods(t, ctx, 1)[0]
	waitUnschedulable(t, ctx, e.api, waiting, "cannot allocate all claims")
	w := e.watchOffers(t, ctx)

	// 1. The first pod's VM wrote its data and still holds its unit's group as it goes.
	first := pods[0]
	unit := units[first]
	e.tenant(t, unit, true)
	letGo := e.rig.Hold(t, 4242, e.unitIndex(unit))
	before := e.generation(t)
	tried := attempts(t, e.c, waiting)
	e.release(t, ctx, w, []string{first})
	e.waitLog(t, ctx, 60*time.Second, "pid 4242")
	// The scheduler tried the waiting pod again after the release and found nothing.
	waitRejudged(t, ctx, e.c, e.api, waiting, tried, "cannot allocate all claims")
	if !e.tenant(t, unit, false) || e.generation(t) != before {
		t.Fatalf("held by pid 4242, yet touched: tenant's data there %v, generation %d (was %d)", e.tenant(t, unit, false), e.generation(t), before)
	}
	letGo()
	e.bound(t, ctx, []string{waiting})
	took := w.returned(t, unit)
	if _, got := wholeUnit(t, podClaim(t, ctx, e.api, waiting), rigs, ""); got != unit {
		t.Fatalf("%s got %s, want the released %s", waiting, got, unit)
	}
	if e.tenant(t, unit, false) {
		t.Fatalf("%s allocated again with the tenant's data on its NVMe", unit)
	}
	after := e.generation(t)
	verdict, gen, err := e.record(ctx)
	if after != before+2 || err != nil || verdict != control.VerdictVerified || gen != after {
		t.Fatalf("generation %d (was %d, want +2: not ready, ready); the control plane's record %q at %d (%v)", after, before, verdict, gen, err)
	}
	t.Logf("1. %s released (held by pid 4242 until let go): erased (read back), generation %d -> %d, verified by passage-control, allocated to %s; release to allocation %v",
		unit, before, after, waiting, took[unit].Round(time.Millisecond))
	units[waiting] = unit
	delete(units, first)

	// 2. Eight units released at once; one NVMe does not answer.
	next := e.newPods(t, ctx, 8)
	var holders, all []string
	for p, u := range units {
		holders = append(holders, p)
		all = append(all, u)
		e.tenant(t, u, true)
	}
	slices.Sort(all)
	bad := all[5]
	if err := simnode.SetFault(e.rig.Root, e.nvme(bad), true); err != nil {
		t.Fatal(err)
	}
	e.release(t, ctx, w, holders)
	waitFor(t, ctx, 3*time.Minute, "seven pods bound and "+bad+" quarantined", func() (bool, string) {
		bound := 0
		for _, p := range next {
			if pp, err := e.api.CoreV1().Pods(ns).Get(ctx, p, metav1.GetOptions{}); err == nil && pp.Spec.NodeName != "" {
				bound++
			}
		}
		return bound == 7 && len(quarantined(t, ctx, e.api, bad)) == 4, fmt.Sprintf("%d bound, %d devices of %s tainted", bound, len(quarantined(t, ctx, e.api, bad)), bad)
	})
	var seven, pending []string
	for _, p := range next {
		if pp, _ := e.api.CoreV1().Pods(ns).Get(ctx, p, metav1.GetOptions{}); pp.Spec.NodeName != "" {
			seven = append(seven, p)
		} else {
			pending = append(pending, p)
		}
	}
	got := e.bound(t, ctx, seven)
	var back []string
	for _, u := range got {
		back = append(back, u)
	}
	took = w.returned(t, back...)
	for _, d := range quarantined(t, ctx, e.api, bad) {
		if d.Value != "erase" || d.Effect != resourceapi.DeviceTaintEffectNoSchedule {
			t.Fatalf("%s's taint %+v, want %s=erase:NoSchedule", bad, d, plugin.TaintQuarantined)
		}
	}
	ev := quarantineEvent(t, ctx, e.api)
	if !strings.Contains(ev, bad) || !strings.Contains(ev, "does not answer") {
		t.Fatalf("the Event on node b300-a: %q", ev)
	}
	waitUnschedulable(t, ctx, e.api, pending[0], "cannot allocate all claims")
	m := e.checkMetrics(t, `passage_dra_turnaround_units{state="quarantined"} 1`, `passage_dra_recycles_total{outcome="quarantined"} 1`)
	t.Logf("2. eight released at once, %s's NVMe not answering: %v back to %v, release to allocation %v; %s quarantined (%s=erase:NoSchedule on its 4 devices in the API's slice), Event: %s; metrics: %s",
		bad, back, seven, took, bad, plugin.TaintQuarantined, ev, metricLine(m, `passage_dra_turnaround_units{state="quarantined"}`))

	// The fault repaired, the operator clears the quarantine: the waiting pod gets it.
	if err := simnode.SetFault(e.rig.Root, e.nvme(bad), false); err != nil {
		t.Fatal(err)
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, plugin.ClearAnnotation, bad)
	if _, err := e.api.CoreV1().Nodes().Patch(ctx, "b300-a", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if u := e.bound(t, ctx, pending)[pending[0]]; u != bad {
		t.Fatalf("%s got %s after the clear, want %s", pending[0], u, bad)
	}
	took = w.returned(t, bad)
	if n, err := e.api.CoreV1().Nodes().Get(ctx, "b300-a", metav1.GetOptions{}); err != nil || n.Annotations[plugin.ClearAnnotation] != "" {
		t.Fatalf("the clear annotation after it was acted on: %v %v", n.Annotations, err)
	}
	t.Logf("2. cleared with kubectl annotate node b300-a %s=%s: %s back (erased, verified), allocated to %s %v after its release",
		plugin.ClearAnnotation, bad, bad, pending[0], took[bad].Round(time.Millisecond))

	// 3. The plugin SIGKILLed in the middle of eight recycles (each admin command of the
	// NVMe taking a second) and started again.
	holders = append(seven, pending...)
	again := e.newPods(t, ctx, 8)
	for _, u := range all {
		e.tenant(t, u, true)
		if err := simnode.SetLatency(e.rig.Root, e.nvme(u), time.Second); err != nil {
			t.Fatal(err)
		}
	}
	before = e.generation(t)
	e.release(t, ctx, w, holders)
	waitFor(t, ctx, 2*time.Minute, "eight recycles under way", func() (bool, string) {
		u, err := e.units()
		recycling := 0
		for _, s := range u {
			if s.State == plugin.StateRecycling {
				recycling++
			}
		}
		g := e.generation(t)
		return recycling == 8 && g >= before+8, fmt.Sprintf("%d recycling (%v), generation %d", recycling, err, g)
	})
	e.n.cmd.Process.Signal(syscall.SIGKILL)
	<-e.n.done
	dirty := 0
	for _, u := range all {
		if e.tenant(t, u, false) {
			dirty++
		}
		simnode.SetLatency(e.rig.Root, e.nvme(u), 0)
	}
	if dirty == 0 {
		t.Fatal("killed after every erase was done: not mid-recycle")
	}
	flushTransient(t, e.sock)
	e.restart(t, ctx)
	got = e.bound(t, ctx, again)
	back = nil
	for _, u := range got {
		back = append(back, u)
	}
	slices.Sort(back)
	if !slices.Equal(back, all) {
		t.Fatalf("after the restart the pods got %v, want every unit %v", back, all)
	}
	took = w.returned(t, back...)
	if u, err := e.units(); err != nil || len(u) != 0 {
		t.Fatalf("units.json after every unit is back: %v %v", u, err)
	}
	t.Logf("3. SIGKILL with 8 recycles under way (%d NVMe not yet erased), restarted: none offered before its recycle was verified; all 8 back (%v), release to allocation %v",
		dirty, again, took)
	e.checkMetrics(t)
	t.Logf("TIMING TestClusterTurnaround wall time: %v", time.Since(began).Round(100*time.Millisecond))
}

// quarantined are the taints the API's slices carry on unit's devices.
func quarantined(t testing.TB, ctx context.Context, api *kubernetes.Clientset, unit string) []resourceapi.DeviceTaint {
	t.Helper()
	list, err := api.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []resourceapi.DeviceTaint
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			for _, tn := range d.Taints {
				if strings.HasPrefix(d.Name, unit+"-") && tn.Key == plugin.TaintQuarantined {
					out = append(out, tn)
				}
			}
		}
	}
	return out
}

// quarantineEvent waits for the UnitQuarantined Event on node b300-a and returns its
// message.
func quarantineEvent(t testing.TB, ctx context.Context, api *kubernetes.Clientset) string {
	t.Helper()
	var msg string
	waitFor(t, ctx, 30*time.Second, "the UnitQuarantined Event on b300-a", func() (bool, string) {
		evs, err := api.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, ev := range evs.Items {
			if ev.Reason == "UnitQuarantined" && ev.InvolvedObject.Kind == "Node" && ev.InvolvedObject.Name == "b300-a" && ev.Type == corev1.EventTypeWarning {
				msg = ev.Message
			}
		}
		return msg != "", fmt.Sprint(len(evs.Items), " events")
	})
	return msg
}

// checkMetrics judges the plugin's --metrics-file with promtool and looks for want.
func (e *turnEnv) checkMetrics(t testing.TB, want ...string) []byte {
	t.Helper()
	m, err := os.ReadFile(e.metrics)
	if err != nil {
		t.Fatal(err)
	}
	check := exec.Command("promtool", "check", "metrics")
	check.Stdin = bytes.NewReader(m)
	if out, err := check.CombinedOutput(); err != nil {
		t.Fatalf("promtool check metrics: %v\n%s\n%s", err, out, m)
	}
	for _, w := range want {
		if !bytes.Contains(m, []byte(w)) {
			t.Fatalf("metrics lack %s:\n%s", w, m)
		}
	}
	return m
}

func metricLine(m []byte, prefix string) string {
	for _, l := range strings.Split(string(m), "\n") {
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	return ""
}

// flushTransient is the kernel's resource manager's part when a process holding
// /dev/tpmrm0 dies: the objects and sessions it loaded are flushed. swtpm's socket has
// no resource manager, so after a SIGKILL the test does it.
func flushTransient(t testing.TB, sock string) {
	t.Helper()
	tp, err := linuxudstpm.Open(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tp.Close()
	for _, ht := range []tpm2.TPMHT{tpm2.TPMHTTransient, tpm2.TPMHTHMACSession, tpm2.TPMHTPolicySession} {
		rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: uint32(ht) << 24, PropertyCount: 64}.Execute(tp)
		if err != nil {
			t.Fatal(err)
		}
		hs, err := rsp.CapabilityData.Data.Handles()
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range hs.Handle {
			if _, err := (tpm2.FlushContext{FlushHandle: h}).Execute(tp); err != nil {
				t.Fatalf("flush %#x: %v", h, err)
			}
		}
	}
}
