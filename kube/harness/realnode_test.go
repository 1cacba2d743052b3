//go:build cluster && node

package harness_test

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/initramfs/kmod"
	kubeletkey "github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/harness"
	"github.com/passage-boot/passage/manifest"
	qemutest "github.com/passage-boot/passage/qemu-tests"
)

// The real node's addresses on QEMU's user network (10.0.2.0/24, restrict=on). The
// cluster's Service range is carved from it so that the kubernetes Service's ClusterIP,
// its first address, is a guestfwd to the API server: pods reach the API server the way
// they do on any node (KUBERNETES_SERVICE_HOST), with no kube-proxy on this one.
const (
	nodeServiceCIDR = "10.0.2.96/28"
	nodeAPIAddr     = "10.0.2.97" // the kubernetes Service's ClusterIP, and where the kubelet dials
	nodeIP          = "10.0.2.15" // QEMU's first DHCP lease
	nodeName        = qemutest.DefaultHostname
	nodeUUID        = "8c3f6f0e-2b1d-4e6a-9d7c-5a4b3c2d1e0f" // its SMBIOS system UUID
	// The root disk passage switches to, found by its file system's UUID.
	nodeRootPartUUID = "5e1f2c3a-0b6d-4c1e-9a57-2f0d3b8e4a61"
	nodeRootFSUUID   = "a3c1f0de-6b7e-4f2a-8d19-0c5e7b2a9f44"
)

// nodeModules are what nodeinit loads (kube/internal/realnode/nodeinit), resolved with
// their dependencies into the root's /lib/modules.
var nodeModules = []string{"overlay", "veth", "nf_tables", "nft_chain_nat", "nft_masq"}

// realNode is the guest: its console, what it said, and the boot's report.
type realNode struct {
	console string
	mu      sync.Mutex
	lines   []string
	parser  *emit.Parser
	done    chan struct{}
	run     *qemutest.Run
	err     error
	began   time.Time
	stop    func() // ends the guest and keeps its console
}

func (n *realNode) saw(prefix string) (string, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, l := range n.lines {
		if i := strings.Index(l, prefix); i >= 0 {
			return l[i:], true
		}
	}
	return "", false
}

// tail is the last k lines the node said after passage handed off (nodeinit's, the
// programs' it started), or the console's last lines before that.
func (n *realNode) tail(k int) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []string
	for _, l := range n.lines {
		if len(out) > 0 || strings.Contains(l, "NODE-INIT") {
			out = append(out, l)
		}
	}
	if len(out) == 0 {
		out = n.lines
	}
	return strings.Join(out[max(0, len(out)-k):], "\n")
}

// text is all the node said.
func (n *realNode) text() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return strings.Join(n.lines, "\n")
}

func (n *realNode) files() map[string][]byte {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.parser.Report().Files
}

// TestRealNode boots a node through passage as the QEMU suite does (the real initramfs,
// vIOMMU, units on vfio-pci, swtpm) and hands off by switch_root into a root that runs
// the programs of a real node: containerd 2.x with runc and the CNI plugins, and
// kubelet v1.37.2, joining the control plane on the host. The node netboots passage's
// signed UKI under OVMF Secure Boot and attests at boot to two passage-control replicas
// (host processes against the real API server); the kubelet holds no credential of its
// own, only a bootstrap token, and its client certificate is approved by passage-control
// for the key the verified boot made and attested (kube-controller-manager signs it).
// Through the shipped deploy files, with only the images set, the kubelet runs
// passage-dra; a pod with a unit's claim gets exactly that unit's /dev/vfio nodes.
// Then the same node reboots into an image the operator did not approve (signed by the
// same db key): passage-control records the attestation failed, its kubelet's request
// is never approved, it publishes nothing and a pod created as it reboots never runs.
func TestRealNode(t *testing.T) {
	began := time.Now()
	// Five boots of a TCG guest: 626 s alone, 874 to 1005 s beside make test's QEMU
	// suite and cluster tests (7 Dec), one of which ran out of 15 minutes on its last
	// boot. Under make node-test's -timeout 20m.
	ctx, cancel := context.WithTimeout(context.Background(), 19*time.Minute)
	defer cancel()
	env := func(k, why string) string {
		v := os.Getenv(k)
		if v == "" {
			t.Fatalf("%s: %s (make node-test sets it)", k, why)
		}
		return v
	}
	bootBuild := env("PASSAGE_BUILD", "the kernel and initramfs build directory (build/linux-6.12)")
	cpBin := env("PASSAGE_CONTROL_PLANE", "the control plane's and the kubelet's binaries (kube/harness/build.sh)")
	runtimeBin := env("PASSAGE_NODE_RUNTIME", "containerd, runc and the CNI plugins (kube/harness/noderuntime/build.sh)")
	imagesDir := env("PASSAGE_IMAGES", "make images' output (build/images)")
	if keep := os.Getenv("PASSAGE_NODE_CONSOLE"); keep != "" {
		os.Remove(keep)
	}
	work := t.TempDir()
	step := func(what string, since time.Time) {
		t.Logf("TIMING %-52s %6.1f s (%.1f s since the test began)", what, time.Since(since).Seconds(), time.Since(began).Seconds())
	}

	// The control plane, ready for a real kubelet's TLS bootstrap: a bootstrap token, a
	// client CA, kube-controller-manager's signer and no approver but passage-control.
	t0 := time.Now()
	cdir := filepath.Join(work, "cp")
	os.MkdirAll(cdir, 0o755)
	c, err := harness.StartWith(ctx, cpBin, cdir, harness.Options{Signing: true, Node: &harness.NodeAccess{
		Name: nodeName, ServiceCIDR: nodeServiceCIDR, Addresses: []net.IP{net.ParseIP(nodeAPIAddr)}}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	defer func() {
		if t.Failed() {
			for _, l := range c.Logs() {
				t.Log(harness.Tail(l, 3000))
			}
		}
	}()
	step("control plane started", t0)
	api := c.Client
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))

	// The image's key, the node's root.
	t0 = time.Now()
	os.MkdirAll(filepath.Join(work, "key"), 0o700)
	priv, pub, err := manifest.GenerateKey(filepath.Join(work, "key"))
	if err != nil {
		t.Fatal(err)
	}
	// The fleet's key directory (--pub): the image's key, enrolled for this machine.
	keys := filepath.Join(work, "keys")
	enrol(t, priv, pub, keys, nodeUUID)
	refs := imageRefs(t, imagesDir)
	root := filepath.Join(work, "root")
	writeNodeRoot(t, root, nodeRootFiles{
		bootBuild: bootBuild, cpBin: cpBin, runtimeBin: runtimeBin, imagesDir: imagesDir, keys: keys, signingKey: priv,
		ca: c.CA, bootstrapToken: c.BootstrapToken, pause: refs["pause"],
	})
	disk := filepath.Join(work, "root.img")
	if err := qemutest.NewGPTDisk(disk, 2048, nodeRootPartUUID, nodeRootFSUUID, "root", root); err != nil {
		t.Fatal(err)
	}
	step("node root written", t0)

	// The node's plan, from a reference boot of the same machine without Secure Boot,
	// as an operator takes it for make uki PLAN=: under Secure Boot the kernel is locked
	// down, and only the plan's pci=config_acs= on the signed image's command line sets
	// the units' ACS (scenario 8's netboot, qemu-tests/README.md).
	t0 = time.Now()
	o := realNodeOptions(t, bootBuild, priv, disk, strings.TrimPrefix(c.Server, "https://"))
	o.Plan = referencePlan(t, ctx, o, filepath.Join(work, "reference"))
	step("reference boot: the node's plan", t0)

	// passage-control for the node's boot: its signed image approved, two replicas.
	t0 = time.Now()
	g := controlForGuest(t, ctx, c, work, 2, o, "--approve-grace", approveGrace.String())
	step("passage-control: image signed and approved, 2 replicas", t0)

	// The deploy files, with only the image set.
	t0 = time.Now()
	deployObjs := renderDeploy(t, work, map[string]string{"passage-dra": refs["passage-dra"], "passage-control": refs["passage-control"]}, "")
	apply(t, ctx, c, deployObjs, func(u *unstructured.Unstructured) bool {
		// passage-dra's objects. passage-control runs as the host's processes above (no
		// second node here runs its Deployment); its CRDs and RBAC, from the same files,
		// are controlForGuest's.
		return u.GetNamespace() == "passage-dra" || u.GetName() == "passage-dra"
	})
	// passage-control's CA, as the DaemonSet's comments tell the operator to give it.
	if _, err := api.CoreV1().ConfigMaps("passage-dra").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "passage-control-ca"},
		Data: map[string]string{"ca.crt": string(g.CA)}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The tenant's namespace; the controller-manager gives it its default account.
	if _, err := api.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	step("deploy files applied", t0)

	// The node: the approved image.
	o = g.Boot
	o.WorkDir = filepath.Join(work, "approved")
	n := startRealNode(t, ctx, o, "approved")
	t0 = time.Now()
	n.wait(t, ctx, "passage's handoff", 5*time.Minute, func() (bool, string) {
		_, ok := n.saw("NODE-INIT mounts")
		return ok, ""
	})
	step("guest netbooted under Secure Boot, attested, handed off", t0)
	if _, ok := n.saw("EFI stub: UEFI Secure Boot is enabled"); !ok {
		t.Fatalf("the approved image did not boot under Secure Boot; console %s", n.console)
	}
	m := verifiedBoot(t, ctx, dyn, n, pub)
	t0 = time.Now()
	n.wait(t, ctx, "containerd and kubelet started", 4*time.Minute, func() (bool, string) {
		_, ok := n.saw("NODE-READY")
		return ok, ""
	})
	step("containerd up, images imported, kubelet started", t0)
	t0 = time.Now()
	n.wait(t, ctx, "the node Ready", 4*time.Minute, func() (bool, string) { return nodeReady(ctx, api) })
	step("certificate approved, node registered and Ready", t0)
	csr := requestOfKey(t, ctx, api, c.BootstrapToken, m.Node.KubeletKey)
	if csr == nil || !certApproved(csr) || len(csr.Status.Certificate) == 0 {
		t.Fatalf("the kubelet's request for the boot's key %s: %+v", m.Node.KubeletKey, csr)
	}
	t.Logf("the kubelet's request %s by %s for key %s: %s", csr.Name, csr.Spec.Username, m.Node.KubeletKey, approvedBy(csr))

	// The kubelet runs the DaemonSet's pod; passage-dra registers with the kubelet
	// (plugins_registry) and publishes the node's units.
	t0 = time.Now()
	n.wait(t, ctx, "passage-dra's slices for "+nodeName, 5*time.Minute, func() (bool, string) {
		sl, err := nodeSlices(ctx, api)
		if err != nil {
			return false, err.Error()
		}
		k := 0
		for _, s := range sl {
			k += len(s.Spec.Devices)
		}
		return k > 0, fmt.Sprint(k, " devices; ", dsPodState(ctx, api))
	})
	step("passage-dra running, slices published", t0)
	// The class and a unit's template, rendered from the boot's manifest.
	v, err := resources.Verify(writeEnvelope(t, work, n.files()["manifest.dsse.json"]), resources.Source{Keys: keys, NodeUUID: m.Node.DMIUUID})
	if err != nil {
		t.Fatal(err)
	}
	objs, err := resources.Render(v, resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := api.ResourceV1().DeviceClasses().Create(ctx, objs.Class, metav1.CreateOptions{}); err != nil {
		t.Fatalf("DeviceClass: %v", err)
	}
	for _, tmpl := range objs.Templates {
		if _, err := api.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatalf("template %s: %v", tmpl.Name, err)
		}
	}

	// A pod with a unit: bound, prepared by the kubelet, started by containerd with the
	// CDI spec's device nodes.
	t0 = time.Now()
	template := objs.Shapes[0].TemplateName()
	createProbe(t, ctx, api, "probe-1", template, refs["vfio-probe"])
	first := n.probed(t, ctx, api, m, "probe-1")[0]
	step("pod with a unit ran", t0)

	// The pod is done: the kubelet unprepares its claim through passage-dra, whose
	// turnaround recycles the unit (erase, reset, a new generation signed and attested
	// to passage-control through passage.url, with the CA of the ConfigMap) and offers
	// it again once passage-control verified that generation. Two pods then take both
	// units at once: one of them is the recycled unit.
	t0 = time.Now()
	var recycled control.Node
	back := regexp.MustCompile(`turnaround ` + regexp.QuoteMeta(first) + `: back in generation (\d+) \(([^)]*)\)`)
	var backIn []string
	n.wait(t, ctx, "unit "+first+" recycled, its generation verified", 4*time.Minute, func() (bool, string) {
		l, ok := n.saw("turnaround " + first + ": back in generation ")
		if !ok {
			return false, "passage-dra has not said the unit is back"
		}
		if backIn = back.FindStringSubmatch(l); backIn == nil {
			t.Fatalf("passage-dra's line %q", l)
		}
		gen, _ := strconv.ParseInt(backIn[1], 10, 64)
		recycled = guestRecord(t, ctx, dyn, nodeName)
		return recycled.Status.Verdict == control.VerdictVerified && recycled.Status.Generation >= gen,
			fmt.Sprintf("record %s at generation %d (%s)", recycled.Status.Verdict, recycled.Status.Generation, recycled.Status.Reason)
	})
	t.Logf("unit %s back in generation %s (%s); record %s at generation %d", first, backIn[1], backIn[2], recycled.Status.Verdict, recycled.Status.Generation)
	step("unit released, recycled and verified", t0)
	t0 = time.Now()
	createProbe(t, ctx, api, "probe-2", template, refs["vfio-probe"])
	createProbe(t, ctx, api, "probe-3", template, refs["vfio-probe"])
	second := n.probed(t, ctx, api, m, "probe-2", "probe-3")
	if !slices.Contains(second, first) || second[0] == second[1] {
		t.Fatalf("after the recycle of %s, the two pods got units %v", first, second)
	}
	t.Logf("the next two pods got units %v", second)
	step("the recycled unit to a second pod", t0)

	// A mistake in the deploy files is named by the kubelet's own words: the
	// DaemonSet's plugin registry at a path the kubelet does not watch (and that is
	// not there) never mounts, and the wait for its slices says why.
	t0 = time.Now()
	if err := api.AppsV1().DaemonSets("passage-dra").Delete(ctx, "passage-dra", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n.wait(t, ctx, "passage-dra's pods gone", 2*time.Minute, func() (bool, string) {
		l, err := api.CoreV1().Pods("passage-dra").List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0, fmt.Sprint(err)
	})
	mutant := renderDeploy(t, filepath.Join(work, "mutant"), map[string]string{"passage-dra": refs["passage-dra"], "passage-control": refs["passage-control"]}, `patches:
- patch: |-
    apiVersion: apps/v1
    kind: DaemonSet
    metadata: {name: passage-dra, namespace: passage-dra}
    spec:
      template:
        spec:
          volumes:
          - name: registry
            hostPath: {path: /var/lib/kubelet/plugins-registry, type: Directory}
`)
	apply(t, ctx, c, mutant, func(u *unstructured.Unstructured) bool { return u.GetKind() == "DaemonSet" })
	var said string
	n.wait(t, ctx, "the kubelet's word on the mutated registry directory", 3*time.Minute, func() (bool, string) {
		said = dsPodState(ctx, api)
		return strings.Contains(said, "hostPath type check failed") && strings.Contains(said, "/var/lib/kubelet/plugins-registry"), said
	})
	t.Logf("registry directory mutated: the wait for slices would say: %s", said)
	step("deploy mutation named by the kubelet", t0)

	// The same node reboots into an image the operator did not approve: the same kernel
	// and initramfs with one kernel argument more, signed by the same db key, which the
	// firmware runs and measures. It attests through the other replica (they share the
	// exchange key). A pod for a unit is created as the node goes down.
	t0 = time.Now()
	before, err := nodeSlices(ctx, api)
	if err != nil {
		t.Fatal(err)
	}
	n.stop()
	createProbe(t, ctx, api, "probe-reboot", template, refs["vfio-probe"])
	o = g.Boot
	o.WorkDir = filepath.Join(work, "unapproved")
	o.Append = append(slices.Clone(o.Append), "build=unapproved")
	o.NetBoot = &qemutest.NetBoot{}
	o.Forward = g.ForwardTo(1)
	n = startRealNode(t, ctx, o, "unapproved")
	n.wait(t, ctx, "the unapproved boot's kubelet started", 6*time.Minute, func() (bool, string) {
		_, ok := n.saw("NODE-READY")
		return ok, ""
	})
	step("reboot into an unapproved image, kubelet started", t0)
	other, err := approveImage(filepath.Join(o.WorkDir, "tftp", "passage.efi"), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	rec := guestRecord(t, ctx, dyn, nodeName)
	ver := bootManifest(t, n.files()["manifest.dsse.json"], rec)
	wantWhy := fmt.Sprintf("an image that is not approved was loaded (Authenticode sha256 %x)", []byte(other.Authenticode[0]))
	if rec.Status.Verdict != control.VerdictFailed || rec.Status.Generation != int64(ver.Manifest.Generation) ||
		!strings.Contains(rec.Status.Reason, "PCR 4") || !strings.Contains(rec.Status.Reason, wantWhy) {
		t.Fatalf("record %s after the unapproved boot: %s at generation %d (%s); the boot's manifest: generation %d; want %s naming PCR 4: %s",
			nodeName, rec.Status.Verdict, rec.Status.Generation, rec.Status.Reason, ver.Manifest.Generation, control.VerdictFailed, wantWhy)
	}
	r, err := api.ResourceV1().DeviceTaintRules().Get(ctx, control.RuleName(nodeName), metav1.GetOptions{})
	if err != nil || r.Spec.Taint.Key != control.TaintFailed || r.Spec.Taint.Effect != resourceapi.DeviceTaintEffectNoExecute {
		t.Fatalf("rule of %s after the unapproved boot: %v %+v", nodeName, err, r)
	}
	t.Logf("unapproved image: record %s %s at generation %d: %s; rule %s %s:%s", nodeName,
		rec.Status.Verdict, rec.Status.Generation, rec.Status.Reason, r.Name, r.Spec.Taint.Key, r.Spec.Taint.Effect)
	// Its kubelet asks for a certificate for the key this boot made; no replica approves
	// it, past the grace after which any replica judges any request. It writes no
	// slice, and the pod created as the node went down never starts.
	pending, waited := n.neverApproved(t, ctx, api, c.BootstrapToken, ver.Manifest.Node.KubeletKey)
	where := n.nothingRuns(t, ctx, api, before)
	t.Logf("unapproved boot: its request %s pending %.0f s, no condition; slices unchanged; probe-reboot %s", pending.Name, waited.Seconds(), where)
	step("unapproved boot: no certificate, no slice, no pod", t0)

	// The approved image again, with passage-control out of reach (its address joined
	// to a port nothing listens on): a boot that never attests. The record keeps the
	// last verdict; its kubelet's request stays pending; it writes nothing.
	t0 = time.Now()
	last := guestRecord(t, ctx, dyn, nodeName)
	n.stop()
	o = g.Boot
	o.WorkDir = filepath.Join(work, "unattested")
	o.Forward = g.ForwardTo(0)
	o.Forward[guestControlAddr+":443"] = fmt.Sprintf("127.0.0.1:%d", freePorts(t, 1)[0])
	n = startRealNode(t, ctx, o, "unattested")
	n.wait(t, ctx, "the unattested boot's kubelet started", 6*time.Minute, func() (bool, string) {
		_, ok := n.saw("NODE-READY")
		return ok, ""
	})
	step("reboot, passage-control out of reach, kubelet started", t0)
	unattested := imageManifest(t, n, pub)
	pending, waited = n.neverApproved(t, ctx, api, c.BootstrapToken, unattested.Node.KubeletKey)
	where = n.nothingRuns(t, ctx, api, before)
	if rec := guestRecord(t, ctx, dyn, nodeName); rec.Status.Verdict != last.Status.Verdict || rec.Status.Generation != last.Status.Generation {
		t.Fatalf("record %s after a boot that never attested: %s at generation %d, before it %s at %d", nodeName,
			rec.Status.Verdict, rec.Status.Generation, last.Status.Verdict, last.Status.Generation)
	}
	t.Logf("unattested boot (generation %d): record still %s at generation %d; its request %s pending %.0f s; slices unchanged; probe-reboot %s",
		unattested.Generation, last.Status.Verdict, last.Status.Generation, pending.Name, waited.Seconds(), where)
	step("unattested boot: no certificate, no slice, no pod", t0)

	// Rebooted into the approved image with passage-control in reach: verified, its
	// kubelet's new key approved, the Node Ready again. The DaemonSet restored, the pod
	// created during the unapproved boot runs now, on a unit of this boot.
	t0 = time.Now()
	n.stop()
	o = g.Boot
	o.WorkDir = filepath.Join(work, "approved-again")
	n = startRealNode(t, ctx, o, "approved again")
	n.wait(t, ctx, "the approved boot's kubelet started", 6*time.Minute, func() (bool, string) {
		_, ok := n.saw("NODE-READY")
		return ok, ""
	})
	again := verifiedBoot(t, ctx, dyn, n, pub)
	n.wait(t, ctx, "the node Ready again", 4*time.Minute, func() (bool, string) {
		r := requestOfKey(t, ctx, api, c.BootstrapToken, again.Node.KubeletKey)
		if r == nil || !certApproved(r) {
			return false, "the request for " + again.Node.KubeletKey + " not approved"
		}
		return nodeReady(ctx, api)
	})
	step("reboot into the approved image: verified, joined, Ready", t0)
	t0 = time.Now()
	if err := api.AppsV1().DaemonSets("passage-dra").Delete(ctx, "passage-dra", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n.wait(t, ctx, "the mutated DaemonSet's pods gone", 2*time.Minute, func() (bool, string) {
		l, err := api.CoreV1().Pods("passage-dra").List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0, fmt.Sprint(err)
	})
	apply(t, ctx, c, deployObjs, func(u *unstructured.Unstructured) bool { return u.GetKind() == "DaemonSet" })
	got := n.probed(t, ctx, api, again, "probe-reboot")
	t.Logf("probe-reboot, created during the unapproved boot, ran on the approved boot's unit %s", got[0])
	step("DaemonSet restored, the waiting pod ran", t0)
	step("TestRealNode", began)
}

// createProbe creates a vfio-probe pod whose claim comes from template.
func createProbe(t *testing.T, ctx context.Context, api *kubernetes.Clientset, name, template, image string) {
	t.Helper()
	if _, err := api.CoreV1().Pods(ns).Create(ctx, probePod(name, template, image), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// probed waits for the probe pods names to succeed, watching them together (a claim
// made from a template goes with its pod once the pod is done, so each pod's allocation
// is read while it runs), and holds what each saw to its unit: /dev/vfio exactly that
// unit's IOMMU groups and vfio. It returns the units' IDs, in names' order.
func (n *realNode) probed(t *testing.T, ctx context.Context, api *kubernetes.Clientset, m *manifest.Manifest, names ...string) []string {
	t.Helper()
	msg := map[string]string{}
	cl := map[string]*resourceapi.ResourceClaim{}
	n.wait(t, ctx, strings.Join(names, ", ")+" done", 4*time.Minute, func() (bool, string) {
		done := true
		var seen []string
		for _, name := range names {
			p, err := api.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			for _, st := range p.Status.ResourceClaimStatuses {
				if cl[name] == nil && st.ResourceClaimName != nil {
					c, err := api.ResourceV1().ResourceClaims(ns).Get(ctx, *st.ResourceClaimName, metav1.GetOptions{})
					if err == nil && c.Status.Allocation != nil {
						cl[name] = c
					}
				}
			}
			if p.Status.Phase == corev1.PodFailed {
				t.Fatalf("%s failed: %+v", name, p.Status)
			}
			for _, s := range p.Status.ContainerStatuses {
				if s.State.Terminated != nil {
					msg[name] = s.State.Terminated.Message
				}
			}
			done = done && p.Status.Phase == corev1.PodSucceeded
			seen = append(seen, fmt.Sprintf("%s: %s %s", name, p.Status.Phase, podWhy(p)))
		}
		return done, strings.Join(seen, "; ")
	})
	var ids []string
	for _, name := range names {
		if cl[name] == nil {
			t.Fatalf("%s ran, its allocated claim never seen", name)
		}
		unit := claimUnit(t, cl[name], m)
		want := []string{"vfio"}
		for _, f := range unit.Functions {
			g := strconv.Itoa(f.IOMMUGroup)
			if !slices.Contains(want, g) {
				want = append(want, g)
			}
		}
		got := vfioNames(msg[name])
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("%s (unit %s) saw /dev/vfio %v, want %v (the unit's groups and vfio); it said:\n%s", name, unit.ID, got, want, msg[name])
		}
		t.Logf("%s got unit %s: /dev/vfio %v", name, unit.ID, got)
		ids = append(ids, string(unit.ID))
	}
	return ids
}

// neverApproved waits for the kubelet's request for key (the boot's, from its
// manifest), then holds it pending, with no condition and no certificate, past twice
// the grace after which every replica judges every request. It returns the request and
// how long it was seen pending.
func (n *realNode) neverApproved(t *testing.T, ctx context.Context, api *kubernetes.Clientset, token, key string) (*certificatesv1.CertificateSigningRequest, time.Duration) {
	t.Helper()
	var r *certificatesv1.CertificateSigningRequest
	n.wait(t, ctx, "the kubelet's certificate request for "+key, 2*time.Minute, func() (bool, string) {
		r = requestOfKey(t, ctx, api, token, key)
		return r != nil, "none yet"
	})
	asked := time.Now()
	time.Sleep(2*approveGrace + 5*time.Second)
	r = requestOfKey(t, ctx, api, token, key)
	if r == nil || certApproved(r) || len(r.Status.Certificate) != 0 || len(r.Status.Conditions) != 0 {
		t.Fatalf("the kubelet's request for %s, %.0f s after it was made: %+v", key, time.Since(asked).Seconds(), r)
	}
	return r, time.Since(asked)
}

// nothingRuns holds a boot without credentials to what it cannot do: the node's slices
// are those before (no write: the same resourceVersions) and probe-reboot, the pod
// created as the node went down, has started no container. It says where that pod is.
func (n *realNode) nothingRuns(t *testing.T, ctx context.Context, api *kubernetes.Clientset, before []resourceapi.ResourceSlice) string {
	t.Helper()
	after, err := nodeSlices(ctx, api)
	if err != nil {
		t.Fatal(err)
	}
	if !sameSlices(before, after) {
		t.Fatalf("a boot without credentials published: slices before %v, after %v", sliceVersions(before), sliceVersions(after))
	}
	p, err := api.CoreV1().Pods(ns).Get(ctx, "probe-reboot", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p.Status.Phase != corev1.PodPending || len(p.Status.ContainerStatuses) != 0 {
		t.Fatalf("probe-reboot, created as the node went down: %s %s", p.Status.Phase, podWhy(p))
	}
	return fmt.Sprintf("%s on node %q (%s)", p.Status.Phase, p.Spec.NodeName, podWhy(p))
}

// imageManifest is the boot's manifest verified with the image's key.
func imageManifest(t *testing.T, n *realNode, pub string) *manifest.Manifest {
	t.Helper()
	v, err := manifest.LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	ver, err := manifest.Verify(n.files()["manifest.dsse.json"], v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatalf("the boot's manifest: %v", err)
	}
	return ver.Manifest
}

// approveGrace is the replicas' --approve-grace: how long past a request's creation any
// replica judges it, not only the one that verified its boot.
const approveGrace = 5 * time.Second

// verifiedBoot holds the boot's record to its manifest: verified at the manifest's
// generation and digest, enrolled, the kubelet key the manifest carries, attested over
// the replica's nonce. It returns the manifest, verified with the image's key.
func verifiedBoot(t *testing.T, ctx context.Context, dyn dynamic.Interface, n *realNode, pub string) *manifest.Manifest {
	t.Helper()
	env := n.files()["manifest.dsse.json"]
	rec := guestRecord(t, ctx, dyn, nodeName)
	ver := bootManifest(t, env, rec)
	if rec.Status.Verdict != control.VerdictVerified || rec.Status.Generation != int64(ver.Manifest.Generation) ||
		rec.Status.Digest != manifest.Digest(ver.Payload) || rec.Status.KubeletKey == "" || rec.Status.KubeletKey != ver.Manifest.Node.KubeletKey {
		t.Fatalf("record %s after the approved boot: %s at generation %d (%s), digest %s, kubelet key %q; the boot's manifest: generation %d, %s, kubelet key %q; stages not ok:\n%s",
			nodeName, rec.Status.Verdict, rec.Status.Generation, rec.Status.Reason, rec.Status.Digest, rec.Status.KubeletKey,
			ver.Manifest.Generation, manifest.Digest(ver.Payload), ver.Manifest.Node.KubeletKey, notOK(n.text()))
	}
	if rec.Spec.Enrolled == nil || rec.Spec.Node != nodeName {
		t.Fatalf("record %s: not enrolled by the boot: %+v", nodeName, rec.Spec)
	}
	a, err := attest.ParseAttestation(n.files()["manifest.dsse.json"+attest.Suffix])
	if err != nil {
		t.Fatalf("the approved boot's attestation: %v", err)
	}
	if a.NonceSource != attest.NonceControlPlane {
		t.Fatalf("the approved boot's attestation: nonce from %q, want the control plane's", a.NonceSource)
	}
	// The image's own key signed it too: passage-dra verifies the manifest with it.
	imageManifest(t, n, pub)
	t.Logf("approved image: record %s %s at generation %d (%s), kubelet key %s; the guest's publish stage:\n%s", nodeName,
		rec.Status.Verdict, rec.Status.Generation, rec.Status.Reason, rec.Status.KubeletKey, stageLines(n.text(), "publish"))
	return ver.Manifest
}

// nodeReady is the Node's Ready condition, for a wait.
func nodeReady(ctx context.Context, api *kubernetes.Clientset) (bool, string) {
	no, err := api.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return false, err.Error()
	}
	for _, cond := range no.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			return cond.Status == corev1.ConditionTrue, cond.Reason + ": " + cond.Message
		}
	}
	return false, "no Ready condition"
}

// requestOfKey is the kubelet client certificate request of the key whose digest is
// key, made by the bootstrap token's user; nil if there is none.
func requestOfKey(t *testing.T, ctx context.Context, api *kubernetes.Clientset, token, key string) *certificatesv1.CertificateSigningRequest {
	t.Helper()
	l, err := api.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	user := "system:bootstrap:" + strings.SplitN(token, ".", 2)[0]
	for i, r := range l.Items {
		if r.Spec.SignerName != control.KubeletSigner || r.Spec.Username != user {
			continue
		}
		b, _ := pem.Decode(r.Spec.Request)
		if b == nil {
			continue
		}
		cr, err := x509.ParseCertificateRequest(b.Bytes)
		if err == nil && kubeletkey.DigestSPKI(cr.RawSubjectPublicKeyInfo) == key {
			return &l.Items[i]
		}
	}
	return nil
}

func certApproved(r *certificatesv1.CertificateSigningRequest) bool {
	for _, c := range r.Status.Conditions {
		if c.Type == certificatesv1.CertificateApproved && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

func approvedBy(r *certificatesv1.CertificateSigningRequest) string {
	var out []string
	for _, c := range r.Status.Conditions {
		out = append(out, fmt.Sprintf("%s (%s: %s)", c.Type, c.Reason, c.Message))
	}
	return strings.Join(out, "; ")
}

// nodeSlices are passage-dra's ResourceSlices of the node.
func nodeSlices(ctx context.Context, api *kubernetes.Clientset) ([]resourceapi.ResourceSlice, error) {
	sl, err := api.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var out []resourceapi.ResourceSlice
	for _, s := range sl.Items {
		if s.Spec.Driver == resources.DriverName && s.Spec.NodeName != nil && *s.Spec.NodeName == nodeName {
			out = append(out, s)
		}
	}
	return out, nil
}

// sliceVersions names each slice with its resourceVersion: a write changes it.
func sliceVersions(sl []resourceapi.ResourceSlice) []string {
	var out []string
	for _, s := range sl {
		out = append(out, s.Name+"@"+s.ResourceVersion)
	}
	slices.Sort(out)
	return out
}

func sameSlices(a, b []resourceapi.ResourceSlice) bool {
	return slices.Equal(sliceVersions(a), sliceVersions(b))
}

// dsPodState is what passage-dra's pods are doing, for a wait's message.
func dsPodState(ctx context.Context, api *kubernetes.Clientset) string {
	l, err := api.CoreV1().Pods("passage-dra").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, p := range l.Items {
		out = append(out, fmt.Sprintf("%s on %q: %s %s%s", p.Name, p.Spec.NodeName, p.Status.Phase, podWhy(&p), podEvents(ctx, api, &p)))
	}
	return fmt.Sprint(out)
}

// podEvents are the warnings the kubelet and the scheduler gave the pod (a volume
// that does not mount, a sandbox that does not start), newest last.
func podEvents(ctx context.Context, api *kubernetes.Clientset, p *corev1.Pod) string {
	ev, err := api.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name})
	if err != nil {
		return "; events: " + err.Error()
	}
	var out []string
	for _, e := range ev.Items {
		if e.Type == corev1.EventTypeWarning {
			out = append(out, e.Reason+": "+e.Message)
		}
	}
	if len(out) == 0 {
		return ""
	}
	return "; warnings: " + strings.Join(out[max(0, len(out)-3):], " | ")
}

func podWhy(p *corev1.Pod) string {
	var out []string
	for _, c := range p.Status.Conditions {
		if c.Status != corev1.ConditionTrue && c.Message != "" {
			out = append(out, string(c.Type)+": "+c.Message)
		}
	}
	for _, s := range p.Status.ContainerStatuses {
		if s.State.Waiting != nil {
			out = append(out, s.State.Waiting.Reason+": "+s.State.Waiting.Message)
		}
	}
	return strings.Join(out, "; ")
}

// claimUnit is the manifest unit whose functions the claim was allocated.
func claimUnit(t *testing.T, cl *resourceapi.ResourceClaim, m *manifest.Manifest) manifest.Unit {
	t.Helper()
	var got []string
	for _, r := range cl.Status.Allocation.Devices.Results {
		got = append(got, r.Device)
	}
	slices.Sort(got)
	for _, u := range m.Units {
		var want []string
		for _, f := range u.Functions {
			want = append(want, resources.DeviceName(u.ID, f.BDF))
		}
		slices.Sort(want)
		if slices.Equal(got, want) {
			return u
		}
	}
	t.Fatalf("claim %s: devices %v are no unit of the manifest", cl.Name, got)
	return manifest.Unit{}
}

// vfioNames are the names vfio-probe listed: after its "/dev/vfio: N entries" line,
// one "NAME TYPE MAJ:MIN" line each.
func vfioNames(msg string) []string {
	var out []string
	for _, l := range strings.Split(msg, "\n") {
		if f := strings.Fields(l); len(f) == 3 && !strings.HasPrefix(f[0], "/") {
			out = append(out, f[0])
		}
	}
	slices.Sort(out)
	return out
}

func probePod(name, template, image string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PodSpec{
		RestartPolicy:  corev1.RestartPolicyNever,
		ResourceClaims: []corev1.PodResourceClaim{{Name: "unit", ResourceClaimTemplateName: &template}},
		NodeSelector:   map[string]string{"kubernetes.io/hostname": nodeName},
		Containers: []corev1.Container{{Name: "probe", Image: image, ImagePullPolicy: corev1.PullNever,
			Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "unit"}}}}},
	}}
}

func writeEnvelope(t *testing.T, work string, b []byte) string {
	p := filepath.Join(work, "manifest.dsse.json")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// imageRefs are the images' digest references by name: make images names each
// passage.test/<name> in its .oci.tar and writes its digest beside it; nodeinit imports
// them with ctr's --digests, which names each image by its digest too.
func imageRefs(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, name := range []string{"passage-dra", "passage-control", "pause", "vfio-probe"} {
		b, err := os.ReadFile(filepath.Join(dir, name+".digest"))
		if err != nil {
			t.Fatalf("image %s: %v (make images writes it)", name, err)
		}
		out[name] = "passage.test/" + name + "@" + strings.TrimSpace(string(b))
	}
	return out
}

// renderDeploy is `kubectl kustomize` of an operator's overlay of kube/deploy that sets
// only the images (registry and digest, as the README's Deploy tells): kustomize's own
// code, as kubectl runs it (krusty, legacy order). extra is more of the overlay's
// kustomization.yaml (a patch a mutation test makes).
func renderDeploy(t *testing.T, work string, images map[string]string, extra string) []*unstructured.Unstructured {
	t.Helper()
	dir := filepath.Join(work, "overlay")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	here, err := filepath.Abs(filepath.Join("..", "deploy"))
	if err != nil {
		t.Fatal(err)
	}
	// kustomize takes a base only by a relative path.
	base, err := filepath.Rel(dir, here)
	if err != nil {
		t.Fatal(err)
	}
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [" + base + "]\nimages:\n"
	for _, name := range slices.Sorted(maps.Keys(images)) {
		ref := images[name]
		repo, digest, ok := strings.Cut(ref, "@")
		if !ok {
			t.Fatalf("image %s: %q is no digest reference", name, ref)
		}
		k += fmt.Sprintf("- {name: %s, newName: %s, digest: %s}\n", name, repo, digest)
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k+extra), 0o644); err != nil {
		t.Fatal(err)
	}
	o := krusty.MakeDefaultOptions()
	o.Reorder = krusty.ReorderOptionLegacy
	m, err := krusty.MakeKustomizer(o).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build: %v", err)
	}
	var out []*unstructured.Unstructured
	for _, r := range m.Resources() {
		obj, err := r.Map()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, &unstructured.Unstructured{Object: obj})
	}
	return out
}

// apply creates the objects in order with the admin's credentials, as `kubectl apply`
// creates what does not exist; keep says which to create.
func apply(t *testing.T, ctx context.Context, c *harness.Cluster, objs []*unstructured.Unstructured, keep func(*unstructured.Unstructured) bool) {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))
	for _, u := range objs {
		if !keep(u) {
			continue
		}
		gvk := u.GroupVersionKind()
		var mp *meta.RESTMapping
		var err error
		// A CRD created a moment ago is served after discovery sees it.
		waitFor(t, ctx, 30*time.Second, "the API of "+gvk.String(), func() (bool, string) {
			mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(c.Client.Discovery()))
			mp, err = mapper.RESTMapping(schema.GroupKind{Group: gvk.Group, Kind: gvk.Kind}, gvk.Version)
			return err == nil, fmt.Sprint(err)
		})
		var ri dynamic.ResourceInterface = dyn.Resource(mp.Resource)
		if mp.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = dyn.Resource(mp.Resource).Namespace(u.GetNamespace())
		}
		if _, err := ri.Create(ctx, u, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create %s %s/%s: %v", gvk.Kind, u.GetNamespace(), u.GetName(), err)
		}
	}
}

// realNodeOptions boot the real node: passage as the suite boots it, switching to the
// disk's root, whose init is nodeinit; the kubelet reaches the API server at
// nodeAPIAddr. The control plane's part (the image, the TPM, passage.url) is
// controlForGuest's.
func realNodeOptions(t *testing.T, build, key, disk, apiServer string) qemutest.Options {
	// Each unit's NVMe has a namespace (a sparse image beside the root's): the
	// turnaround erases it and reads the erase back.
	var units []string
	for i := range 2 {
		img := filepath.Join(filepath.Dir(disk), fmt.Sprintf("unit%d-nvme.img", i))
		if err := os.WriteFile(img, nil, 0o644); err != nil || os.Truncate(img, 64<<20) != nil {
			t.Fatalf("unit %d's NVMe image: %v", i, err)
		}
		units = append(units, img)
	}
	return qemutest.Options{
		Build: build, Key: key, NVMe: []string{disk}, Name: "TestRealNode",
		Topology: qemutest.Topology{NVMeImages: units},
		Overlay:  []qemutest.OverlayFile{{Name: strings.TrimPrefix(nodeProfile, "/"), Data: noFabricProfile(t)}},
		Timeout:  20 * time.Minute, MemMiB: 4096, UUID: nodeUUID,
		Append: []string{
			"rdinit=/bbin/passage",
			"passage.handoff=switch_root", "passage.root=UUID=" + nodeRootFSUUID, "passage.rootfstype=ext4",
			"passage.profile=" + nodeProfile,
			"passage.host_modules=e1000e,nvme,crc32c_generic,ext4",
		},
		Forward: map[string]string{nodeAPIAddr + ":443": apiServer},
	}
}

// referencePlan boots o once with qemu-tests' preflight as its uinit, which saves
// `passage plan --out` of the machine, and powers off: the plan (decision.ImageArgs:
// its pci=config_acs= and passage.plan=) that o's image then carries.
func referencePlan(t *testing.T, ctx context.Context, o qemutest.Options, work string) []byte {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "preflight")
	build := exec.Command("go", "build", "-trimpath", "-o", bin, "github.com/passage-boot/passage/qemu-tests/internal/preflight")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build preflight: %v\n%s", err, out)
	}
	uinit, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	o.WorkDir = work
	o.Name += " (reference boot)"
	o.Overlay = append(slices.Clone(o.Overlay), qemutest.OverlayFile{Name: "bbin/uinit", Data: uinit, Mode: 0o755})
	// u-root's init runs the uinit (rdinit=/bbin/passage would skip it).
	o.Append = slices.DeleteFunc(slices.Clone(o.Append), func(a string) bool { return strings.HasPrefix(a, "rdinit=") })
	o.Append = append(o.Append, "passage.net=off", "passage.handoff=poweroff")
	o.Timeout = 5 * time.Minute
	run, err := qemutest.Boot(ctx, o)
	if err != nil {
		t.Fatalf("reference boot: %v; console end:\n%s", err, harness.Tail(filepath.Join(work, "console.log"), 4000))
	}
	plan := run.Files["preflight-plan.saved.json"]
	if len(plan) == 0 {
		t.Fatalf("the reference boot saved no plan (plan --out: %s)", run.Files["preflight-saveplan.exit"])
	}
	return plan
}

// startRealNode boots o in the background, the console read as it comes. The guest
// runs until stop or the test's end; name heads its console where PASSAGE_NODE_CONSOLE
// keeps it.
func startRealNode(t *testing.T, ctx context.Context, o qemutest.Options, name string) *realNode {
	t.Helper()
	n := &realNode{parser: emit.NewParser(time.Now), done: make(chan struct{}), began: time.Now()}
	bctx, stop := context.WithCancel(ctx)
	n.console = filepath.Join(o.WorkDir, "console.log")
	o.Console = func(line string, _ io.Writer) bool {
		n.mu.Lock()
		n.lines = append(n.lines, line)
		n.parser.Line(line)
		n.mu.Unlock()
		return false
	}
	go func() {
		defer close(n.done)
		n.run, n.err = qemutest.Boot(bctx, o)
	}()
	var once sync.Once
	n.stop = func() {
		once.Do(func() {
			stop()
			<-n.done
			// The console outlives the test's directory where make node-test asks.
			if keep := os.Getenv("PASSAGE_NODE_CONSOLE"); keep != "" {
				if b, err := os.ReadFile(n.console); err == nil {
					if f, err := os.OpenFile(keep, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644); err == nil {
						fmt.Fprintf(f, "==== boot %q ====\n", name)
						f.Write(b)
						f.Close()
					}
				}
			}
		})
	}
	t.Cleanup(n.stop)
	return n
}

// wait is waitFor with the node's last words: it fails at once when the guest ends or
// nodeinit fails, and a wait that times out says what the console said last.
func (n *realNode) wait(t *testing.T, ctx context.Context, what string, d time.Duration, cond func() (bool, string)) {
	t.Helper()
	waitFor(t, ctx, d, what, func() (bool, string) {
		ok, seen := cond()
		if ok {
			return true, seen
		}
		select {
		case <-n.done:
			t.Fatalf("%s: the guest ended (%v); console %s, its end:\n%s", what, n.err, n.console, n.tail(80))
		default:
		}
		if l, bad := n.saw("NODE-INIT failed"); bad {
			t.Fatalf("%s: %s; console %s, its end:\n%s", what, l, n.console, n.tail(80))
		}
		return false, fmt.Sprintf("%s; console %s, its end:\n%s", seen, n.console, n.tail(80))
	})
}

// nodeProfile is the real node's profile in its initramfs (Options.Overlay).
const nodeProfile = "/etc/passage/profiles/real-node.yaml"

// noFabricProfile is the suite's qemu profile without its Module IDs and NVLink
// partitions: the guest has no NVSwitch and no Fabric Manager, and says so in its
// manifest, so passage-dra opens no FM and prepares each unit alone, as on any node
// without NVLink (plugin.fabricFor). With them it would, rightly, prepare no claim
// without FM's partition.
func noFabricProfile(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "topology", "profiles", "qemu.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	// The two top-level keys dropped as text: the profile's IDs are hex, which a YAML
	// round trip would turn into decimal numbers.
	var out []string
	skip := false
	for _, l := range strings.Split(string(b), "\n") {
		top := l != "" && l[0] != ' ' && l[0] != '#' && l[0] != '-'
		if top {
			skip = strings.HasPrefix(l, "modules:") || strings.HasPrefix(l, "nvlink_partitions:")
		}
		if strings.HasPrefix(l, "name: ") {
			l = "name: real-node"
		}
		if !skip {
			out = append(out, l)
		}
	}
	return []byte(strings.Join(out, "\n"))
}

// nodeRootFiles are what the node's root is made of.
type nodeRootFiles struct {
	bootBuild, cpBin, runtimeBin, imagesDir, keys string
	signingKey                                    string // the image's ed25519 private key
	ca                                            []byte
	bootstrapToken, pause                         string
}

// writeNodeRoot lays out the real node's root file system in dir.
func writeNodeRoot(t *testing.T, dir string, f nodeRootFiles) {
	t.Helper()
	mk := func(p string, mode os.FileMode, b []byte) {
		t.Helper()
		p = filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, mode); err != nil {
			t.Fatal(err)
		}
	}
	cp := func(src, dst string) {
		t.Helper()
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		mk(dst, 0o755, b)
	}
	for _, d := range []string{"proc", "sys", "dev", "run", "tmp", "var/lib/containerd", "var/lib/kubelet/plugins",
		"var/lib/kubelet/plugins_registry", "var/run/cdi", "etc/cdi", "etc/passage/keys", "usr/lib/x86_64-linux-gnu",
		"var/log", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// nodeinit, static.
	build := exec.Command("go", "build", "-o", filepath.Join(dir, "sbin", "init"), "github.com/passage-boot/passage/kube/internal/realnode/nodeinit")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build nodeinit: %v\n%s", err, out)
	}
	cp(filepath.Join(f.cpBin, "kubelet"), "usr/bin/kubelet")
	for _, b := range []string{"containerd", "containerd-shim-runc-v2", "ctr", "runc"} {
		cp(filepath.Join(f.runtimeBin, b), "usr/bin/"+b)
	}
	for _, b := range []string{"ptp", "host-local", "loopback"} {
		cp(filepath.Join(f.runtimeBin, b), "opt/cni/bin/"+b)
	}
	// The kubelet mounts a pod's volumes (tmpfs, bind) with mount(8) and reads mounts
	// with findmnt(8), as on every node: util-linux's, this Debian's, with the libraries
	// and loader they link.
	for _, b := range []string{"/usr/bin/mount", "/usr/bin/umount", "/usr/bin/findmnt"} {
		cp(b, b[1:])
		for _, lib := range sharedLibs(t, b) {
			cp(lib, lib[1:])
		}
	}
	// The fleet's keys: passage-dra verifies the boot's manifest with them.
	ents, err := os.ReadDir(f.keys)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(f.keys, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		mk("etc/passage/keys/"+e.Name(), 0o644, b)
	}
	for _, name := range []string{"passage-dra", "pause", "vfio-probe"} {
		cp(filepath.Join(f.imagesDir, name+".oci.tar"), "images/"+name+".tar")
	}
	// The image's signing key, for the generations passage-dra's turnaround signs
	// beside the TPM's: the fleet's key directory holds its enrolment, not the TPM's.
	if f.signingKey != "" {
		b, err := os.ReadFile(f.signingKey)
		if err != nil {
			t.Fatal(err)
		}
		mk("etc/passage/key", 0o600, b)
	}
	// The profile the boot's command line names by path, where the boot read it in its
	// initramfs: passage-dra's turnaround reads it there on the host's root.
	mk(strings.TrimPrefix(nodeProfile, "/"), 0o644, noFabricProfile(t))
	mk("etc/resolv.conf", 0o644, []byte("nameserver 10.0.2.3\n"))
	mk("etc/hosts", 0o644, []byte("127.0.0.1 localhost\n"))
	mk("etc/machine-id", 0o444, []byte("5e1f2c3a0b6d4c1e9a572f0d3b8e4a61\n"))
	mk("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/sbin/nologin\n"))
	mk("etc/group", 0o644, []byte("root:x:0:\n"))
	mk("etc/kubernetes/ca.crt", 0o644, f.ca)
	// No credential of the node's own: a bootstrap token, which may ask for a
	// certificate and nothing more. The kubelet's key is the boot's (initramfs/kubelet,
	// in its --cert-dir), and its kubeconfig and certificate are written beside it, on
	// the tmpfs a reboot erases.
	mk("etc/kubernetes/bootstrap-kubelet.conf", 0o600, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: "https://%s:443", certificate-authority: /etc/kubernetes/ca.crt}}]
users: [{name: kubelet-bootstrap, user: {token: %q}}]
contexts: [{name: e2e, context: {cluster: e2e, user: kubelet-bootstrap}}]
current-context: e2e
`, nodeAPIAddr, f.bootstrapToken)))
	mk("etc/kubernetes/kubelet.args", 0o644, []byte(strings.Join([]string{
		"--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf",
		"--kubeconfig=" + filepath.Join(kubeletkey.CertDir, "kubelet.conf"),
		"--cert-dir=" + kubeletkey.CertDir,
		"--node-ip=" + nodeIP,
		"--hostname-override=" + nodeName,
		"--node-labels=passage-boot.github.io/node=true",
		"--v=0",
	}, "\n")+"\n"))
	mk("var/lib/kubelet/config.yaml", 0o644, []byte(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
resolvConf: /etc/resolv.conf
# A test disk: eviction would take the node's pods for a small free space.
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 10s
# The boot's key is the only one the kubelet holds: rotation would make another,
# which no boot attested (initramfs/kubelet).
rotateCertificates: false
serializeImagePulls: false
`))
	mk("etc/cni/net.d/10-passage.conflist", 0o644, []byte(`{
  "cniVersion": "1.0.0",
  "name": "passage-node",
  "plugins": [{"type": "ptp", "ipMasq": false,
    "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]], "routes": [{"dst": "0.0.0.0/0"}]}}]
}
`))
	mk("etc/containerd/config.toml", 0o644, []byte(fmt.Sprintf(`version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %q
[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      SystemdCgroup = false
      BinaryName = "/usr/bin/runc"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/opt/cni/bin"]
    conf_dir = "/etc/cni/net.d"
`, f.pause)))
	writeModules(t, f.bootBuild, dir)
}

// enrol puts the image's public key in the fleet's key directory with its enrolment
// for the machine of the given SMBIOS UUID, as an operator enrols a node's key.
func enrol(t *testing.T, priv, pub, keys, uuid string) {
	t.Helper()
	signer, err := manifest.LoadSigner(priv)
	if err != nil {
		t.Fatal(err)
	}
	id, err := signer.KeyID()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(pub)
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(keys, 0o755)
	path := filepath.Join(keys, nodeName+".pub")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	e, err := manifest.NewEnrolment(id, manifest.Node{DMIUUID: uuid}, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := manifest.WriteEnrolment(path, e); err != nil {
		t.Fatal(err)
	}
}

// sharedLibs are the files ldd(1) says a dynamic program loads, the loader among them.
func sharedLibs(t *testing.T, bin string) []string {
	t.Helper()
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		t.Fatalf("ldd %s: %v", bin, err)
	}
	var libs []string
	for _, l := range strings.Split(string(out), "\n") {
		// "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", "/lib64/ld-linux-x86-64.so.2 (0x...)"
		f := strings.Fields(l)
		for _, x := range f {
			if strings.HasPrefix(x, "/") {
				libs = append(libs, x)
				break
			}
		}
	}
	return libs
}

// writeModules copies the modules nodeinit loads, with their dependencies, from the
// boot's kernel package into the root's /lib/modules/<release>, with their modules.dep.
func writeModules(t *testing.T, bootBuild, dir string) {
	t.Helper()
	rel, err := os.ReadFile(filepath.Join(bootBuild, "kernel", "release"))
	if err != nil {
		t.Fatal(err)
	}
	release := strings.TrimSpace(string(rel))
	ix, err := kmod.Open(filepath.Join(bootBuild, "kernel", "lib", "modules", release))
	if err != nil {
		t.Fatal(err)
	}
	names, err := ix.Order(nodeModules...)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "lib", "modules", release)
	var dep strings.Builder
	if err := ix.WriteDep(&dep, names, func(m *kmod.Module) (string, error) {
		r, err := filepath.Rel(ix.Dir(), m.Path)
		if err != nil {
			return "", err
		}
		b, err := os.ReadFile(m.Path)
		if err != nil {
			return "", err
		}
		if err := os.MkdirAll(filepath.Join(dst, filepath.Dir(r)), 0o755); err != nil {
			return "", err
		}
		return r, os.WriteFile(filepath.Join(dst, r), b, 0o644)
	}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dst, kmod.DepFile), []byte(dep.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"modules.builtin", "modules.order"} {
		if b, err := os.ReadFile(filepath.Join(ix.Dir(), f)); err == nil {
			os.WriteFile(filepath.Join(dst, f), b, 0o644)
		}
	}
}
