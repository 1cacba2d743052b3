package plugin_test

// The plugin with Config.Fabric, against fmstub.c: passage's stand-in for NVIDIA Fabric
// Manager behind libnvfm (package fabrictest), loaded through go-nvfm's dlopen path. It
// shows the plugin holding to FM's documented API as the stand-in models it; no FM,
// NVSwitch or NVIDIA library is involved.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/fabricmanager"
	"github.com/passage-boot/passage/kube/fabricmanager/fabrictest"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest"
)

// b300Partitions are the HGX B200/B300 module sets (FM User Guide; NVLINK.md §4).
var b300Partitions = [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 2}, {3, 4}, {5, 6}, {7, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}

// withModules gives unit gpuN the GPU Module ID N+1 and the manifest the SKU's NVLink
// layout, and signs it again in its place (Path).
func withModules(t *testing.T, r *noderig.Rig) {
	t.Helper()
	for i := range r.M.Units {
		r.M.Units[i].ModuleID, r.M.Units[i].ModuleSource = i+1, "test"
	}
	r.M.NVLink = &manifest.NVLink{Partitions: b300Partitions, Source: "FM User Guide, HGX B200/B300"}
	r.Key.Sign(t, r.M, r.Path)
}

// modulesProfile is an operator's profile file: the built-in b300's YAML with the
// modules: stanza withModules's IDs come from, keyed on each unit's GPU address.
func modulesProfile(t *testing.T, r *noderig.Rig) string {
	t.Helper()
	b, err := os.ReadFile("../../../topology/profiles/b300.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var mods strings.Builder
	mods.WriteString("\nmodules:\n")
	for _, u := range r.M.Units {
		for _, f := range u.Functions {
			if f.Role == "gpu" {
				fmt.Fprintf(&mods, "  %q: %d\n", f.BDF, u.ModuleID)
			}
		}
	}
	p := filepath.Join(t.TempDir(), "b300-modules.yaml")
	if err := os.WriteFile(p, append(b, mods.String()...), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// withFabric is cfg with a Fabric whose ledger is in its StateDir, on the stand-in FM.
func withFabric(t *testing.T, cfg *plugin.Config) {
	t.Helper()
	f, err := fabricmanager.New(cfg.StateDir, fabricmanager.Options{Library: fabrictest.Library(t), Reconnect: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	cfg.Fabric = f
}

// claimUnits is claim's allocation of several whole units, each function a request of
// its own.
func claimUnits(t *testing.T, client *fake.Clientset, d *plugin.Driver, name string, units ...string) *resourceapi.ResourceClaim {
	t.Helper()
	objs := d.Objects()
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "tenant", UID: types.UID("uid-" + name)}}
	res := resourceapi.AllocationResult{}
	for _, u := range units {
		n := 0
		for _, dev := range objs.Devices {
			if *dev.Attributes[resources.AttrUnit].StringValue == u {
				res.Devices.Results = append(res.Devices.Results, resourceapi.DeviceRequestAllocationResult{
					Request: fmt.Sprintf("%s-f%d", u, n), Driver: resources.DriverName, Pool: objs.Pool, Device: dev.Name})
				n++
			}
		}
		if n != 4 {
			t.Fatalf("unit %s: %d devices published", u, n)
		}
	}
	c.Status.Allocation = &res
	if _, err := client.ResourceV1().ResourceClaims("tenant").Create(context.Background(), c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return c
}

type ledgerOnDisk struct {
	Claims map[string]fabricmanager.Entry `json:"claims"`
}

func ledgerOf(t *testing.T, dir string) ledgerOnDisk {
	t.Helper()
	var l ledgerOnDisk
	b, err := os.ReadFile(filepath.Join(dir, fabricmanager.LedgerFile))
	if os.IsNotExist(err) {
		return l
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &l); err != nil {
		t.Fatal(err)
	}
	return l
}

func unitsJSON(t *testing.T, dir string) unitsFile {
	t.Helper()
	var u unitsFile
	b, err := os.ReadFile(filepath.Join(dir, "units.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &u); err != nil {
		t.Fatal(err)
	}
	return u
}

func specsOf(t *testing.T, cdiDir, claim string) []string {
	m, _ := filepath.Glob(filepath.Join(cdiDir, "*uid-"+claim+"*"))
	return m
}

// TestFabricPrepareUnprepare, through the kubelet's DRA gRPC: a claim of gpu0 and gpu1
// is prepared once FM activated partition 4 (modules 1,2), recorded in the ledger; a
// claim FM cannot give exactly one partition, one FM refuses, one while FM is gone, one
// of a unit whose Module ID the manifest does not know: each refused naming why, no
// spec written, nothing left in the ledger. Unprepare deactivates before the units are
// recorded withheld; a partition FM will not deactivate leaves its unit quarantined
// (taint fabric), held through a newer generation until FM let go of it.
func TestFabricPrepareUnprepare(t *testing.T) {
	r := newRig(t)
	withModules(t, r)
	fm := fabrictest.New(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	logs := &logLines{}
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data, Logf: logs.logf}
	withFabric(t, &cfg)
	d, client, k, ctx := start(t, cfg, reg)
	publishedDevices(t, client, countIs(32))

	vm01 := claimUnits(t, client, d, "vm01", "gpu0", "gpu1")
	for _, call := range []string{"prepare", "the kubelet's second prepare"} {
		if got := prepare(t, k, vm01); got.Error != "" || len(got.Devices) != 8 {
			t.Fatalf("%s of gpu0+gpu1: %+v", call, got)
		}
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4}) {
		t.Fatalf("FM active %v, want partition 4 (modules 1,2)", got)
	}
	if n := len(fm.Calls(t, "activate")); n != 1 {
		t.Errorf("%d activations for one claim: %v", n, fm.Log(t))
	}
	if e := ledgerOf(t, data).Claims["uid-vm01"]; e.Partition != 4 || e.State != fabricmanager.StateActive {
		t.Fatalf("ledger uid-vm01: %+v", e)
	}
	vm2 := claimUnits(t, client, d, "vm2", "gpu2")
	if got := prepare(t, k, vm2); got.Error != "" {
		t.Fatalf("prepare gpu2: %+v", got)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4, 10}) {
		t.Fatalf("FM active %v, want 4 and 10 (module 3 alone)", got)
	}

	refused := func(name, want string, units ...string) {
		t.Helper()
		c := claimUnits(t, client, d, name, units...)
		got := prepare(t, k, c)
		if !strings.Contains(got.Error, want) || len(got.Devices) != 0 {
			t.Errorf("prepare %s (%v): %q, want it refused naming %q", name, units, got.Error, want)
		}
		if s := specsOf(t, cdiDir, name); len(s) != 0 {
			t.Errorf("refused claim %s left CDI specs %v", name, s)
		}
		if _, ok := ledgerOf(t, data).Claims["uid-"+name]; ok {
			t.Errorf("refused claim %s is in the ledger", name)
		}
	}
	refused("vm3", "nvlink partition of units gpu4,gpu6: fm: none of FM's 15 partitions has exactly modules 5,7", "gpu4", "gpu6")
	fm.Update(t, func(s *fabrictest.State) { s.RefuseActivate = int(fabricmanager.FM_ST_NVLINK_ERROR) })
	refused("vm4", "fm: activate partition 6: FM_ST_NVLINK_ERROR (-10)", "gpu4", "gpu5")
	fm.Update(t, func(s *fabrictest.State) { s.RefuseActivate, s.Mode = 0, "gone" })
	refused("vm5", "FM_ST_CONNECTION_NOT_VALID (-9)", "gpu6", "gpu7")
	fm.Update(t, func(s *fabrictest.State) { s.Mode, s.Epoch = "serving", s.Epoch+1 })
	r.M.Units[7].ModuleID, r.M.Units[7].ModuleSource = 0, ""
	r.Sign(t)
	refused("vm6", "unit gpu7: GPU Module ID unknown in manifest generation 7: no FM partition can be matched to it", "gpu7")
	if got := fm.Active(t); !slices.Equal(got, []int{4, 10}) {
		t.Fatalf("FM active %v after the refused claims", got)
	}

	// Released: FM deactivates partition 4, then the units are withheld.
	if got := unprepare(t, k, vm01); got != "" {
		t.Fatalf("unprepare vm01: %q", got)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{10}) {
		t.Fatalf("FM active %v after vm01's release", got)
	}
	u := unitsJSON(t, data)
	if u.Units["gpu0"] == nil || u.Units["gpu0"].State != plugin.StateWithheld || u.Units["gpu1"] == nil {
		t.Fatalf("units.json %+v", u.Units)
	}
	if _, ok := ledgerOf(t, data).Claims["uid-vm01"]; ok {
		t.Error("released claim still in the ledger")
	}

	// FM will not deactivate partition 10: the claim is let go of, gpu2 quarantined.
	fm.Update(t, func(s *fabrictest.State) { s.RefuseDeactivate = int(fabricmanager.FM_ST_GENERIC_ERROR) })
	if got := unprepare(t, k, vm2); got != "" {
		t.Fatalf("unprepare vm2: %q", got)
	}
	if s := specsOf(t, cdiDir, "vm2"); len(s) != 0 {
		t.Errorf("vm2's CDI specs stay: %v", s)
	}
	g2 := unitsJSON(t, data).Units["gpu2"]
	if g2 == nil || g2.State != plugin.StateQuarantined || g2.Step != plugin.StepFabric || !strings.Contains(g2.LastError, "fm: deactivate partition 10: FM_ST_GENERIC_ERROR (-2)") {
		t.Fatalf("units.json gpu2: %+v", g2)
	}
	if e := ledgerOf(t, data).Claims["uid-vm2"]; e.State != fabricmanager.StateDeactivating || !strings.Contains(e.LastError, "FM_ST_GENERIC_ERROR") {
		t.Fatalf("ledger uid-vm2: %+v", e)
	}
	if !logs.has("units gpu2 quarantined: claim uid-vm2 released, its NVLink partition not deactivated: fm: deactivate partition 10: FM_ST_GENERIC_ERROR (-2)") {
		t.Errorf("quarantine not logged:\n%s", logs)
	}
	var taint string
	gpu2 := resources.DeviceName("gpu2", r.M.Units[2].Functions[0].BDF)
	publishedDevices(t, client, func([]string) bool {
		dev, ok := slicesOf(t, client)[gpu2]
		if ok && len(dev.Taints) == 1 {
			taint = dev.Taints[0].Key + "=" + dev.Taints[0].Value
		}
		return taint != ""
	})
	if taint != plugin.TaintQuarantined+"=fabric" {
		t.Errorf("gpu2's taint %q", taint)
	}

	// A newer generation (the node recycled) offers gpu0 and gpu1 again, not gpu2 while
	// its partition may be active; once FM deactivated it (ResumeFabric, at every
	// reload), the next generation does.
	r.M.Generation = 8
	r.Sign(t)
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if u := unitsJSON(t, data).Units; len(u) != 1 || u["gpu2"] == nil {
		t.Fatalf("units.json after generation 8: %+v", u)
	}
	fm.Update(t, func(s *fabrictest.State) { s.RefuseDeactivate = 0 })
	d.ResumeFabric()
	if got := fm.Active(t); len(got) != 0 {
		t.Fatalf("FM active %v after the release was asked again", got)
	}
	if !logs.has("fabric: claim uid-vm2 (released): partition 10 is not active in FM: dropped") {
		t.Errorf("resume not logged:\n%s", logs)
	}
	r.M.Generation = 9
	r.Sign(t)
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if u := unitsJSON(t, data).Units; len(u) != 0 {
		t.Fatalf("units.json after generation 9: %+v", u)
	}
}

// TestFabricPluginRestart: the plugin stopped while a claim holds partition 4, FM
// restarted with --restart meanwhile. The plugin started again hands FM the ledger's
// list (4, and 7 of a claim whose prepare stopped after FM's answer, before its spec)
// before it serves; the claim no CDI spec holds has its partition released; the
// kubelet's unprepare of the other then deactivates 4.
func TestFabricPluginRestart(t *testing.T) {
	r := newRig(t)
	withModules(t, r)
	fm := fabrictest.New(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	logs := &logLines{}
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data, Logf: logs.logf}
	withFabric(t, &cfg)
	d, client, k, _ := start(t, cfg, reg)
	publishedDevices(t, client, countIs(32))
	vm := claimUnits(t, client, d, "vm", "gpu0", "gpu1")
	if got := prepare(t, k, vm); got.Error != "" {
		t.Fatalf("prepare: %+v", got)
	}
	d.Stop()
	cfg.Fabric.Close()

	// As a plugin stopped between FM's activation of 7 for a claim and its spec leaves
	// the ledger; FM restarts.
	l := ledgerOf(t, data)
	l.Claims["uid-ghost"] = fabricmanager.Entry{Partition: 7, Modules: []int{7, 8}, State: fabricmanager.StateActive}
	b, _ := json.Marshal(map[string]any{"version": 1, "claims": l.Claims})
	write(t, filepath.Join(data, fabricmanager.LedgerFile), b)
	fm.Update(t, func(s *fabrictest.State) { s.Active = append(s.Active, 7) })
	fm.Restart(t, 5*time.Second)

	withFabric(t, &cfg)
	d2, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(fm.Log(t), "set_activated 4,7 = 0") || !logs.has("FM was waiting for the active partitions after a restart: handed [4,7]") ||
		!logs.has("fabric: claim uid-ghost is not prepared: partition 7 released") {
		t.Fatalf("the ledger's list not handed to FM:\n%v\n%s", fm.Log(t), logs)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4}) {
		t.Fatalf("FM active %v after the restart, want [4]", got)
	}
	if st := fm.Read(t); st.Mode != "serving" {
		t.Fatalf("FM %s", st.Mode)
	}
	if l := ledgerOf(t, data); len(l.Claims) != 1 || l.Claims["uid-vm"].State != fabricmanager.StateActive {
		t.Fatalf("ledger after the restart: %+v", l.Claims)
	}
	// Started on the API the kubelet wiped: the claim still holds gpu0 and gpu1.
	client2 := fakeAPI(d2.Objects().Node)
	k2, _ := startOn(t, d2, cfg, reg, client2)
	publishedDevices(t, client2, func(s []string) bool { return without("gpu0", 24)(s) && without("gpu1", 24)(s) })
	if got := unprepare(t, k2, vm); got != "" {
		t.Fatalf("unprepare after the restart: %q", got)
	}
	if got := fm.Active(t); len(got) != 0 {
		t.Fatalf("FM active %v after the unprepare", got)
	}
	if u := unitsJSON(t, data).Units; u["gpu0"] == nil || u["gpu1"] == nil || u["gpu0"].State != plugin.StateWithheld {
		t.Fatalf("units.json %+v", u)
	}
}

// TestFabricBeforeTurnaround: with the turnaround on, no step of a unit's recycle (the
// erase, the resets, the rebinding, the signed generations) runs while FM has its
// partition active. FM refusing the deactivation leaves gpu0 and gpu1 quarantined
// (their NVMe holding the tenant's data: nothing ran); FM back, the operator's clear
// lets the turnaround deactivate first, then recycle and offer them again.
func TestFabricBeforeTurnaround(t *testing.T) {
	r := newTurnRig(t)
	withModules(t, r.Rig)
	// The generations the turnaround signs take the recycled units' Module IDs from the
	// profile, as a node's do: one without would sign gpu0 and gpu1 with none, and a
	// node that talks to FM offers no such unit.
	r.cfg.Turnaround.Profile = modulesProfile(t, r.Rig)
	fm := fabrictest.New(t)
	withFabric(t, &r.cfg)
	var mu sync.Mutex
	var during []string // the steps seen with partition 4 active
	steps := 0
	r.cfg.Turnaround.Crash = func(unit, step string) error {
		mu.Lock()
		defer mu.Unlock()
		steps++
		if slices.Contains(fm.Active(t), 4) {
			during = append(during, unit+" "+step)
		}
		return nil
	}
	d, client, k, _ := start(t, r.cfg, r.reg)
	r.cfg.Turnaround.Kube, r.cfg.Turnaround.NodeName = client, d.Objects().Node
	publishedDevices(t, client, countIs(32))
	vm := claimUnits(t, client, d, "vm", "gpu0", "gpu1")
	if got := prepare(t, k, vm); got.Error != "" {
		t.Fatalf("prepare: %+v", got)
	}
	_, c0 := r.nvme(0)
	c0.Write(1, 0, tenantData)
	fm.Update(t, func(s *fabrictest.State) { s.RefuseDeactivate = int(fabricmanager.FM_ST_NVLINK_ERROR) })
	if got := unprepare(t, k, vm); got != "" {
		t.Fatalf("unprepare: %q", got)
	}
	stop := runTurnaround(d)
	defer stop()
	r.waitFor(t, "gpu0 and gpu1 published quarantined", func() bool {
		free, tainted := untainted(slicesOf(t, client))
		return free == 24 && tainted == 8
	})
	for _, u := range []string{"gpu0", "gpu1"} {
		if s := r.units(t).Units[u]; s.State != plugin.StateQuarantined || s.Step != plugin.StepFabric {
			t.Fatalf("units.json %s: %+v", u, s)
		}
	}
	time.Sleep(100 * time.Millisecond) // five of the turnaround's polls
	if c0.Dirty(1) == 0 || steps != 0 {
		t.Fatalf("a quarantined unit was recycled: %d dirty blocks, %d recycle steps", c0.Dirty(1), steps)
	}

	// FM takes deactivations again; the operator clears the two units.
	fm.Update(t, func(s *fabrictest.State) { s.RefuseDeactivate = 0 })
	n, err := client.CoreV1().Nodes().Get(context.Background(), d.Objects().Node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n.Annotations = map[string]string{plugin.ClearAnnotation: "gpu0,gpu1"}
	if _, err := client.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.waitFor(t, "gpu0 and gpu1 back", func() bool {
		free, tainted := untainted(slicesOf(t, client))
		return free == 32 && tainted == 0
	})
	mu.Lock()
	defer mu.Unlock()
	if steps == 0 || len(during) != 0 {
		t.Errorf("%d recycle steps, those with partition 4 active: %v", steps, during)
	}
	if c0.Dirty(1) != 0 {
		t.Error("gpu0 returned with the tenant's data")
	}
	if got := fm.Active(t); len(got) != 0 {
		t.Errorf("FM active %v", got)
	}
	if l := ledgerOf(t, r.cfg.StateDir); len(l.Claims) != 0 {
		t.Errorf("ledger %+v", l.Claims)
	}
}

// nvlinkDevices lists the published devices that carry an NVLink partition attribute of
// size 2.
func nvlinkDevices(t *testing.T, client *fake.Clientset) int {
	t.Helper()
	list, err := client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, s := range list.Items {
		for _, dev := range s.Spec.Devices {
			if _, ok := dev.Attributes[resources.AttrNVLinkPartition(2)]; ok {
				n++
			}
		}
	}
	return n
}

// TestFabricHoldsNVLinkToFM: the NVLink partitions are published only while FM's list
// agrees with the manifest. A manifest that declares H100's pairs ({1,3}, {2,4}, ...)
// on an FM that offers B300's ({1,2}, {3,4}, ...) publishes no NVLink attribute, naming
// the disagreement; the same node's next generation, with the layout FM offers,
// publishes them again at the next reload, which says so.
func TestFabricHoldsNVLinkToFM(t *testing.T) {
	r := newRig(t)
	withModules(t, r)
	r.M.NVLink.Partitions = [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 3}, {2, 4}, {5, 7}, {6, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}
	r.Key.Sign(t, r.M, r.Path)
	fabrictest.New(t)
	reg, data := filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	logs := &logLines{}
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"), StateDir: data, Logf: logs.logf}
	withFabric(t, &cfg)
	d, client, _, ctx := start(t, cfg, reg)
	publishedDevices(t, client, countIs(32))
	if n := nvlinkDevices(t, client); n != 0 {
		t.Fatalf("%d devices published with an NVLink partition FM does not offer", n)
	}
	if !logs.has("FM partition 4 (modules 1,2): the manifest's NVLink layout has no such module set") || !logs.has("no NVLink partition is published") {
		t.Fatalf("the disagreement is not named:\n%s", logs)
	}

	r.M.Generation++
	r.M.NVLink.Partitions = b300Partitions
	r.Key.Sign(t, r.M, r.Path)
	d.ResumeFabric()
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	// The slices are published in the background: wait for them.
	deadline := time.Now().Add(10 * time.Second)
	for n := nvlinkDevices(t, client); n != 32; n = nvlinkDevices(t, client) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 32 devices published with their NVLink partition once FM and the manifest agree\n%s", n, logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.ResumeFabric() // the next reload's: FM's list held to the generation published
	if !logs.has("agree with the manifest: NVLink partitions published") {
		t.Fatalf("the agreement is not said:\n%s", logs)
	}
}

// waitNVLink waits until n published devices carry an NVLink partition of size 2 (the
// slices are published in the background).
func waitNVLink(t *testing.T, client *fake.Clientset, n int, logs *logLines) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for got := nvlinkDevices(t, client); got != n; got = nvlinkDevices(t, client) {
		if time.Now().After(deadline) {
			t.Fatalf("%d devices published with an NVLink partition, want %d\n%s", got, n, logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// count is how many logged lines hold sub.
func (l *logLines) count(sub string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, s := range l.lines {
		if strings.Contains(s, sub) {
			n++
		}
	}
	return n
}

// TestNVLinkNeedsFM: a node whose manifest has Module IDs and the B300 layout publishes
// no NVLink partition without a Fabric Manager configured (the reason naming the
// flags, logged once over several reloads), and a prepared claim of two units is then
// an ordinary one; with FM, the partitions are published only while FM answers: its
// state gone, then FM not running, each takes them away (the reason naming FM's
// error), and FM back brings them again at the next reload. A library path that is not
// there publishes none, naming it.
func TestNVLinkNeedsFM(t *testing.T) {
	t.Run("no-fm-flags", func(t *testing.T) {
		r := newRig(t)
		withModules(t, r)
		logs := &logLines{}
		cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"), StateDir: filepath.Join(r.Dir, "plugin"), Logf: logs.logf}
		d, client, _, ctx := start(t, cfg, filepath.Join(r.Dir, "registry"))
		publishedDevices(t, client, countIs(32))
		for range 3 {
			d.ResumeFabric()
			if err := d.Reload(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if n := nvlinkDevices(t, client); n != 0 {
			t.Fatalf("%d devices published with an NVLink partition and no Fabric Manager", n)
		}
		if off := d.NVLinkOff(); !strings.Contains(off, "no Fabric Manager configured (--fm-socket, --fm-address, --fm-lib)") {
			t.Fatalf("NVLinkOff %q", off)
		}
		if n := logs.count("no Fabric Manager configured"); n != 1 {
			t.Fatalf("the reason logged %d times, want once:\n%s", n, logs)
		}
		for _, dev := range d.Objects().Devices {
			if _, ok := dev.Attributes[resources.AttrNVLinkPartition(8)]; ok {
				t.Fatalf("device %s rendered with an NVLink partition", dev.Name)
			}
		}
		if n := len(d.Objects().NVLinkTemplates); n != 0 {
			t.Fatalf("%d NVLink templates rendered", n)
		}
	})

	t.Run("fm-gone-and-back", func(t *testing.T) {
		r := newRig(t)
		withModules(t, r)
		fm := fabrictest.New(t)
		logs := &logLines{}
		cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"), StateDir: filepath.Join(r.Dir, "plugin"), Logf: logs.logf}
		withFabric(t, &cfg)
		d, client, _, ctx := start(t, cfg, filepath.Join(r.Dir, "registry"))
		publishedDevices(t, client, countIs(32))
		waitNVLink(t, client, 32, logs)
		if off := d.NVLinkOff(); off != "" {
			t.Fatalf("NVLinkOff %q with FM agreeing", off)
		}
		reload := func() {
			t.Helper()
			d.ResumeFabric()
			if err := d.Reload(ctx); err != nil {
				t.Fatal(err)
			}
		}
		state, err := os.ReadFile(fm.Path)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name       string
			gone, back func()
		}{
			{"state removed",
				func() { must(t, os.Remove(fm.Path)) },
				func() { must(t, os.WriteFile(fm.Path, state, 0o644)) }},
			{"FM not running",
				func() { fm.Update(t, func(s *fabrictest.State) { s.Mode = "gone" }) },
				func() { fm.Update(t, func(s *fabrictest.State) { s.Mode, s.Epoch = "serving", s.Epoch+1 }) }},
		} {
			c.gone()
			reload()
			waitNVLink(t, client, 0, logs)
			publishedDevices(t, client, countIs(32)) // still offered alone
			off := d.NVLinkOff()
			if !strings.Contains(off, "Fabric Manager out of reach (") || !strings.Contains(off, "FM_ST_CONNECTION_NOT_VALID (-9)") {
				t.Fatalf("%s: NVLinkOff %q", c.name, off)
			}
			// Said when it changes, not at every reload: the first error is the
			// connection's, the later ones a new connection's.
			reload()
			n := logs.count("Fabric Manager out of reach")
			reload()
			reload()
			if m := logs.count("Fabric Manager out of reach"); m != n || n > 2 {
				t.Fatalf("%s: FM out of reach logged %d times, then %d:\n%s", c.name, n, m, logs)
			}
			c.back()
			reload()
			waitNVLink(t, client, 32, logs)
			if off := d.NVLinkOff(); off != "" {
				t.Fatalf("%s, FM back: NVLinkOff %q", c.name, off)
			}
			logs.mu.Lock()
			logs.lines = nil
			logs.mu.Unlock()
		}
	})

	t.Run("library-missing", func(t *testing.T) {
		r := newRig(t)
		withModules(t, r)
		fabrictest.New(t)
		logs := &logLines{}
		data := filepath.Join(r.Dir, "plugin")
		lib := filepath.Join(r.Dir, "usr/lib/x86_64-linux-gnu/libnvfm.so.1")
		f, err := fabricmanager.New(data, fabricmanager.Options{Library: lib})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"), StateDir: data, Logf: logs.logf, Fabric: f}
		d, client, _, _ := start(t, cfg, filepath.Join(r.Dir, "registry"))
		publishedDevices(t, client, countIs(32))
		if n := nvlinkDevices(t, client); n != 0 {
			t.Fatalf("%d devices published with an NVLink partition, FM's library missing", n)
		}
		if off := d.NVLinkOff(); !strings.Contains(off, "fm: load "+lib) {
			t.Fatalf("NVLinkOff %q does not name the library", off)
		}
	})
}

// TestFabricUnusedWithoutModules: with a Fabric configured (as the DaemonSet's --fm-
// flags give every node), a node whose manifest knows no GPU Module ID and whose ledger
// is empty never loads FM's library, at start, at reloads or at prepare: nothing is
// logged, the stand-in FM answers no call, the library is not mapped, and a claim of a
// unit is prepared as without FM. The same with a library path that is not there.
func TestFabricUnusedWithoutModules(t *testing.T) {
	for _, c := range []struct {
		name    string
		present bool
	}{{"library-present", true}, {"library-missing", false}} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t)
			fm := fabrictest.New(t)
			lib := filepath.Join(t.TempDir(), "libnvfm.so.1")
			if c.present {
				b, err := os.ReadFile(fabrictest.Library(t))
				if err != nil {
					t.Fatal(err)
				}
				must(t, os.WriteFile(lib, b, 0o755))
			}
			data := filepath.Join(r.Dir, "plugin")
			f, err := fabricmanager.New(data, fabricmanager.Options{Library: lib, Socket: "/run/nvidia-fabricmanager/socket"})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			logs := &logLines{}
			cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"), StateDir: data, Logf: logs.logf, Fabric: f}
			d, client, k, ctx := start(t, cfg, filepath.Join(r.Dir, "registry"))
			publishedDevices(t, client, countIs(32))
			for range 2 {
				d.ResumeFabric()
				if err := d.Reload(ctx); err != nil {
					t.Fatal(err)
				}
			}
			vm := claimUnits(t, client, d, "vm", "gpu0")
			if got := prepare(t, k, vm); got.Error != "" || len(got.Devices) != 4 {
				t.Fatalf("prepare gpu0: %+v", got)
			}
			if got := unprepare(t, k, vm); got != "" {
				t.Fatalf("unprepare: %q", got)
			}
			d.ResumeFabric()
			if d.UsesFabric() || d.NVLinkOff() != "" {
				t.Errorf("UsesFabric %v, NVLinkOff %q", d.UsesFabric(), d.NVLinkOff())
			}
			if logs.count("fabric") != 0 || logs.count("fm:") != 0 || logs.count("NVLink") != 0 {
				t.Errorf("logged:\n%s", logs)
			}
			if l := fm.Log(t); len(l) != 1 || l[0] != "" {
				t.Errorf("the stand-in FM was called: %v", l)
			}
			maps, err := os.ReadFile("/proc/self/maps")
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(string(maps), lib) {
				t.Errorf("%s is mapped: FM's library was loaded", lib)
			}
			if l := ledgerOf(t, data); len(l.Claims) != 0 {
				t.Errorf("ledger %+v", l.Claims)
			}
		})
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestFabricUnprepareFMUnreachable (#55, 3): FM gone while a claim holds partition 4,
// its old connection answering FM_ST_UNINITIALIZED (which the guide also gives for a
// partition not active) and the reconnect failing. The unprepare does not read that as
// released: gpu0 and gpu1 are quarantined (taint fabric), not withheld for a reset,
// the ledger keeps the claim, and FM still has partition 4 active.
func TestFabricUnprepareFMUnreachable(t *testing.T) {
	r := newRig(t)
	withModules(t, r)
	fm := fabrictest.New(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data, Logf: (&logLines{}).logf}
	withFabric(t, &cfg)
	d, client, k, _ := start(t, cfg, reg)
	publishedDevices(t, client, countIs(32))
	vm := claimUnits(t, client, d, "vm", "gpu0", "gpu1")
	if got := prepare(t, k, vm); got.Error != "" {
		t.Fatalf("prepare: %+v", got)
	}
	fm.Update(t, func(s *fabrictest.State) {
		s.FMUGCodes, s.StaleCode, s.Mode = true, int(fabricmanager.FM_ST_UNINITIALIZED), "gone"
	})
	if got := unprepare(t, k, vm); got != "" {
		t.Fatalf("unprepare: %q", got)
	}
	for _, u := range []string{"gpu0", "gpu1"} {
		s := unitsJSON(t, data).Units[u]
		if s == nil || s.State != plugin.StateQuarantined || s.Step != plugin.StepFabric {
			t.Fatalf("units.json %s: %+v; FM's log %v", u, s, fm.Log(t))
		}
	}
	if e, ok := ledgerOf(t, data).Claims["uid-vm"]; !ok || e.State != fabricmanager.StateDeactivating {
		t.Fatalf("ledger uid-vm: %+v (held %v)", e, ok)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4}) {
		t.Fatalf("FM active %v", got)
	}
}

// TestFabricUnknownModuleNotOffered (#55, 5): on a node that talks to FM, a claim is
// prepared only once FM activated its units' partition, which a unit whose Module ID
// the manifest does not know has none of. Such a unit is not published (it would be
// allocated, then refused at every prepare); the log names it. The others are.
func TestFabricUnknownModuleNotOffered(t *testing.T) {
	r := newRig(t)
	withModules(t, r)
	r.M.Units[7].ModuleID, r.M.Units[7].ModuleSource = 0, ""
	r.Sign(t)
	fabrictest.New(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	logs := &logLines{}
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data, Logf: logs.logf}
	withFabric(t, &cfg)
	_, client, _, _ := start(t, cfg, reg)
	publishedDevices(t, client, func(s []string) bool { return len(s) == 28 && without("gpu7", 28)(s) })
	if !logs.has("fabric: unit gpu7 is not offered: unit gpu7: GPU Module ID unknown in manifest generation 7") {
		t.Errorf("the unit left out is not named:\n%s", logs)
	}
}
