package plugin_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/kube/internal/signedtest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci/pcitest"
)

const uuid = "4c4c4544-0042-3810-8057-b3c04f4b4d32"

// newRig is the node: noderig's B300, its manifest signed by the node's enrolled key.
func newRig(t *testing.T) *noderig.Rig {
	return noderig.New(t, uuid, manifesttest.B300(0).Node.Hostname, 1, filepath.Join(t.TempDir(), "keys"))
}

// kubelet is the kubelet's side of the plugin's two sockets.
type kubelet struct {
	reg registerapi.RegistrationClient
	dra drapb.DRAPluginClient
}

func dial(t *testing.T, sock string) *grpc.ClientConn {
	c, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// publishedDevices lists the driver's devices the API holds, waiting up to 10 s for
// want as the slice controller publishes in the background.
func publishedDevices(t *testing.T, client *fake.Clientset, want func([]string) bool) []string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		list, err := client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, s := range list.Items {
			for _, d := range s.Spec.Devices {
				names = append(names, d.Name)
			}
		}
		if want(names) {
			return names
		}
		if time.Now().After(deadline) {
			t.Fatalf("published devices %v", names)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func countIs(n int) func([]string) bool { return func(s []string) bool { return len(s) == n } }

// claim stores in the API a claim of the unit shape in namespace tenant with the
// allocation the scheduler writes when it gives the claim unit: every request a function
// of it (that the real allocator gives whole units is resources' test; here the unit is
// chosen, to make an allocation go wrong on purpose).
func claim(t *testing.T, client *fake.Clientset, d *plugin.Driver, name string, unit string) *resourceapi.ResourceClaim {
	t.Helper()
	objs := d.Objects()
	shape := objs.Shapes[0]
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "tenant", UID: types.UID("uid-" + name)},
		Spec: resources.ClaimSpec(shape, false)}
	// The allocation the scheduler writes: every request a function of unit.
	res := resourceapi.AllocationResult{}
	names := shape.RequestNames()
	i := 0
	for _, dev := range objs.Devices {
		if *dev.Attributes[resources.AttrUnit].StringValue != unit {
			continue
		}
		res.Devices.Results = append(res.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: names[i], Driver: resources.DriverName, Pool: objs.Pool, Device: dev.Name})
		i++
	}
	if i != len(names) {
		t.Fatalf("unit %s: %d devices published", unit, i)
	}
	c.Status.Allocation = &res
	if _, err := client.ResourceV1().ResourceClaims("tenant").Create(context.Background(), c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return c
}

func prepare(t *testing.T, k *kubelet, c *resourceapi.ResourceClaim) *drapb.NodePrepareResourceResponse {
	t.Helper()
	resp, err := k.dra.NodePrepareResources(context.Background(), &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Claims[string(c.UID)]
}

func TestPluginThroughKubeletGRPC(t *testing.T) {
	r := newRig(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data}
	d, client, k, ctx := start(t, cfg, reg)
	// The eight units' 32 functions are published, with the pcieRoot sysfs gives.
	publishedDevices(t, client, countIs(32))
	gpu0 := d.Objects().Devices[0]
	if gpu0.Name != resources.DeviceName("gpu0", r.M.Units[0].Functions[0].BDF) ||
		*gpu0.Attributes[resources.AttrPCIeRoot].StringValue != fmt.Sprintf("pci0000:%02x", pcitest.B300GPUBuses[0]) {
		t.Fatalf("first device %s attributes %v", gpu0.Name, gpu0.Attributes)
	}

	// Prepare: a CDI spec with the four groups' nodes, and the metadata KubeVirt reads.
	vm0 := claim(t, client, d, "vm0", "gpu0")
	// A second claim given gpu0 (an allocation gone wrong), made while gpu0 is offered.
	dup := claim(t, client, d, "dup", "gpu0")
	got := prepare(t, k, vm0)
	if got.Error != "" || len(got.Devices) != 4 {
		t.Fatalf("prepare vm0: %+v", got)
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(cdiDir), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	for i, dev := range got.Devices {
		f := r.M.Units[0].Functions[i]
		if dev.DeviceName != resources.DeviceName("gpu0", f.BDF) {
			t.Errorf("device %d is %s, want function %s", i, dev.DeviceName, f.BDF)
		}
		var ours, meta *cdi.Device
		for _, id := range dev.CdiDeviceIds {
			cd := cache.GetDevice(id)
			if cd == nil {
				t.Fatalf("CDI device %s: not in %s (%v)", id, cdiDir, cache.GetErrors())
			}
			if strings.HasPrefix(id, plugin.CDIKind+"=") {
				ours = cd
			} else {
				meta = cd
			}
		}
		if ours == nil || meta == nil {
			t.Fatalf("device %s: CDI IDs %v, want the unit's and the metadata's", dev.DeviceName, dev.CdiDeviceIds)
		}
		nodes := ours.ContainerEdits.DeviceNodes
		if len(nodes) != 1 || nodes[0].Path != fmt.Sprintf("/dev/vfio/%d", f.IOMMUGroup) {
			t.Errorf("device %s: CDI nodes %v, want /dev/vfio/%d", dev.DeviceName, nodes, f.IOMMUGroup)
		}
		checkMetadata(t, data, vm0, dev.RequestNames[0], f.BDF)
	}

	// Prepared, gpu0 is not offered; dup is refused while vm0 holds it.
	publishedDevices(t, client, without("gpu0", 28))
	got = prepare(t, k, dup)
	if !strings.Contains(got.Error, "is prepared for claim uid-vm0") || len(got.Devices) != 0 {
		t.Fatalf("prepare of a claim on vm0's devices: %+v", got)
	}

	// Refusal: gpu4's second NIC went back to mlx5_core after the allocation.
	vm1 := claim(t, client, d, "vm1", "gpu4")
	nic := r.Tree.Addr("nic4.1")
	r.Rebind(t, nic, "")
	got = prepare(t, k, vm1)
	want := fmt.Sprintf("function %s left vfio-pci: it is bound to mlx5_core", nic)
	if !strings.Contains(got.Error, want) || len(got.Devices) != 0 {
		t.Fatalf("prepare vm1 with a NIC on mlx5_core: %+v, want the error to say %q", got, want)
	}
	if m, _ := filepath.Glob(filepath.Join(cdiDir, "*uid-vm1*")); len(m) != 0 {
		t.Fatalf("refused claim left CDI specs %v", m)
	}

	// Unprepare: the specs and metadata go, and gpu0 is withheld until recycled.
	uresp, err := k.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: vm0.Namespace, Name: vm0.Name, Uid: string(vm0.UID)}}})
	if err != nil || uresp.Claims[string(vm0.UID)].Error != "" {
		t.Fatalf("unprepare vm0: %v %+v", err, uresp)
	}
	if m, _ := filepath.Glob(filepath.Join(cdiDir, "*uid-vm0*")); len(m) != 0 {
		t.Fatalf("unprepare left CDI specs %v", m)
	}
	if _, err := os.Stat(filepath.Join(data, "dra-device-metadata", "tenant_vm0")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unprepare left the metadata: %v", err)
	}
	noGPU0 := func(s []string) bool {
		for _, n := range s {
			if strings.HasPrefix(n, "gpu0-") {
				return false
			}
		}
		return len(s) == 28
	}
	publishedDevices(t, client, noGPU0)
	// A second unprepare (the kubelet retries) is fine.
	if uresp, err := k.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: vm0.Namespace, Name: vm0.Name, Uid: string(vm0.UID)}}}); err != nil || uresp.Claims[string(vm0.UID)].Error != "" {
		t.Fatalf("second unprepare: %v %+v", err, uresp)
	}
	// A plugin restarted now still withholds it (the state directory remembers).
	restarted, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, dev := range restarted.Objects().Devices {
		if strings.HasPrefix(dev.Name, "gpu0-") {
			t.Fatalf("a restarted plugin offers %s of the released unit", dev.Name)
		}
	}
	// The same generation again keeps it withheld; generation 8 (after recycle) offers it.
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	publishedDevices(t, client, noGPU0)
	r.M.Generation = 8
	r.Sign(t)
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	publishedDevices(t, client, countIs(32))

	// A manifest of another node in its place: prepare refuses every claim, naming why.
	other := signedtest.NewKey(t, r.Keys, "other", 2, manifesttest.NodeUUID(5))
	mo := *r.M
	mo.Node.DMIUUID = manifesttest.NodeUUID(5)
	other.Sign(t, &mo, r.Path)
	vm2 := claim(t, client, d, "vm2", "gpu5")
	got = prepare(t, k, vm2)
	if !strings.Contains(got.Error, manifest.ErrWrongNode.Error()) || len(got.Devices) != 0 {
		t.Fatalf("prepare against another node's manifest: %+v", got)
	}
	select {
	case err := <-d.Errors():
		t.Fatalf("background error: %v", err)
	default:
	}
}

// start starts the plugin of cfg with client-go's fake API holding the node, and
// registers it as the kubelet's plugin watcher does; the kubelet's side is returned.
func start(t *testing.T, cfg plugin.Config, reg string) (*plugin.Driver, *fake.Clientset, *kubelet, context.Context) {
	t.Helper()
	d, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	client := fakeAPI(d.Objects().Node)
	k, ctx := startOn(t, d, cfg, reg, client)
	return d, client, k, ctx
}

// fakeAPI is client-go's fake API holding the Node object, which owns the node's slices.
func fakeAPI(node string) *fake.Clientset {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node, UID: "node-uid"}})
	// The fake API does not generate names as the API server does for the slice
	// controller's generateName: this reactor does, then lets the create through.
	var generated atomic.Int32
	client.PrependReactor("create", "resourceslices", func(action k8stesting.Action) (bool, runtime.Object, error) {
		s := action.(k8stesting.CreateAction).GetObject().(*resourceapi.ResourceSlice)
		if s.Name == "" && s.GenerateName != "" {
			s.Name = fmt.Sprintf("%s%d", s.GenerateName, generated.Add(1))
		}
		return false, nil, nil
	})
	return client
}

// startOn starts d, made from cfg, publishing through client (a restarted plugin keeps
// the API of the one before), and registers it as the kubelet's plugin watcher does.
func startOn(t *testing.T, d *plugin.Driver, cfg plugin.Config, reg string, client *fake.Clientset) (*kubelet, context.Context) {
	t.Helper()
	data := cfg.StateDir
	// The kubelet makes these directories (its plugins and plugins_registry).
	for _, dir := range []string{reg, data} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := d.Start(ctx, kubeletplugin.KubeClient(client), kubeletplugin.RegistrarDirectoryPath(reg),
		kubeletplugin.PluginDataDirectoryPath(data)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Stop)

	// Registration, as the kubelet's plugin watcher does it.
	k := &kubelet{reg: registerapi.NewRegistrationClient(dial(t, filepath.Join(reg, resources.DriverName+"-reg.sock")))}
	info, err := k.reg.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerapi.DRAPlugin || info.Name != resources.DriverName || info.Endpoint != filepath.Join(data, "dra.sock") {
		t.Fatalf("plugin info %+v", info)
	}
	if _, err := k.reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	k.dra = drapb.NewDRAPluginClient(dial(t, info.Endpoint))
	return k, ctx
}

// checkMetadata reads the request's KEP-5304 metadata file the helper wrote: a JSON
// stream, one object per version; the v1alpha1 one (KubeVirt v1.9's) must name the
// function's PCI address as resource.kubernetes.io/pciBusID.
func checkMetadata(t *testing.T, data string, c *resourceapi.ResourceClaim, request, bdf string) {
	t.Helper()
	p := filepath.Join(data, "dra-device-metadata", c.Namespace+"_"+c.Name, request, "metadata.json")
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := json.NewDecoder(f)
	var versions []string
	for {
		var doc struct {
			APIVersion string `json:"apiVersion"`
			Requests   []struct {
				Name    string `json:"name"`
				Devices []struct {
					Attributes map[string]resourceapi.DeviceAttribute `json:"attributes"`
				} `json:"devices"`
			} `json:"requests"`
		}
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		versions = append(versions, doc.APIVersion)
		if doc.APIVersion != "metadata.resource.k8s.io/v1alpha1" {
			continue
		}
		if len(doc.Requests) != 1 || doc.Requests[0].Name != request || len(doc.Requests[0].Devices) != 1 {
			t.Fatalf("%s: %+v", p, doc)
		}
		a := doc.Requests[0].Devices[0].Attributes[resources.AttrPCIBusID]
		if a.StringValue == nil || *a.StringValue != bdf {
			t.Fatalf("%s: pciBusID %v, want %s", p, a.StringValue, bdf)
		}
	}
	if strings.Join(versions, " ") != "metadata.resource.k8s.io/v1beta1 metadata.resource.k8s.io/v1alpha1" {
		t.Fatalf("%s: versions %v", p, versions)
	}
}

// claimOf stores a claim whose allocation is the given devices (request name -> device
// name), as a scheduler gone wrong could write it.
func claimOf(t *testing.T, client *fake.Clientset, d *plugin.Driver, name string, devs [][2]string) *resourceapi.ResourceClaim {
	t.Helper()
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "tenant", UID: types.UID("uid-" + name)},
		Spec: resources.ClaimSpec(d.Objects().Shapes[0], false)}
	res := resourceapi.AllocationResult{}
	for _, rd := range devs {
		res.Devices.Results = append(res.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: rd[0], Driver: resources.DriverName, Pool: d.Objects().Pool, Device: rd[1]})
	}
	c.Status.Allocation = &res
	if _, err := client.ResourceV1().ResourceClaims("tenant").Create(context.Background(), c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestPrepareHoldsWholeUnits: prepare refuses, through the DRA gRPC, an allocation the
// scheduler's matchAttribute should never make (the plugin does not trust it): functions
// of two units mixed, a unit's GPU alone, one function twice; each refusal names the
// functions, and no CDI spec is left. A whole unit is then prepared.
func TestPrepareHoldsWholeUnits(t *testing.T) {
	r := newRig(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data}
	d, client, k, _ := start(t, cfg, reg)
	publishedDevices(t, client, countIs(32))
	fn := func(unit, j int) string { return r.M.Units[unit].Functions[j].BDF }
	dev := func(unit, j int) string { return resources.DeviceName(r.M.Units[unit].ID, fn(unit, j)) }
	reqs := d.Objects().Shapes[0].RequestNames()
	for _, tc := range []struct {
		name string
		devs [][2]string
		want []string
	}{
		{"mixed", [][2]string{{reqs[0], dev(0, 0)}, {reqs[1], dev(1, 1)}, {reqs[2], dev(1, 2)}, {reqs[3], dev(1, 3)}}, []string{
			"unit gpu0 is not claimed whole (the claim mixes units gpu0, gpu1): functions " + fn(0, 0) + " claimed, " + fn(0, 1) + " " + fn(0, 2) + " " + fn(0, 3) + " not",
			"unit gpu1 is not claimed whole (the claim mixes units gpu0, gpu1): functions " + fn(1, 1) + " " + fn(1, 2) + " " + fn(1, 3) + " claimed, " + fn(1, 0) + " not"}},
		{"partial", [][2]string{{reqs[0], dev(2, 0)}}, []string{
			"unit gpu2 is not claimed whole: functions " + fn(2, 0) + " claimed, " + fn(2, 1) + " " + fn(2, 2) + " " + fn(2, 3) + " not"}},
		{"duplicate", [][2]string{{reqs[0], dev(3, 0)}, {reqs[1], dev(3, 1)}, {reqs[2], dev(3, 2)}, {reqs[3], dev(3, 3)}, {"again", dev(3, 1)}}, []string{
			"requests " + reqs[1] + " and again: function " + fn(3, 1) + " (device " + dev(3, 1) + ") allocated twice in one claim"}},
	} {
		c := claimOf(t, client, d, tc.name, tc.devs)
		got := prepare(t, k, c)
		for _, w := range tc.want {
			if !strings.Contains(got.Error, w) {
				t.Errorf("%s: prepare error %q, want it to say %q", tc.name, got.Error, w)
			}
		}
		if got.Error == "" || len(got.Devices) != 0 {
			t.Errorf("%s: prepared %+v", tc.name, got)
		}
		if m, _ := filepath.Glob(filepath.Join(cdiDir, "*uid-"+tc.name+"*")); len(m) != 0 {
			t.Errorf("%s: refused claim left CDI specs %v", tc.name, m)
		}
	}
	whole := claimOf(t, client, d, "whole", [][2]string{{reqs[0], dev(4, 0)}, {reqs[1], dev(4, 1)}, {reqs[2], dev(4, 2)}, {reqs[3], dev(4, 3)}})
	if got := prepare(t, k, whole); got.Error != "" || len(got.Devices) != 4 {
		t.Fatalf("whole unit gpu4: %+v", got)
	}
}

// TestWithheldFileRefusedAtStart: a withheld.json that is not an object of units (null,
// another type, truncated, an empty unit ID) is refused when the plugin starts, naming
// the file, instead of panicking the next unprepare; a file larger than MaxFile too.
func TestWithheldFileRefusedAtStart(t *testing.T) {
	r := newRig(t)
	data := filepath.Join(r.Dir, "plugin")
	if err := os.MkdirAll(data, 0o750); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(data, "withheld.json")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"), StateDir: data}
	for _, bad := range []string{"null", "[]", `{"gpu0":`, `{"":7}`, `{"gpu0":-1}`, `{"gpu0":7} {}`, `{"gpu0":7,"x":"` + strings.Repeat("a", plugin.MaxFile) + `"}`} {
		if err := os.WriteFile(p, []byte(bad), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := plugin.New(cfg)
		if err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("withheld.json %.20q: %v, want a refusal naming it", bad, err)
		}
	}
	// A good one withholds its unit, and unprepare of a claim without a spec still works.
	if err := os.WriteFile(p, []byte(`{"gpu1":7}`), 0o600); err != nil {
		t.Fatal(err)
	}
	d, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, dev := range d.Objects().Devices {
		if strings.HasPrefix(dev.Name, "gpu1-") {
			t.Fatalf("withheld gpu1 offered: %s", dev.Name)
		}
	}
	if len(d.Objects().Devices) != 28 {
		t.Fatalf("%d devices offered, want 28", len(d.Objects().Devices))
	}
}
