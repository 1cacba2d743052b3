package resources_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/internal/signedtest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// node is the manifest the allocation tests render: manifesttest's B300 (eight units of
// GPU, two CX-8 PFs, NVMe), where gpu1 lost its NVMe (a ready unit of another shape),
// gpu2 is degraded and gpu3 failed. The whole units of the B300 shape are gpu0, gpu4-7.
func node() *manifest.Manifest {
	m := manifesttest.B300(7)
	m.Units[1].Functions = m.Units[1].Functions[:3]
	m.Units[2].Status, m.Units[2].Reasons = manifest.StatusDegraded, []string{"erase: auto: nvme not erased"}
	m.Units[3].Status, m.Units[3].Reasons = manifest.StatusFailed, []string{"acs: mismatch"}
	for i := range m.Units[3].Functions {
		m.Units[3].Functions[i].DriverAfter = "nvidia"
	}
	return m
}

// verified signs m with a key enrolled for its node and verifies it through
// resources.Verify, as the driver does.
func verified(t *testing.T, m *manifest.Manifest) *manifest.Verified {
	t.Helper()
	dir := t.TempDir()
	k := signedtest.NewKey(t, filepath.Join(dir, "keys"), "node", 1, m.Node.DMIUUID)
	path := k.Sign(t, m, filepath.Join(dir, "manifest.dsse.json"))
	v, err := resources.Verify(path, resources.Source{Keys: filepath.Dir(k.Pub), NodeUUID: m.Node.DMIUUID})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

type classes []*resourceapi.DeviceClass

func (c classes) List() ([]*resourceapi.DeviceClass, error) { return c, nil }
func (c classes) Get(name string) (*resourceapi.DeviceClass, error) {
	for _, d := range c {
		if d.Name == name {
			return d, nil
		}
	}
	return nil, fmt.Errorf("no device class %s", name)
}

// allocator is the scheduler's side: the real structured allocator over the rendered
// slices and class, claims allocated one at a time as kube-scheduler does, each
// allocation's devices then taken.
type allocator struct {
	objs  *resources.Objects
	state structured.AllocatedState
	node  *corev1.Node
}

func newAllocator(objs *resources.Objects) *allocator {
	return &allocator{objs: objs, node: &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: objs.Node}},
		state: structured.AllocatedState{AllocatedDevices: sets.New[structured.DeviceID](),
			AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](), AggregatedCapacity: structured.NewConsumedCapacityCollection()}}
}

// take marks a device allocated to some other claim.
func (a *allocator) take(device string) {
	a.state.AllocatedDevices.Insert(structured.MakeDeviceID(resources.DriverName, a.objs.Pool, device))
}

// allocate allocates one claim of the shape from its ready-only template; nil when it
// cannot be.
func (a *allocator) allocate(t *testing.T, name string, s resources.Shape) *resourceapi.AllocationResult {
	t.Helper()
	return a.allocateSpec(t, name, resources.ClaimSpec(s, false))
}

func (a *allocator) allocateSpec(t *testing.T, name string, spec resourceapi.ResourceClaimSpec) *resourceapi.AllocationResult {
	t.Helper()
	ctx := context.Background()
	al, err := structured.NewAllocator(ctx, structured.Features{}, a.state, classes{a.objs.Class}, a.objs.Slices, cel.NewCache(10, cel.Features{}))
	if err != nil {
		t.Fatal(err)
	}
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "tenant", UID: types.UID("uid-" + name)},
		Spec: spec}
	res, err := al.Allocate(ctx, a.node, []*resourceapi.ResourceClaim{claim})
	if err != nil {
		t.Fatalf("claim %s: %v", name, err)
	}
	if len(res) == 0 {
		return nil
	}
	for _, r := range res[0].Devices.Results {
		a.state.AllocatedDevices.Insert(structured.MakeDeviceID(r.Driver, r.Pool, r.Device))
	}
	return &res[0]
}

// unitOf checks every request of the allocation got a device of one unit, each request
// the role it asked for, and returns the unit.
func unitOf(t *testing.T, objs *resources.Objects, s resources.Shape, r *resourceapi.AllocationResult) string {
	t.Helper()
	byName := map[string]resourceapi.Device{}
	for _, d := range objs.Devices {
		byName[d.Name] = d
	}
	names := s.RequestNames()
	if len(r.Devices.Results) != len(names) {
		t.Fatalf("%d devices allocated for %d requests", len(r.Devices.Results), len(names))
	}
	unit := ""
	for _, res := range r.Devices.Results {
		d := byName[res.Device]
		u, role := *d.Attributes[resources.AttrUnit].StringValue, *d.Attributes[resources.AttrRole].StringValue
		i := indexOf(names, res.Request)
		if i < 0 || s[i] != role {
			t.Errorf("request %s got %s (role %s)", res.Request, res.Device, role)
		}
		if unit != "" && u != unit {
			t.Errorf("one claim got devices of units %s and %s", unit, u)
		}
		unit = u
	}
	return unit
}

func indexOf(s []string, x string) int {
	for i, y := range s {
		if y == x {
			return i
		}
	}
	return -1
}

var b300 = resources.Shape{"gpu", "gpu-nic", "gpu-nic", "gpu-nvme"}

func TestAllocatorGivesWholeReadyUnits(t *testing.T) {
	objs, err := resources.Render(verified(t, node()), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// gpu1 (3 functions) is ready; gpu2 degraded and gpu3 failed are not offered.
	if want := 5*4 + 3; len(objs.Devices) != want {
		t.Fatalf("%d devices, want %d", len(objs.Devices), want)
	}
	if len(objs.Templates) != 2 || objs.Shapes[0].String() != "gpu+gpu-nic+gpu-nic" || objs.Shapes[1].String() != b300.String() {
		t.Fatalf("shapes %v", objs.Shapes)
	}
	a := newAllocator(objs)
	// Five whole units of the B300 shape: five claims get one each, the sixth none.
	got := map[string]string{}
	for i := range 6 {
		name := fmt.Sprintf("vm%d", i)
		r := a.allocate(t, name, b300)
		if i == 5 {
			if r != nil {
				t.Fatalf("claim %s allocated %v beyond the five whole units", name, r.Devices.Results)
			}
			break
		}
		if r == nil {
			t.Fatalf("claim %s: not allocated, with %d whole units for %d claims", name, 5, i+1)
		}
		u := unitOf(t, objs, b300, r)
		if other, dup := got[u]; dup {
			t.Fatalf("unit %s given to %s and %s", u, other, name)
		}
		got[u] = name
	}
	for _, never := range []string{"gpu1", "gpu2", "gpu3"} {
		if c, ok := got[never]; ok {
			t.Errorf("unit %s (missing a function, degraded or failed) allocated to %s", never, c)
		}
	}
	// The three-function unit is its own shape: its template takes it, and only it.
	r := a.allocate(t, "small", objs.Shapes[0])
	if r == nil || unitOf(t, objs, objs.Shapes[0], r) != "gpu1" {
		t.Fatalf("the gpu+gpu-nic+gpu-nic claim: %v, want unit gpu1", r)
	}
}

// TestAllocatorSkipsBrokenUnits: with one function of gpu0 and one of gpu4 taken by other
// claims, the whole-unit claims get the three units left whole, never the rest of a
// broken one, as the hand check found.
func TestAllocatorSkipsBrokenUnits(t *testing.T) {
	m := node()
	objs, err := resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a := newAllocator(objs)
	a.take(resources.DeviceName("gpu0", m.Units[0].Functions[1].BDF))
	a.take(resources.DeviceName("gpu4", m.Units[4].Functions[3].BDF))
	var units []string
	for i := range 4 {
		r := a.allocate(t, fmt.Sprintf("vm%d", i), b300)
		if r == nil {
			break
		}
		units = append(units, unitOf(t, objs, b300, r))
	}
	if len(units) != 3 || len(sets.New(units...)) != 3 {
		t.Fatalf("allocated units %v, want the three whole ones gpu5-7", units)
	}
	for _, u := range units {
		if u == "gpu0" || u == "gpu4" {
			t.Errorf("unit %s allocated with one of its functions taken", u)
		}
	}
}

// TestAllocatorDegradedOnlyWhenAsked: a degraded unit is allocated only when the slices
// publish it (Options.Degraded) and the claim asks for it (the -or-degraded template's
// spec): with gpu2 published, the five ready units go to ready-only claims and a sixth
// such claim gets nothing; a claim from the -or-degraded template then gets gpu2, and
// never the failed gpu3. Without Options.Degraded there is no such template and gpu2
// is not published.
func TestAllocatorDegradedOnlyWhenAsked(t *testing.T) {
	objs, err := resources.Render(verified(t, node()), resources.Options{Degraded: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(objs.DegradedTemplates) != len(objs.Templates) || objs.DegradedTemplates[1].Name != b300.DegradedTemplateName() {
		t.Fatalf("degraded templates %v", objs.DegradedTemplates)
	}
	a := newAllocator(objs)
	seen := map[string]bool{}
	for i := range 5 {
		r := a.allocate(t, fmt.Sprintf("vm%d", i), b300)
		if r == nil {
			t.Fatalf("ready claim %d not allocated", i)
		}
		seen[unitOf(t, objs, b300, r)] = true
	}
	if seen["gpu2"] || seen["gpu3"] {
		t.Fatalf("ready-only claims got units %v", seen)
	}
	if r := a.allocate(t, "vm5", b300); r != nil {
		t.Fatalf("a sixth ready-only claim allocated %v (the degraded unit?)", r.Devices.Results)
	}
	r := a.allocateSpec(t, "vm6", objs.DegradedTemplates[1].Spec.Spec)
	if r == nil || unitOf(t, objs, b300, r) != "gpu2" {
		t.Fatalf("a claim asking for a degraded unit: %v, want gpu2", r)
	}
	if r := a.allocateSpec(t, "vm7", objs.DegradedTemplates[1].Spec.Spec); r != nil {
		t.Fatalf("the failed unit allocated: %v", r.Devices.Results)
	}
	plain, err := resources.Render(verified(t, node()), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(plain.DegradedTemplates) != 0 {
		t.Fatalf("degraded templates without Options.Degraded: %v", plain.DegradedTemplates)
	}
}

// TestVerifyRefuses: only a verified manifest of this node renders; a tampered one, one
// signed by another node's key, and another node's (with a fleet directory that
// verifies it) are refused, naming the reason.
func TestVerifyRefuses(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	a := node()
	b := node()
	b.Node.Hostname, b.Node.DMIUUID = "b300-r07-n4", manifesttest.NodeUUID(99)
	ka := signedtest.NewKey(t, keys, "a", 1, a.Node.DMIUUID)
	kb := signedtest.NewKey(t, keys, "b", 2, b.Node.DMIUUID)
	good := ka.Sign(t, a, filepath.Join(dir, "a.dsse.json"))
	other := kb.Sign(t, b, filepath.Join(dir, "b.dsse.json"))
	// A manifest of node b signed with a's key: a's key cannot speak for b.
	forged := ka.Sign(t, b, filepath.Join(dir, "forged.dsse.json"))
	// The tampered manifest is node a's with one unit's status edited from failed to
	// ready, its signature kept (and its unsigned payloadDigest dropped, so the
	// signature is what refuses it).
	var env manifest.Envelope
	b0, _ := os.ReadFile(good)
	if err := json.Unmarshal(b0, &env); err != nil {
		t.Fatal(err)
	}
	payload, _ := base64.StdEncoding.DecodeString(env.Payload)
	edited := strings.Replace(string(payload), `"status":"failed"`, `"status":"ready"`, 1)
	if edited == string(payload) {
		t.Fatal("no failed unit to edit")
	}
	env.Payload, env.PayloadDigest = base64.StdEncoding.EncodeToString([]byte(edited)), ""
	tampered := filepath.Join(dir, "tampered.dsse.json")
	b1, _ := json.Marshal(env)
	os.WriteFile(tampered, b1, 0o644)

	here := resources.Source{Keys: keys, NodeUUID: a.Node.DMIUUID}
	if _, err := resources.Verify(good, here); err != nil {
		t.Fatalf("node a's own manifest: %v", err)
	}
	for _, c := range []struct {
		path string
		src  resources.Source
		want error
	}{
		{tampered, here, manifest.ErrBadSignature},
		{forged, here, manifest.ErrWrongNode},
		{other, here, manifest.ErrWrongNode},
		{other, resources.Source{Keys: ka.Pub}, manifest.ErrWrongKey},
		{good, resources.Source{Keys: keys, NodeUUID: a.Node.DMIUUID, MinGeneration: 8}, manifest.ErrStaleGeneration},
	} {
		v, err := resources.Verify(c.path, c.src)
		if v != nil || !errors.Is(err, c.want) {
			t.Errorf("%s with %+v: %v, want %v", filepath.Base(c.path), c.src, err, c.want)
		}
	}
}

// hgxLayout is Fabric Manager's default partition table of HGX B200/B300 as module-ID
// sets (Fabric Manager User Guide, "DGX B200/B300 and NVIDIA HGX B200/B300"), the
// single-GPU partitions included.
var hgxLayout = [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 2}, {3, 4}, {5, 6}, {7, 8},
	{1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}

// nvlinkNode is manifesttest's B300, all eight units ready, with the HGX layout and
// gpu<i> on module i+1.
func nvlinkNode() *manifest.Manifest {
	m := manifesttest.B300(7)
	m.NVLink = &manifest.NVLink{Partitions: hgxLayout, Source: "profile"}
	for i := range m.Units {
		m.Units[i].ModuleID, m.Units[i].ModuleSource = i+1, "nvml"
	}
	return m
}

// modules are the module IDs of manifest units, by unit.
func modules(m *manifest.Manifest) map[string]int {
	out := map[string]int{}
	for _, u := range m.Units {
		out[u.ID] = u.ModuleID
	}
	return out
}

// nvlinkUnits checks an NVLink claim's allocation: request u<i>-<r> got a device of
// role r, each group's devices are one unit, the groups n different units; it returns
// the units' module IDs, ascending.
func nvlinkUnits(t *testing.T, objs *resources.Objects, m *manifest.Manifest, s resources.Shape, n int, r *resourceapi.AllocationResult) []int {
	t.Helper()
	byName := map[string]resourceapi.Device{}
	for _, d := range objs.Devices {
		byName[d.Name] = d
	}
	names := s.NVLinkRequestNames(n)
	if len(r.Devices.Results) != len(names) {
		t.Fatalf("%d devices allocated for %d requests", len(r.Devices.Results), len(names))
	}
	group := make([]string, n)
	for _, res := range r.Devices.Results {
		d := byName[res.Device]
		u, role := *d.Attributes[resources.AttrUnit].StringValue, *d.Attributes[resources.AttrRole].StringValue
		i := indexOf(names, res.Request)
		if i < 0 || s[i%len(s)] != role {
			t.Errorf("request %s got %s (role %s)", res.Request, res.Device, role)
			continue
		}
		g := i / len(s)
		if group[g] != "" && group[g] != u {
			t.Errorf("group u%d got devices of units %s and %s", g, group[g], u)
		}
		group[g] = u
	}
	if len(sets.New(group...)) != n {
		t.Fatalf("groups got units %v, want %d different units", group, n)
	}
	mods := modules(m)
	var out []int
	for _, u := range group {
		out = append(out, mods[u])
	}
	slices.Sort(out)
	return out
}

// partitionOf is the layout's partition of exactly these modules, "" when none is.
func partitionOf(mods []int) string {
	for _, p := range hgxLayout {
		if slices.Equal(p, mods) {
			return fmt.Sprint(p)
		}
	}
	return ""
}

// TestNVLinkAttributes: every device of a unit with a known module ID says, per
// partition size of the layout, which partition holds it and its place there; a unit of
// unknown module ID says nothing; a node without a layout publishes no NVLink attribute
// and no NVLink template.
func TestNVLinkAttributes(t *testing.T) {
	m := nvlinkNode()
	m.Units[2].ModuleID, m.Units[2].ModuleSource = 0, ""
	objs, err := resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"gpu0": "module 1: 2 1.2 @0, 4 1.2.3.4 @0, 8 1.2.3.4.5.6.7.8 @0",
		"gpu1": "module 2: 2 1.2 @1, 4 1.2.3.4 @1, 8 1.2.3.4.5.6.7.8 @1",
		"gpu2": "",
		"gpu3": "module 4: 2 3.4 @1, 4 1.2.3.4 @3, 8 1.2.3.4.5.6.7.8 @3",
		"gpu7": "module 8: 2 7.8 @1, 4 5.6.7.8 @3, 8 1.2.3.4.5.6.7.8 @7",
	}
	for _, d := range objs.Devices {
		u := *d.Attributes[resources.AttrUnit].StringValue
		w, ok := want[u]
		if !ok {
			continue
		}
		got := ""
		if a, ok := d.Attributes[resources.AttrModuleID]; ok {
			var parts []string
			for _, n := range []int{2, 4, 8} {
				p, i := d.Attributes[resources.AttrNVLinkPartition(n)], d.Attributes[resources.AttrNVLinkIndex(n)]
				if p.StringValue == nil || i.IntValue == nil {
					t.Fatalf("device %s: size %d: partition %v index %v", d.Name, n, p, i)
				}
				parts = append(parts, fmt.Sprintf("%d %s @%d", n, *p.StringValue, *i.IntValue))
			}
			got = fmt.Sprintf("module %d: %s", *a.IntValue, strings.Join(parts, ", "))
		}
		for k := range d.Attributes {
			if strings.HasPrefix(string(k), "nvlink") && got == "" {
				t.Errorf("device %s of unknown module has %s", d.Name, k)
			}
		}
		if got != w {
			t.Errorf("device %s: %q, want %q", d.Name, got, w)
		}
	}
	var names []string
	for _, tmpl := range objs.NVLinkTemplates {
		names = append(names, tmpl.Name)
	}
	if want := []string{b300.NVLinkTemplateName(2), b300.NVLinkTemplateName(4), b300.NVLinkTemplateName(8)}; !slices.Equal(names, want) {
		t.Fatalf("NVLink templates %v, want %v", names, want)
	}

	m.NVLink = nil
	objs, err = resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(objs.NVLinkTemplates) != 0 {
		t.Errorf("NVLink templates without a layout: %d", len(objs.NVLinkTemplates))
	}
	for _, d := range objs.Devices {
		for k := range d.Attributes {
			if strings.HasPrefix(string(k), "nvlink") || k == resources.AttrModuleID {
				t.Fatalf("device %s has %s without a layout", d.Name, k)
			}
		}
	}

	// Units of five functions: eight of them are 40 requests, more than a claim takes;
	// that template is left out, saying why, and the others are rendered.
	m = nvlinkNode()
	for i := range m.Units {
		f := m.Units[i].Functions[1]
		f.BDF, f.Role, f.IOMMUGroup = f.BDF[:len(f.BDF)-1]+"2", "data-direct", f.IOMMUGroup+100
		m.Units[i].Functions = append(m.Units[i].Functions, f)
	}
	objs, err = resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	five := objs.Shapes[0]
	names = nil
	for _, tmpl := range objs.NVLinkTemplates {
		names = append(names, tmpl.Name)
	}
	if want := []string{five.NVLinkTemplateName(2), five.NVLinkTemplateName(4)}; !slices.Equal(names, want) ||
		len(objs.NVLinkLeftOut) != 1 || !strings.Contains(objs.NVLinkLeftOut[0], five.NVLinkTemplateName(8)+": shape "+five.String()+", NVLink partition of 8: 40 requests, a claim takes at most 32") {
		t.Fatalf("five-function units: NVLink templates %v, left out %q", names, objs.NVLinkLeftOut)
	}

	// A module two units give cannot be told apart: the manifest is refused, naming it
	// (by the one verification path, before anything is rendered).
	m = nvlinkNode()
	m.Units[5].ModuleID = 5
	dir := t.TempDir()
	k := signedtest.NewKey(t, filepath.Join(dir, "keys"), "node", 1, m.Node.DMIUUID)
	path := k.Sign(t, m, filepath.Join(dir, "manifest.dsse.json"))
	if _, err := resources.Verify(path, resources.Source{Keys: filepath.Dir(k.Pub), NodeUUID: m.Node.DMIUUID}); err == nil || !strings.Contains(err.Error(), `unit "gpu5": Module ID 5 also unit "gpu4"'s`) {
		t.Fatalf("verify with module 5 twice: %v", err)
	}
}

// TestAllocatorNVLinkPartitions: the real allocator gives an NVLink claim of n units
// exactly the units of one partition of n, whole, or nothing. On a node with all eight
// ready: four claims of 2 get the four pairs and a fifth gets nothing; a claim of 4
// gets 1-4 or 5-8; a claim of 8 gets all eight; a pair taken leaves 4 units for a claim
// of 4 only on the other half, and no 8.
func TestAllocatorNVLinkPartitions(t *testing.T) {
	m := nvlinkNode()
	objs, err := resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	claim := func(a *allocator, name string, n int) []int {
		t.Helper()
		r := a.allocateSpec(t, name, resources.NVLinkClaimSpec(b300, n))
		if r == nil {
			return nil
		}
		mods := nvlinkUnits(t, objs, m, b300, n, r)
		if partitionOf(mods) == "" {
			t.Fatalf("claim %s of %d units got modules %v: not a partition", name, n, mods)
		}
		return mods
	}

	a := newAllocator(objs)
	seen := map[string]bool{}
	for i := range 4 {
		mods := claim(a, fmt.Sprintf("pair%d", i), 2)
		if mods == nil {
			t.Fatalf("claim %d of 2 units: nothing, with %d pairs free", i, 4-i)
		}
		seen[partitionOf(mods)] = true
	}
	if len(seen) != 4 {
		t.Fatalf("four claims of 2 got %v", seen)
	}
	if mods := claim(a, "pair4", 2); mods != nil {
		t.Fatalf("a fifth claim of 2 got modules %v", mods)
	}
	if r := a.allocate(t, "single", b300); r != nil {
		t.Fatalf("four pairs exhaust the node, yet a unit claim got %v", r.Devices.Results)
	}

	a = newAllocator(objs)
	q0, q1 := claim(a, "quad0", 4), claim(a, "quad1", 4)
	if q0 == nil || q1 == nil || partitionOf(q0) == partitionOf(q1) {
		t.Fatalf("two claims of 4: %v and %v, want 1-4 and 5-8", q0, q1)
	}
	if mods := claim(a, "quad2", 4); mods != nil {
		t.Fatalf("a third claim of 4 got %v", mods)
	}

	a = newAllocator(objs)
	if mods := claim(a, "all", 8); !slices.Equal(mods, []int{1, 2, 3, 4, 5, 6, 7, 8}) {
		t.Fatalf("a claim of 8: %v", mods)
	}
	if mods := claim(a, "all2", 8); mods != nil {
		t.Fatalf("a second claim of 8 got %v", mods)
	}

	a = newAllocator(objs)
	p := claim(a, "pair", 2)
	if p == nil {
		t.Fatal("a claim of 2 on an empty node: nothing")
	}
	q := claim(a, "quad", 4)
	if q == nil || slices.Contains(q, p[0]) {
		t.Fatalf("after pair %v, a claim of 4 got %v, want the other half", p, q)
	}
	if mods := claim(a, "quad-again", 4); mods != nil {
		t.Fatalf("a second claim of 4 beside pair %v got %v", p, mods)
	}
	if mods := claim(a, "all", 8); mods != nil {
		t.Fatalf("a claim of 8 beside pair %v got %v", p, mods)
	}
	if mods := claim(a, "pair-again", 2); mods == nil || partitionOf(mods) == partitionOf(p) {
		t.Fatalf("the other pair of the half: %v", mods)
	}
}

// TestAllocatorNVLinkNeverMixes: a partition one of whose units is not offered, is of
// another shape, or has a function taken is not allocatable as a whole, and the
// allocator does not make up the claim from units of two partitions. Units of unknown module ID never go to an NVLink
// claim, and a node without a layout fails NVLink claims without error.
func TestAllocatorNVLinkNeverMixes(t *testing.T) {
	m := nvlinkNode()
	objs, err := resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	takeUnit := func(a *allocator, i int) {
		for _, f := range m.Units[i].Functions {
			a.take(resources.DeviceName(m.Units[i].ID, f.BDF))
		}
	}
	spec := func(n int) resourceapi.ResourceClaimSpec { return resources.NVLinkClaimSpec(b300, n) }

	// Only the units of modules 1 and 3 free: no pair, though two units are.
	a := newAllocator(objs)
	for _, i := range []int{1, 3, 4, 5, 6, 7} {
		takeUnit(a, i)
	}
	if r := a.allocateSpec(t, "mix", spec(2)); r != nil {
		t.Fatalf("modules 1 and 3 allocated as a pair: %v", r.Devices.Results)
	}
	// Each is still a unit to claim alone.
	for i := range 2 {
		if r := a.allocate(t, fmt.Sprintf("single%d", i), b300); r == nil {
			t.Fatalf("unit claim %d beside modules 1 and 3 free: nothing", i)
		}
	}

	// One function (module 2's NIC) taken: pair 1-2, quad 1-4 and the eight are out.
	for _, c := range []struct {
		n    int
		want []string
	}{
		{2, []string{"[3 4]", "[5 6]", "[7 8]"}},
		{4, []string{"[5 6 7 8]"}},
		{8, nil},
	} {
		b := newAllocator(objs)
		b.take(resources.DeviceName("gpu1", m.Units[1].Functions[2].BDF))
		var got []string
		for i := 0; ; i++ {
			r := b.allocateSpec(t, fmt.Sprintf("c%d-%d", c.n, i), spec(c.n))
			if r == nil {
				break
			}
			got = append(got, partitionOf(nvlinkUnits(t, objs, m, b300, c.n, r)))
		}
		slices.Sort(got)
		if !slices.Equal(got, c.want) {
			t.Errorf("module 2's NIC taken: claims of %d got %v, want %v", c.n, got, c.want)
		}
	}

	// Not ready: gpu1 (module 2) failed, gpu4 (module 5) degraded and published: the
	// partitions holding either are never allocated, whatever the claim's size.
	nr := nvlinkNode()
	nr.Units[1].Status, nr.Units[1].Reasons = manifest.StatusFailed, []string{"acs: mismatch"}
	nr.Units[4].Status, nr.Units[4].Reasons = manifest.StatusDegraded, []string{"erase: auto: nvme not erased"}
	nobjs, err := resources.Render(verified(t, nr), resources.Options{Degraded: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		n    int
		want []string
	}{
		{2, []string{"[3 4]", "[7 8]"}},
		{4, nil},
		{8, nil},
	} {
		b := newAllocator(nobjs)
		var got []string
		for i := 0; ; i++ {
			r := b.allocateSpec(t, fmt.Sprintf("c%d-%d", c.n, i), spec(c.n))
			if r == nil {
				break
			}
			got = append(got, partitionOf(nvlinkUnits(t, nobjs, nr, b300, c.n, r)))
		}
		slices.Sort(got)
		if !slices.Equal(got, c.want) {
			t.Errorf("module 2 failed, 5 degraded: claims of %d got %v, want %v", c.n, got, c.want)
		}
	}

	// node(): gpu1 (module 2) lost its NVMe, a unit of another shape; gpu2 (3) is
	// degraded and not published, gpu3 (4) failed. Pair 1-2 mixes two shapes, which no
	// template takes; 3-4 has no unit offered: only 5-6 and 7-8 pair.
	sm := node()
	sm.NVLink = &manifest.NVLink{Partitions: hgxLayout, Source: "profile"}
	for i := range sm.Units {
		sm.Units[i].ModuleID, sm.Units[i].ModuleSource = i+1, "test wiring"
	}
	sobjs, err := resources.Render(verified(t, sm), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sobjs.Shapes {
		b := newAllocator(sobjs)
		var got []string
		for i := 0; ; i++ {
			r := b.allocateSpec(t, fmt.Sprintf("p%d", i), resources.NVLinkClaimSpec(s, 2))
			if r == nil {
				break
			}
			got = append(got, partitionOf(nvlinkUnits(t, sobjs, sm, s, 2, r)))
		}
		want := []string{"[5 6]", "[7 8]"}
		if s.String() != b300.String() {
			want = nil
		}
		if slices.Sort(got); !slices.Equal(got, want) {
			t.Errorf("node(): claims of 2 units of shape %s got %v, want %v", s, got, want)
		}
	}

	// Unknown module IDs (modules 1 and 2 not read): those units are claimed alone and
	// never by an NVLink claim; the rest pair as before.
	um := nvlinkNode()
	um.Units[0].ModuleID, um.Units[1].ModuleID = 0, 0
	um.Units[0].ModuleSource, um.Units[1].ModuleSource = "", ""
	uobjs, err := resources.Render(verified(t, um), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	b := newAllocator(uobjs)
	var pairs []string
	for i := 0; ; i++ {
		r := b.allocateSpec(t, fmt.Sprintf("p%d", i), spec(2))
		if r == nil {
			break
		}
		pairs = append(pairs, partitionOf(nvlinkUnits(t, uobjs, um, b300, 2, r)))
	}
	if slices.Sort(pairs); !slices.Equal(pairs, []string{"[3 4]", "[5 6]", "[7 8]"}) {
		t.Fatalf("with modules 1 and 2 unknown, pairs %v", pairs)
	}
	for i := range 2 {
		r := b.allocate(t, fmt.Sprintf("single%d", i), b300)
		if u := unitOf(t, uobjs, b300, r); u != "gpu0" && u != "gpu1" {
			t.Fatalf("unit claim %d got %s, want gpu0 or gpu1", i, u)
		}
	}

	// No layout: no attributes, and an NVLink claim (written by hand, no template is
	// published) is not allocated — not an allocation error (the selectors' has()).
	m.NVLink = nil
	plain, err := resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r := newAllocator(plain).allocateSpec(t, "no-layout", spec(2)); r != nil {
		t.Fatalf("an NVLink claim on a node without a layout got %v", r.Devices.Results)
	}
}

// TestAllocatorNVLinkFailsFast: a claim of 8 on a node where one unit is missing from
// the partition fails in a bounded search, as kube-scheduler's Filter must (its DRA
// filter gives up after 10 s by default): group i selects the one unit at place i, so a
// partition that is not whole is tried once, not in all orders of its units.
func TestAllocatorNVLinkFailsFast(t *testing.T) {
	m := nvlinkNode()
	objs, err := resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a := newAllocator(objs)
	a.take(resources.DeviceName("gpu7", m.Units[7].Functions[3].BDF))
	start := time.Now()
	if r := a.allocateSpec(t, "eight", resources.NVLinkClaimSpec(b300, 8)); r != nil {
		t.Fatalf("a claim of 8 with gpu7's NVMe taken got %v", r.Devices.Results)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("a claim of 8 failed after %v", d)
	}
}
