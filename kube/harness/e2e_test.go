//go:build cluster

package harness_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/harness"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

const ns = "tenant"

// node is one Kubernetes node: its rig (sysfs, vfio, signed manifest) and its running
// passage-dra plugin.
type node struct {
	name string // the Kubernetes node name
	rig  *noderig.Rig
	dir  string // the plugin's CDI, registry and plugin directories
	log  string
	cmd  *exec.Cmd
	done chan struct{}
}

func (n *node) cdi() string    { return filepath.Join(n.dir, "cdi") }
func (n *node) plugin() string { return filepath.Join(n.dir, "plugin") }

// run starts the node's passage-dra process, bin with args, its output appended to
// n.log (a restart's after the last's), killed when the test ends.
func (n *node) run(t testing.TB, bin string, args ...string) {
	t.Helper()
	os.MkdirAll(filepath.Join(n.dir, "registry"), 0o755)
	n.log = filepath.Join(n.dir, "plugin.log")
	out, err := os.OpenFile(n.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd, done := exec.Command(bin, args...), make(chan struct{})
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	n.cmd, n.done = cmd, done
	go func() { cmd.Wait(); out.Close(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Log(harness.Tail(n.log, 2000))
		}
	})
}

// TestCluster: passage-dra against the real control plane (see README.md, "The tests").
func TestCluster(t *testing.T) {
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	work := t.TempDir()
	draBin := goBuild(t, work, "passage-dra")
	c := startCluster(t, ctx, work)
	api := c.Client
	createNamespace(t, ctx, api)

	// The plugins run as the DaemonSet's service account with what deploy/'s ClusterRole
	// grants it, so the real authorizer judges the RBAC an operator applies.
	pluginConfig := filepath.Join(work, "passage-dra.kubeconfig")
	deployRBAC(t, ctx, c, pluginConfig)

	keys := filepath.Join(work, "keys")
	start := func(name, host string, k int, degraded bool, edit func(*noderig.Rig)) *node {
		n := &node{name: name, rig: noderig.New(t, manifesttest.NodeUUID(k), host, byte(k), keys), dir: filepath.Join(work, name)}
		if edit != nil {
			edit(n.rig)
		}
		addNode(t, ctx, api, name)
		args := []string{"plugin", "--pub", keys, "--manifest", n.rig.Path, "--root", n.rig.Root, "--cdi-dir", n.cdi(),
			"--registry-dir", filepath.Join(n.dir, "registry"), "--plugin-dir", n.plugin(), "--kubeconfig", pluginConfig, "--reload", "1s"}
		if name != host {
			args = append(args, "--node-name", name)
		}
		if degraded {
			args = append(args, "--degraded")
		}
		n.run(t, draBin, args...)
		return n
	}
	// Node a's Kubernetes name is its hostname; node b's is not (the DaemonSet passes
	// --node-name=$(NODE_NAME)): before the fix its slices went to a node "b300-b".
	a := start("b300-a", "b300-a", 1, false, nil)
	b := start("worker-b", "b300-b", 2, false, nil)

	// The class and the templates, through the API's own validation and admission.
	v, err := resources.Verify(a.rig.Path, resources.Source{Keys: keys, NodeUUID: a.rig.M.Node.DMIUUID})
	if err != nil {
		t.Fatal(err)
	}
	objs, err := resources.Render(v, resources.Options{Degraded: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := api.ResourceV1().DeviceClasses().Create(ctx, objs.Class, metav1.CreateOptions{}); err != nil {
		t.Fatalf("DeviceClass: %v", err)
	}
	for _, tmpl := range append(slices.Clone(objs.Templates), objs.DegradedTemplates...) {
		if _, err := api.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatalf("template %s: %v", tmpl.Name, err)
		}
	}
	shape := objs.Shapes[0]
	ready, orDegraded := shape.TemplateName(), shape.DegradedTemplateName()

	// Each plugin publishes its 32 functions, node b's under its Kubernetes name.
	waitFor(t, ctx, 60*time.Second, "slices of b300-a and worker-b", func() (bool, string) {
		p := pools(t, ctx, api)
		return len(p["b300-a"]) == 32 && len(p["worker-b"]) == 32, fmt.Sprint(counts(p))
	})
	// Their pools are the manifests' hostnames, what passage-control's taint rule selects.
	sl, err := api.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sl.Items {
		if want := map[string]string{"b300-a": "b300-a", "worker-b": "b300-b"}[*s.Spec.NodeName]; s.Spec.Pool.Name != want {
			t.Fatalf("slice %s of node %s: pool %q, want the manifest's hostname %q", s.Name, *s.Spec.NodeName, s.Spec.Pool.Name, want)
		}
	}

	// 16 unit claims, 8 direct and 8 from the template: every one bound, each claim a
	// whole unit of the manifest, 8 on each node.
	var first time.Duration
	for i := range 16 {
		if i < 8 {
			claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("claim-%d", i)}, Spec: resources.ClaimSpec(shape, false)}
			if _, err := api.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
				t.Fatalf("claim %d: %v", i, err)
			}
			createPod(t, ctx, api, fmt.Sprintf("pod-%d", i), claim.Name, "")
		} else {
			createPod(t, ctx, api, fmt.Sprintf("pod-%d", i), "", ready)
		}
	}
	waitFor(t, ctx, 90*time.Second, "16 pods bound", func() (bool, string) {
		bound := 0
		for i := range 16 {
			p, err := api.CoreV1().Pods(ns).Get(ctx, fmt.Sprintf("pod-%d", i), metav1.GetOptions{})
			if err == nil && p.Spec.NodeName != "" {
				bound++
				if first == 0 {
					first = time.Since(c.Started)
				}
			}
		}
		return bound == 16, fmt.Sprintf("%d bound", bound)
	})
	t.Logf("TIMING control plane start to first pod bound: %v", first.Round(10*time.Millisecond))
	rigs := map[string]*noderig.Rig{"b300-a": a.rig, "worker-b": b.rig}
	units := map[string]string{} // node/unit -> pod
	perNode := map[string]int{}
	claims := map[string]*resourceapi.ResourceClaim{}
	for i := range 16 {
		pod := fmt.Sprintf("pod-%d", i)
		cl := podClaim(t, ctx, api, pod)
		nodeName, unit := wholeUnit(t, cl, rigs, "")
		if prev, dup := units[nodeName+"/"+unit]; dup {
			t.Fatalf("unit %s of %s allocated to %s and %s", unit, nodeName, prev, pod)
		}
		units[nodeName+"/"+unit] = pod
		perNode[nodeName]++
		claims[pod] = cl
		p, _ := api.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
		if p.Spec.NodeName != nodeName {
			t.Fatalf("%s on node %s, its claim's unit on %s", pod, p.Spec.NodeName, nodeName)
		}
	}
	if perNode["b300-a"] != 8 || perNode["worker-b"] != 8 {
		t.Fatalf("pods per node %v, want 8 on each (worker-b's name is not its hostname)", perNode)
	}

	// The 17th: Pending, with the scheduler's own reason.
	createPod(t, ctx, api, "pod-16", "", ready)
	waitUnschedulable(t, ctx, api, "pod-16", "cannot allocate all claims")

	// The kubelet's part on node b300-a, over the plugin's sockets.
	k := kubeletOf(t, ctx, a)
	var onA []string
	for i := 8; i < 16; i++ { // the template pods: their claims go with them
		if p, _ := api.CoreV1().Pods(ns).Get(ctx, fmt.Sprintf("pod-%d", i), metav1.GetOptions{}); p.Spec.NodeName == "b300-a" {
			onA = append(onA, p.Name)
		}
	}
	if len(onA) < 2 {
		t.Fatalf("template pods on b300-a: %v", onA)
	}
	// A NIC moved back to mlx5_core between allocation and prepare refuses that claim,
	// naming it.
	moved := claims[onA[1]]
	_, mUnit := wholeUnit(t, moved, rigs, "")
	nic := a.rig.M.Units[unitIndex(a.rig, mUnit)].Functions[2].BDF
	addr := a.rig.Tree.Addr(noderig.UnitNames(unitIndex(a.rig, mUnit))[2])
	a.rig.Rebind(t, addr, "")
	resp := prepare(t, ctx, k, moved)
	if want := fmt.Sprintf("function %s left vfio-pci: it is bound to mlx5_core", nic); !strings.Contains(resp.Error, want) || len(resp.Devices) != 0 {
		t.Fatalf("prepare %s with %s on mlx5_core: %+v, want %q", moved.Name, nic, resp, want)
	}
	a.rig.Rebind(t, addr, "vfio-pci")

	// Prepare with the scheduler's allocation: the CDI spec holds exactly the allocated
	// functions' VFIO groups.
	held := claims[onA[0]]
	_, hUnit := wholeUnit(t, held, rigs, "")
	u := a.rig.M.Units[unitIndex(a.rig, hUnit)]
	resp = prepare(t, ctx, k, held)
	if resp.Error != "" || len(resp.Devices) != 4 {
		t.Fatalf("prepare %s: %+v", held.Name, resp)
	}
	var groups []string
	for _, f := range u.Functions {
		groups = append(groups, fmt.Sprintf("/dev/vfio/%d", f.IOMMUGroup))
	}
	if got := cdiNodes(t, a, held); strings.Join(got, " ") != "/dev/vfio/vfio "+strings.Join(groups, " ") {
		t.Fatalf("CDI spec of %s: device nodes %v, want /dev/vfio/vfio and %v", held.Name, got, groups)
	}
	// Unprepare: the API's slices lose the unit, and keep it out after the pod goes.
	uresp, err := k.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: ns, Name: held.Name, Uid: string(held.UID)}}})
	if err != nil || uresp.Claims[string(held.UID)].Error != "" {
		t.Fatalf("unprepare %s: %v %+v", held.Name, err, uresp)
	}
	lacks := func(unit string) func() (bool, string) {
		return func() (bool, string) {
			devs := pools(t, ctx, api)["b300-a"]
			for _, d := range devs {
				if strings.HasPrefix(d, unit+"-") {
					return false, fmt.Sprint(len(devs), " devices")
				}
			}
			return len(devs) == 28, fmt.Sprint(len(devs), " devices")
		}
	}
	waitFor(t, ctx, 30*time.Second, "b300-a's slices without "+hUnit, lacks(hUnit))
	tried := attempts(t, c, "pod-16")
	forceDelete(t, ctx, api, onA[0])
	waitRejudged(t, ctx, c, api, "pod-16", tried, "cannot allocate all claims")
	// A manifest of a newer generation (after passage recycle) brings it back, and the
	// waiting pod gets it.
	a.rig.M.Generation = 8
	a.rig.Sign(t)
	waitFor(t, ctx, 30*time.Second, "b300-a's slices with 32 devices again", func() (bool, string) {
		n := len(pools(t, ctx, api)["b300-a"])
		return n == 32, fmt.Sprint(n)
	})
	waitFor(t, ctx, 60*time.Second, "pod-16 bound to the recycled unit", func() (bool, string) {
		p, _ := api.CoreV1().Pods(ns).Get(ctx, "pod-16", metav1.GetOptions{})
		return p.Spec.NodeName == "b300-a", p.Spec.NodeName
	})
	if n, unit := wholeUnit(t, podClaim(t, ctx, api, "pod-16"), rigs, ""); n != "b300-a" || unit != hUnit {
		t.Fatalf("pod-16 got %s/%s, want the recycled b300-a/%s", n, unit, hUnit)
	}

	// A tampered manifest (a failed unit made ready, the signature kept): its plugin
	// publishes nothing and says why.
	d := start("b300-d", "b300-d", 4, false, func(r *noderig.Rig) {
		r.M.Units[5].Status, r.M.Units[5].Reasons = manifest.StatusFailed, []string{"acs: mismatch"}
		for i := range r.M.Units[5].Functions {
			r.M.Units[5].Functions[i].DriverAfter = "nvidia"
		}
		r.Sign(t)
		tamper(t, r.Path)
	})
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("the plugin of a tampered manifest still runs: %s", harness.Tail(d.log, 2000))
	}
	if log := harness.Tail(d.log, 4000); d.cmd.ProcessState.ExitCode() != 1 || !strings.Contains(log, "REFUSED") || !strings.Contains(log, manifest.ErrBadSignature.Error()) {
		t.Fatalf("tampered manifest: exit %v, %s", d.cmd.ProcessState, log)
	}
	if p := pools(t, ctx, api); len(p["b300-d"]) != 0 {
		t.Fatalf("b300-d published %d devices", len(p["b300-d"]))
	}

	// Node c publishes its degraded gpu0 (--degraded) and not its failed gpu1: ready
	// claims take its six ready units and never gpu0; a claim from the -or-degraded
	// template takes gpu0; the failed unit, never.
	cn := start("b300-c", "b300-c", 3, true, func(r *noderig.Rig) {
		r.M.Units[0].Status, r.M.Units[0].Reasons = manifest.StatusDegraded, []string{"erase: auto: nvme not erased"}
		r.M.Units[1].Status, r.M.Units[1].Reasons = manifest.StatusFailed, []string{"acs: mismatch"}
		for i := range r.M.Units[1].Functions {
			r.M.Units[1].Functions[i].DriverAfter = "nvidia"
		}
		r.Sign(t)
	})
	rigs["b300-c"] = cn.rig
	waitFor(t, ctx, 60*time.Second, "b300-c's slices", func() (bool, string) {
		n := len(pools(t, ctx, api)["b300-c"])
		return n == 28, fmt.Sprint(n)
	})
	for i := range 7 {
		createPod(t, ctx, api, fmt.Sprintf("ready-%d", i), "", ready)
	}
	waitFor(t, ctx, 60*time.Second, "6 ready pods bound on b300-c", func() (bool, string) {
		bound := 0
		for i := range 7 {
			if p, _ := api.CoreV1().Pods(ns).Get(ctx, fmt.Sprintf("ready-%d", i), metav1.GetOptions{}); p.Spec.NodeName != "" {
				bound++
			}
		}
		return bound == 6, fmt.Sprint(bound)
	})
	pending := ""
	for i := range 7 {
		name := fmt.Sprintf("ready-%d", i)
		if p, _ := api.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{}); p.Spec.NodeName == "" {
			pending = name
			continue
		}
		n, unit := wholeUnit(t, podClaim(t, ctx, api, name), rigs, "")
		if n != "b300-c" || unit == "gpu0" || unit == "gpu1" {
			t.Fatalf("%s got %s/%s", name, n, unit)
		}
	}
	waitUnschedulable(t, ctx, api, pending, "cannot allocate all claims")
	createPod(t, ctx, api, "degraded-ok", "", orDegraded)
	waitFor(t, ctx, 60*time.Second, "degraded-ok bound", func() (bool, string) {
		p, _ := api.CoreV1().Pods(ns).Get(ctx, "degraded-ok", metav1.GetOptions{})
		return p.Spec.NodeName != "", ""
	})
	if n, unit := wholeUnit(t, podClaim(t, ctx, api, "degraded-ok"), rigs, "degraded"); n != "b300-c" || unit != "gpu0" {
		t.Fatalf("the claim asking for a degraded unit got %s/%s, want b300-c/gpu0", n, unit)
	}
	createPod(t, ctx, api, "degraded-ok-2", "", orDegraded)
	waitUnschedulable(t, ctx, api, "degraded-ok-2", "cannot allocate all claims")
	// Node e's degraded gpu0 is not published (no --degraded; its other units failed):
	// the claim that would take it stays Pending.
	tried = attempts(t, c, "degraded-ok-2")
	start("b300-e", "b300-e", 5, false, func(r *noderig.Rig) {
		r.M.Units[0].Status, r.M.Units[0].Reasons = manifest.StatusDegraded, []string{"erase: auto: nvme not erased"}
		for i := 1; i < len(r.M.Units); i++ {
			r.M.Units[i].Status, r.M.Units[i].Reasons = manifest.StatusFailed, []string{"acs: mismatch"}
			for j := range r.M.Units[i].Functions {
				r.M.Units[i].Functions[j].DriverAfter = "nvidia"
			}
		}
		r.Sign(t)
	})
	waitFor(t, ctx, 60*time.Second, "b300-e's empty pool published", func() (bool, string) {
		list, err := api.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, sl := range list.Items {
			if sl.Spec.Pool.Name == "b300-e" {
				return len(sl.Spec.Devices) == 0, fmt.Sprint(len(sl.Spec.Devices), " devices")
			}
		}
		return false, "no slice"
	})
	waitRejudged(t, ctx, c, api, "degraded-ok-2", tried, "cannot allocate all claims")
	t.Logf("TIMING e2e wall time: %v", time.Since(began).Round(100*time.Millisecond))
}

// startCluster starts the pinned control plane (PASSAGE_CONTROL_PLANE, which make
// cluster-test builds) under work/cp, stopped when the test ends, its logs printed when
// the test failed.
func startCluster(t testing.TB, ctx context.Context, work string) *harness.Cluster {
	t.Helper()
	bin := os.Getenv("PASSAGE_CONTROL_PLANE")
	if bin == "" {
		t.Fatal("PASSAGE_CONTROL_PLANE: the directory of the control plane's binaries (make cluster-test builds them)")
	}
	cdir := filepath.Join(work, "cp")
	os.MkdirAll(cdir, 0o755)
	c, err := harness.Start(ctx, bin, cdir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, l := range c.Logs() {
				t.Log(harness.Tail(l, 3000))
			}
		}
		c.Stop()
	})
	return c
}

// createNamespace makes the test's namespace and its default service account (no
// controller-manager service-account controller makes it before the pods need it).
func createNamespace(t testing.TB, ctx context.Context, api *kubernetes.Clientset) {
	t.Helper()
	mustCreate(t, func() error {
		_, err := api.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		return err
	})
	mustCreate(t, func() error {
		_, err := api.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
		return err
	})
}

// goBuild builds the kube module's command cmd/NAME into work.
func goBuild(t testing.TB, work, name string) string {
	t.Helper()
	out := filepath.Join(work, name)
	if b, err := exec.Command("go", "build", "-o", out, "github.com/passage-boot/passage/kube/cmd/"+name).CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", name, err, b)
	}
	return out
}

func mustCreate(t testing.TB, f func() error) {
	t.Helper()
	if err := f(); err != nil {
		t.Fatal(err)
	}
}

// addNode creates a Ready Node as a kubelet would register it, without the not-ready
// taint the API's admission gives a new node (no kubelet will lift it).
func addNode(t testing.TB, ctx context.Context, api *kubernetes.Clientset, name string) {
	t.Helper()
	n, err := api.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name,
		Labels: map[string]string{"kubernetes.io/hostname": name, "passage-boot.github.io/node": "true"}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("node %s: %v", name, err)
	}
	res := corev1.ResourceList{corev1.ResourcePods: resource.MustParse("110"), corev1.ResourceCPU: resource.MustParse("64"), corev1.ResourceMemory: resource.MustParse("512Gi")}
	n.Status = corev1.NodeStatus{Capacity: res, Allocatable: res, Conditions: []corev1.NodeCondition{{
		Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}}
	if n, err = api.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("node %s status: %v", name, err)
	}
	n.Spec.Taints = nil
	if _, err := api.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("node %s taints: %v", name, err)
	}
}

func createPod(t testing.TB, ctx context.Context, api *kubernetes.Clientset, name, claim, template string) {
	t.Helper()
	rc := corev1.PodResourceClaim{Name: "unit"}
	if claim != "" {
		rc.ResourceClaimName = &claim
	} else {
		rc.ResourceClaimTemplateName = &template
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PodSpec{
		ResourceClaims: []corev1.PodResourceClaim{rc},
		Containers: []corev1.Container{{Name: "vm", Image: "registry.invalid/vm:0",
			Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "unit"}}}}},
	}}
	if _, err := api.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("pod %s: %v", name, err)
	}
}

func forceDelete(t testing.TB, ctx context.Context, api *kubernetes.Clientset, name string) {
	t.Helper()
	zero := int64(0)
	if err := api.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
}

// podClaim is the pod's allocated claim (its own, or the one made from its template).
func podClaim(t testing.TB, ctx context.Context, api *kubernetes.Clientset, pod string) *resourceapi.ResourceClaim {
	t.Helper()
	var cl *resourceapi.ResourceClaim
	waitFor(t, ctx, 30*time.Second, pod+"'s claim allocated", func() (bool, string) {
		p, err := api.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		name := ""
		if rc := p.Spec.ResourceClaims[0]; rc.ResourceClaimName != nil {
			name = *rc.ResourceClaimName
		}
		for _, s := range p.Status.ResourceClaimStatuses {
			if s.ResourceClaimName != nil {
				name = *s.ResourceClaimName
			}
		}
		if name == "" {
			return false, "no claim yet"
		}
		cl, err = api.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
		return err == nil && cl.Status.Allocation != nil, fmt.Sprint(err)
	})
	return cl
}

// wholeUnit checks the claim's allocation is exactly one unit's functions (by BDF, from
// its node's manifest), of status ready (or status, when given), and returns the node
// and the unit.
func wholeUnit(t testing.TB, cl *resourceapi.ResourceClaim, rigs map[string]*noderig.Rig, status string) (string, string) {
	t.Helper()
	if status == "" {
		status = manifest.StatusReady
	}
	res := cl.Status.Allocation.Devices.Results
	if len(res) == 0 {
		t.Fatalf("claim %s: no devices", cl.Name)
	}
	// A node's pool is its manifest's hostname, not its Kubernetes name (worker-b's is
	// b300-b): the node is the rig whose manifest names the pool.
	pool := res[0].Pool
	var node string
	var r *noderig.Rig
	for n, rr := range rigs {
		if rr.M.Node.Hostname == pool {
			node, r = n, rr
		}
	}
	if r == nil {
		t.Fatalf("claim %s: pool %s is no node of the test", cl.Name, pool)
	}
	var got []string
	for _, x := range res {
		if x.Pool != pool || x.Driver != resources.DriverName {
			t.Fatalf("claim %s: devices of two pools %v", cl.Name, res)
		}
		got = append(got, x.Device)
	}
	for _, u := range r.M.Units {
		var want []string
		for _, f := range u.Functions {
			want = append(want, resources.DeviceName(u.ID, f.BDF))
		}
		if slices.Contains(want, got[0]) {
			slices.Sort(want)
			slices.Sort(got)
			if !slices.Equal(got, want) || u.Status != status {
				t.Fatalf("claim %s on %s: devices %v, unit %s (%s) is %v", cl.Name, pool, got, u.ID, u.Status, want)
			}
			return node, u.ID
		}
	}
	t.Fatalf("claim %s: device %s is no function of %s's manifest", cl.Name, got[0], pool)
	return "", ""
}

func unitIndex(r *noderig.Rig, unit string) int {
	for i, u := range r.M.Units {
		if u.ID == unit {
			return i
		}
	}
	return -1
}

func waitUnschedulable(t testing.TB, ctx context.Context, api *kubernetes.Clientset, pod, reason string) {
	t.Helper()
	waitFor(t, ctx, 60*time.Second, pod+" Pending: "+reason, func() (bool, string) {
		p, err := api.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if p.Spec.NodeName != "" {
			t.Fatalf("%s bound to %s", pod, p.Spec.NodeName)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				return strings.Contains(c.Message, reason), c.Message
			}
		}
		return false, "not yet judged"
	})
}

// attempts is how many times the scheduler has found no node for pod so far.
func attempts(t testing.TB, c *harness.Cluster, pod string) int {
	t.Helper()
	n, err := c.SchedulingAttempts(ns, pod)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// waitRejudged: the scheduler has tried pod again since its first tried attempts (after
// the change the caller made in between), and it is still Pending for reason. Without
// the new attempt a Pending pod would prove nothing: its condition may be the verdict of
// before the change. What it cannot rule out: an attempt another event set off just
// before the change, logged after the count was taken.
func waitRejudged(t testing.TB, ctx context.Context, c *harness.Cluster, api *kubernetes.Clientset, pod string, tried int, reason string) {
	t.Helper()
	waitFor(t, ctx, 60*time.Second, pod+" tried again by the scheduler", func() (bool, string) {
		n := attempts(t, c, pod)
		return n > tried, fmt.Sprintf("%d attempts, %d before the change", n, tried)
	})
	waitUnschedulable(t, ctx, api, pod, reason)
}

// waitFor polls cond until it holds or d passes; the error says what was awaited and
// what was last seen.
func waitFor(t testing.TB, ctx context.Context, d time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		ok, seen := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			t.Fatalf("%s: not after %v (last: %s)", what, d, seen)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// pools are the driver's devices the API's slices hold now, by Kubernetes node, from the
// newest generation of each pool.
func pools(t testing.TB, ctx context.Context, api *kubernetes.Clientset) map[string][]string {
	t.Helper()
	list, err := api.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	gen := map[string]int64{}
	for _, s := range list.Items {
		gen[s.Spec.Pool.Name] = max(gen[s.Spec.Pool.Name], s.Spec.Pool.Generation)
	}
	out := map[string][]string{}
	for _, s := range list.Items {
		if s.Spec.Driver != resources.DriverName || s.Spec.Pool.Generation != gen[s.Spec.Pool.Name] {
			continue
		}
		if s.Spec.NodeName == nil {
			t.Fatalf("slice %s of pool %s is for no node", s.Name, s.Spec.Pool.Name)
		}
		for _, d := range s.Spec.Devices {
			out[*s.Spec.NodeName] = append(out[*s.Spec.NodeName], d.Name)
		}
	}
	return out
}

func counts(p map[string][]string) map[string]int {
	out := map[string]int{}
	for k, v := range p {
		out[k] = len(v)
	}
	return out
}

type kubelet struct{ dra drapb.DRAPluginClient }

// kubeletOf registers the node's plugin as the kubelet's plugin watcher does and dials
// its DRA socket.
func kubeletOf(t testing.TB, ctx context.Context, n *node) *kubelet {
	t.Helper()
	reg := registerapi.NewRegistrationClient(dial(t, filepath.Join(n.dir, "registry", resources.DriverName+"-reg.sock")))
	info, err := reg.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	return &kubelet{dra: drapb.NewDRAPluginClient(dial(t, info.Endpoint))}
}

func dial(t testing.TB, sock string) *grpc.ClientConn {
	c, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func prepare(t testing.TB, ctx context.Context, k *kubelet, c *resourceapi.ResourceClaim) *drapb.NodePrepareResourceResponse {
	t.Helper()
	resp, err := k.dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Claims[string(c.UID)]
}

// cdiNodes are the device nodes of the claim's CDI spec on the node: the container's
// own, then each device's, in order.
func cdiNodes(t *testing.T, n *node, c *resourceapi.ResourceClaim) []string {
	t.Helper()
	// The claim's own spec (the helper writes its metadata spec beside it).
	specs, _ := filepath.Glob(filepath.Join(n.cdi(), strings.ReplaceAll(resources.DriverName, ".", "_")+"_unit_"+string(c.UID)+".json"))
	if len(specs) != 1 {
		t.Fatalf("claim %s: CDI specs %v", c.Name, specs)
	}
	b, err := os.ReadFile(specs[0])
	if err != nil {
		t.Fatal(err)
	}
	var s cdispec.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range s.ContainerEdits.DeviceNodes {
		out = append(out, d.Path)
	}
	for _, d := range s.Devices {
		for _, dn := range d.ContainerEdits.DeviceNodes {
			out = append(out, dn.Path)
		}
	}
	return out
}

// tamper edits the envelope's payload (every failed unit made ready) and keeps the
// signature.
func tamper(t *testing.T, path string) {
	t.Helper()
	var env manifest.Envelope
	b, _ := os.ReadFile(path)
	if err := json.Unmarshal(b, &env); err != nil {
		t.Fatal(err)
	}
	payload, _ := base64.StdEncoding.DecodeString(env.Payload)
	edited := strings.ReplaceAll(string(payload), `"status":"failed"`, `"status":"ready"`)
	if edited == string(payload) {
		t.Fatal("tamper: no failed unit in the payload")
	}
	env.Payload, env.PayloadDigest = base64.StdEncoding.EncodeToString([]byte(edited)), ""
	b, _ = json.Marshal(env)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// deployRBAC creates deploy/daemonset.yaml's namespace, service account, ClusterRole and
// binding through the API (its validation and admission), and writes at kubeconfig a
// credential of the service account the DaemonSet's pods run as. The DaemonSet itself is
// not created: no kubelet runs its pods; the test starts the plugins.
func deployRBAC(t testing.TB, ctx context.Context, c *harness.Cluster, kubeconfig string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "deploy", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	api := c.Client
	var ds *appsv1.DaemonSet
	for i, doc := range strings.Split(string(b), "\n---\n") {
		obj, gvk, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatalf("deploy/daemonset.yaml document %d: %v", i+1, err)
		}
		switch o := obj.(type) {
		case *corev1.Namespace:
			// Made already by a test that dry-ran deploy/ first (TestClusterServed).
			if _, err = api.CoreV1().Namespaces().Create(ctx, o, metav1.CreateOptions{}); apierrors.IsAlreadyExists(err) {
				err = nil
			}
		case *corev1.ServiceAccount:
			_, err = api.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = api.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = api.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		case *appsv1.DaemonSet:
			ds = o
		default:
			t.Fatalf("deploy/daemonset.yaml document %d: a %s, which the test does not create", i+1, gvk.Kind)
		}
		if err != nil {
			t.Fatalf("deploy/daemonset.yaml document %d (%s): %v", i+1, gvk.Kind, err)
		}
	}
	if ds == nil || ds.Spec.Template.Spec.ServiceAccountName == "" {
		t.Fatal("deploy/daemonset.yaml: no DaemonSet naming its service account")
	}
	if err := c.ServiceAccountKubeconfig(ctx, ds.Namespace, ds.Spec.Template.Spec.ServiceAccountName, kubeconfig); err != nil {
		t.Fatal(err)
	}
	// The credential is the account's and no more: what its role does not grant is refused.
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	as, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := as.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("the plugin's service account listing secrets: %v, want forbidden (the test would not judge its role)", err)
	}
}
