package resources_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/passage-boot/passage/dra/internal/signedtest"
	"github.com/passage-boot/passage/dra/resources"
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
