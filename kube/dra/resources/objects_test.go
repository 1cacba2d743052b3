package resources_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/operation"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/dynamic-resource-allocation/cel"

	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// strict is the API server's strict decoder (the serializer kubectl --validate=strict
// and the server's field validation use): unknown and duplicate fields are errors.
func strict(t *testing.T) runtime.Decoder {
	scheme := strictScheme(t)
	return kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme, kjson.SerializerOptions{Yaml: true, Strict: true})
}

func strictScheme(t *testing.T) *runtime.Scheme {
	scheme := runtime.NewScheme()
	if err := resourceapi.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	return scheme
}

func documents(t *testing.T, b []byte) [][]byte {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var out [][]byte
	for {
		d, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
}

// TestObjectsDecodeStrictlyAndValidate: the YAML passage-dra slices prints decodes
// strictly into the pinned k8s.io/api types and back to the same objects, and passes
// the declarative validation k8s.io/api ships (zz_generated.validations.go), the CEL
// compiler the API server checks selectors with, and the name rules of
// apimachinery's validation package. Not checked here: the hand-written validation in
// k8s.io/kubernetes/pkg/apis/resource/validation (not a dependency: too big), such as
// the cross-field rules of a slice's node selection; a cluster checks those.
func TestObjectsDecodeStrictlyAndValidate(t *testing.T) {
	// With an NVLink layout, so the NVLink templates of both shapes are checked too.
	m := node()
	m.NVLink = &manifest.NVLink{Partitions: hgxLayout, Source: "profile"}
	for i := range m.Units {
		m.Units[i].ModuleID, m.Units[i].ModuleSource = i+1, "test wiring"
	}
	objs, err := resources.Render(verified(t, m), resources.Options{Degraded: true,
		PCIeRoot: func(bdf string) (string, error) { return "pci0000:" + bdf[5:7], nil }})
	if err != nil {
		t.Fatal(err)
	}
	if len(objs.NVLinkTemplates) != 6 {
		t.Fatalf("%d NVLink templates, want 2, 4 and 8 units of both shapes", len(objs.NVLinkTemplates))
	}
	var out bytes.Buffer
	if err := resources.WriteYAML(&out, objs.List()); err != nil {
		t.Fatal(err)
	}
	dec := strict(t)
	docs := documents(t, out.Bytes())
	want := objs.List()
	if len(docs) != len(want) {
		t.Fatalf("%d documents, want %d", len(docs), len(want))
	}
	ctx := context.Background()
	// Every option a validation tag names must be defined (operation.HasOption); the
	// one resource/v1 names is a feature these slices do not use.
	create := operation.Operation{Type: operation.Create, Options: map[string]bool{"DRAPartitionableDevicesType": false}}
	compiler := cel.GetCompiler(cel.Features{})
	for i, d := range docs {
		got, _, err := dec.Decode(d, nil, nil)
		if err != nil {
			t.Fatalf("document %d: %v\n%s", i, err, d)
		}
		if !equality.Semantic.DeepEqual(got, want[i]) {
			t.Fatalf("document %d decodes to %#v, want %#v", i, got, want[i])
		}
		var errs field.ErrorList
		var selectors []resourceapi.DeviceSelector
		switch o := got.(type) {
		case *resourceapi.ResourceSlice:
			errs = resourceapi.Validate_ResourceSliceSpec(ctx, create, field.NewPath("spec"), &o.Spec, nil)
			errs = append(errs, handwritten(o)...)
		case *resourceapi.DeviceClass:
			errs = resourceapi.Validate_DeviceClassSpec(ctx, create, field.NewPath("spec"), &o.Spec, nil)
			selectors = o.Spec.Selectors
		case *resourceapi.ResourceClaimTemplate:
			errs = resourceapi.Validate_ResourceClaimTemplateSpec(ctx, create, field.NewPath("spec"), &o.Spec, nil)
			reqs := map[string]bool{}
			for _, r := range o.Spec.Spec.Devices.Requests {
				selectors = append(selectors, r.Exactly.Selectors...)
				if msgs := validation.IsDNS1123Label(r.Name); len(msgs) > 0 {
					t.Errorf("request %s: %v", r.Name, msgs)
				}
				if reqs[r.Name] {
					t.Errorf("template %s: request %s twice", o.Name, r.Name)
				}
				reqs[r.Name] = true
			}
			// The API server's hand-written rules for a claim's constraints
			// (validateDeviceConstraint): each names requests of the claim, once.
			if n := len(o.Spec.Spec.Devices.Constraints); n > resourceapi.DeviceConstraintsMaxSize {
				t.Errorf("template %s: %d constraints", o.Name, n)
			}
			for _, c := range o.Spec.Spec.Devices.Constraints {
				seen := map[string]bool{}
				for _, r := range c.Requests {
					if !reqs[r] || seen[r] {
						t.Errorf("template %s: constraint names request %s, unknown or twice", o.Name, r)
					}
					seen[r] = true
				}
			}
		default:
			t.Fatalf("document %d: %T", i, got)
		}
		for _, m := range []string{want[i].(interface{ GetName() string }).GetName()} {
			if msgs := validation.IsDNS1123Subdomain(m); len(msgs) > 0 {
				t.Errorf("name %s: %v", m, msgs)
			}
		}
		if len(errs) > 0 {
			t.Errorf("document %d: %v", i, errs.ToAggregate())
		}
		for _, s := range selectors {
			if r := compiler.CompileCELExpression(s.CEL.Expression, cel.Options{}); r.Error != nil {
				t.Errorf("selector %q: %v", s.CEL.Expression, r.Error)
			}
		}
	}
	// The same objects as JSON decode strictly too.
	jdec := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, strictScheme(t), strictScheme(t), kjson.SerializerOptions{Strict: true})
	for i, obj := range want {
		b, err := json.Marshal(obj)
		if err != nil {
			t.Fatal(err)
		}
		got, _, err := jdec.Decode(b, nil, nil)
		if err != nil || !equality.Semantic.DeepEqual(got, obj) {
			t.Fatalf("object %d as JSON: %v", i, err)
		}
	}
	// The decoder and the validation refuse what they should: an unknown field, and an
	// attribute with two values (a union).
	slice := docs[len(docs)-1]
	bad := bytes.Replace(slice, []byte("spec:\n"), []byte("spec:\n  bogus: 1\n"), 1)
	if _, _, err := dec.Decode(bad, nil, nil); err == nil || !strings.Contains(err.Error(), "bogus") {
		t.Fatalf("a slice with an unknown field decoded: %v", err)
	}
	s := objs.Slices[0].DeepCopy()
	n := int64(1)
	a := s.Spec.Devices[0].Attributes[resources.AttrUnit]
	a.IntValue = &n
	s.Spec.Devices[0].Attributes[resources.AttrUnit] = a
	if errs := resourceapi.Validate_ResourceSliceSpec(ctx, create, field.NewPath("spec"), &s.Spec, nil); len(errs) == 0 {
		t.Fatal("an attribute with a string and an int passed validation")
	}
}

// handwritten holds a slice to the API's limits that the declarative validation does
// not cover: device names (DNS labels, unique in the pool), attribute names (a C
// identifier with an optional domain) and counts.
func handwritten(s *resourceapi.ResourceSlice) field.ErrorList {
	var errs field.ErrorList
	p := field.NewPath("spec")
	for _, msg := range validation.IsDNS1123Subdomain(s.Spec.Driver) {
		errs = append(errs, field.Invalid(p.Child("driver"), s.Spec.Driver, msg))
	}
	if len(s.Spec.Devices) > resourceapi.ResourceSliceMaxDevices {
		errs = append(errs, field.TooMany(p.Child("devices"), len(s.Spec.Devices), resourceapi.ResourceSliceMaxDevices))
	}
	seen := map[string]bool{}
	for i, d := range s.Spec.Devices {
		dp := p.Child("devices").Index(i)
		for _, msg := range validation.IsDNS1123Label(d.Name) {
			errs = append(errs, field.Invalid(dp.Child("name"), d.Name, msg))
		}
		if seen[d.Name] {
			errs = append(errs, field.Duplicate(dp.Child("name"), d.Name))
		}
		seen[d.Name] = true
		if len(d.Attributes) > resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice {
			errs = append(errs, field.TooMany(dp.Child("attributes"), len(d.Attributes), resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice))
		}
		for k := range d.Attributes {
			domain, id, found := strings.Cut(string(k), "/")
			if !found {
				domain, id = "", domain
			}
			if domain != "" {
				for _, msg := range validation.IsDNS1123Subdomain(domain) {
					errs = append(errs, field.Invalid(dp.Child("attributes"), k, msg))
				}
				if len(domain) > resourceapi.DeviceMaxDomainLength {
					errs = append(errs, field.TooLong(dp.Child("attributes"), k, resourceapi.DeviceMaxDomainLength))
				}
			}
			for _, msg := range validation.IsCIdentifier(id) {
				errs = append(errs, field.Invalid(dp.Child("attributes"), k, msg))
			}
			if len(id) > resourceapi.DeviceMaxIDLength {
				errs = append(errs, field.TooLong(dp.Child("attributes"), k, resourceapi.DeviceMaxIDLength))
			}
		}
	}
	return errs
}

// TestSlicesSplitAtTheLimit: a node with more functions than a slice takes gets a pool
// of several slices, each within ResourceSliceMaxDevices, the count in every slice.
func TestSlicesSplitAtTheLimit(t *testing.T) {
	m := manifesttest.B300(3)
	base := m.Units
	for k := 1; len(m.Units) < 40; k++ {
		for _, u := range base {
			u.ID = fmt.Sprintf("%s-%d", u.ID, k)
			fns := append([]manifest.Function{}, u.Functions...)
			for i := range fns {
				fns[i].BDF = fmt.Sprintf("%04x%s", k, fns[i].BDF[4:])
			}
			u.Functions = fns
			m.Units = append(m.Units, u)
		}
	}
	objs, err := resources.Render(verified(t, m), resources.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(objs.Devices) != 160 || len(objs.Slices) != 2 {
		t.Fatalf("%d devices in %d slices, want 160 in 2", len(objs.Devices), len(objs.Slices))
	}
	total := 0
	for _, s := range objs.Slices {
		if len(s.Spec.Devices) > resourceapi.ResourceSliceMaxDevices || s.Spec.Pool.ResourceSliceCount != 2 || s.Spec.Pool.Generation != 3 {
			t.Errorf("slice %s: %d devices, pool %+v", s.Name, len(s.Spec.Devices), s.Spec.Pool)
		}
		if errs := handwritten(s); len(errs) > 0 {
			t.Error(errs.ToAggregate())
		}
		total += len(s.Spec.Devices)
	}
	if total != 160 {
		t.Fatalf("%d devices in the slices", total)
	}
}

// TestRenderRefusesWhatTheAPIWould: a unit ID that cannot be part of a device name is
// refused, naming the unit.
func TestRenderRefusesWhatTheAPIWould(t *testing.T) {
	m := manifesttest.B300(3)
	m.Units[2].ID = "GPU_2"
	_, err := resources.Render(verified(t, m), resources.Options{})
	if err == nil || !strings.Contains(err.Error(), `unit "GPU_2"`) {
		t.Fatalf("render: %v", err)
	}
}

// TestPoolIsTheHostname: with a Kubernetes node name other than the manifest's
// hostname, the slices are the node's (spec.nodeName) and their pool is the hostname,
// the name passage-control's DeviceTaintRule selects; a hostname that cannot be a pool
// name is refused, naming it.
func TestPoolIsTheHostname(t *testing.T) {
	m := manifesttest.B300(3)
	objs, err := resources.Render(verified(t, m), resources.Options{NodeName: "worker-7"})
	if err != nil {
		t.Fatal(err)
	}
	if objs.Node != "worker-7" || objs.Pool != m.Node.Hostname {
		t.Fatalf("node %q pool %q, want worker-7 and %q", objs.Node, objs.Pool, m.Node.Hostname)
	}
	for _, s := range objs.Slices {
		if s.Spec.NodeName == nil || *s.Spec.NodeName != "worker-7" || s.Spec.Pool.Name != m.Node.Hostname {
			t.Errorf("slice %s: node %v pool %q", s.Name, s.Spec.NodeName, s.Spec.Pool.Name)
		}
		if errs := handwritten(s); len(errs) > 0 {
			t.Error(errs.ToAggregate())
		}
	}
	m.Node.Hostname = "B300_A"
	if _, err := resources.Render(verified(t, m), resources.Options{NodeName: "worker-7"}); err == nil || !strings.Contains(err.Error(), `hostname "B300_A"`) {
		t.Fatalf("render of hostname B300_A: %v", err)
	}
}
