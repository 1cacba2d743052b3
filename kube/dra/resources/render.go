package resources

import (
	"fmt"
	"math"
	"sort"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/passage-boot/passage/manifest"
)

// DriverName is the DRA driver's name: the domain of its attributes and what its
// DeviceClass selects (a DNS subdomain of at most resourceapi.DriverNameMaxLength).
const DriverName = "passage-boot.github.io"

// ClassName is the DeviceClass every unit claim's requests name.
const ClassName = "unit-function." + DriverName

// The attributes of every device (a function of a unit), besides the standard ones. In a
// CEL selector: device.attributes["passage-boot.github.io"].unit.
const (
	AttrUnit       = "unit"       // the manifest's unit ID (gpu3)
	AttrRole       = "role"       // the function's role (gpu, gpu-nic, gpu-nvme, data-direct)
	AttrShape      = "shape"      // the unit's roles, Shape: a claim for one shape never takes part of another
	AttrStatus     = "status"     // ready, or degraded (published only with Options.Degraded)
	AttrGeneration = "generation" // the manifest's generation
	AttrIOMMUGroup = "iommuGroup" // the function's IOMMU group: /dev/vfio/<group>
)

// The standard attributes (k8s.io/dynamic-resource-allocation/deviceattribute; KEP-4381
// and KEP-5304): KubeVirt's virt-launcher reads pciBusID from the device metadata.
const (
	AttrPCIBusID = "resource.kubernetes.io/pciBusID"
	AttrPCIeRoot = "resource.kubernetes.io/pcieRoot"
	AttrNUMANode = "resource.kubernetes.io/numaNode"
)

// UnitAttribute is the fully qualified attribute every unit claim's constraint matches.
const UnitAttribute resourceapi.FullyQualifiedName = DriverName + "/" + AttrUnit

// Options are the choices of rendering.
type Options struct {
	// NodeName is the Kubernetes node the slices are for; "" takes the manifest's
	// hostname.
	NodeName string
	// Degraded publishes degraded units too (their devices say status degraded); by
	// default only ready units are offered.
	Degraded bool
	// PCIeRoot returns a function's PCIe root complex (pci<domain>:<bus>), which the
	// manifest does not carry: the node plugin reads it from sysfs
	// (deviceattribute.GetPCIeRootAttributeByPCIBusID). nil: the attribute is left out.
	PCIeRoot func(bdf string) (string, error)
	// Withhold are units not to offer although the manifest says ready: released by a
	// claim, they wait for recycle and a newer manifest.
	Withhold map[string]bool
	// Taints are units published although withheld or not ready, every device of each
	// carrying the unit's taints: a quarantined unit, visible in the API with its
	// reason, allocated to no claim without a toleration (and prepared for none).
	Taints map[string][]resourceapi.DeviceTaint
	// NoNVLink, when not empty, says why no device carries an NVLink attribute and no
	// NVLink template is rendered: the node's Fabric Manager disagrees with the
	// manifest's Module IDs or layout, so no partition it offers could be activated.
	NoNVLink string
}

// Objects are what a manifest renders to.
type Objects struct {
	// Node is the Kubernetes node the slices are for (their spec.nodeName).
	Node string
	// Pool is the slices' pool: the manifest's hostname, whatever the Kubernetes node is
	// named. It is the name the control plane knows the node by from the first manifest
	// it is POSTed, before the node has joined the cluster or its plugin has published
	// anything, so its DeviceTaintRule (selecting driver and pool) is on the node's
	// devices from the start; a pool named after the Kubernetes node would leave them
	// untainted wherever --node-name differs from the hostname.
	Pool       string
	Generation int64
	// Devices are every device offered, in manifest order; Slices hold them, at most
	// resourceapi.ResourceSliceMaxDevices each.
	Devices   []resourceapi.Device
	Slices    []*resourceapi.ResourceSlice
	Class     *resourceapi.DeviceClass
	Templates []*resourceapi.ResourceClaimTemplate
	// DegradedTemplates are, only when Options.Degraded publishes degraded units, a
	// template per shape that takes a ready or a degraded unit (Shape.DegradedTemplateName):
	// a tenant gets a degraded unit only by claiming from one of these.
	DegradedTemplates []*resourceapi.ResourceClaimTemplate
	// Shapes are the templates' unit shapes, in the same order.
	Shapes []Shape
	// NVLinkTemplates are, for each shape and each partition size of the manifest's
	// NVLink layout that an offered unit of the shape is in, the template of one whole
	// partition of that many units (NVLinkTemplate), by shape and then size.
	NVLinkTemplates []*resourceapi.ResourceClaimTemplate
	// NVLinkLeftOut are the NVLink templates not rendered because the API would refuse
	// them, each with why (eight units of five functions are more requests than a claim
	// takes).
	NVLinkLeftOut []string
}

// Shape is a unit's functions by role, in the manifest's order (GPU first): what one
// ResourceClaimTemplate requests.
type Shape []string

// String is the shape's attribute value: the roles joined by "+".
func (s Shape) String() string { return strings.Join(s, "+") }

// TemplateName names the shape's ResourceClaimTemplate: "unit-" and the roles as DNS
// labels (unit-gpu.gpu-nic.gpu-nic.gpu-nvme).
func (s Shape) TemplateName() string { return "unit-" + strings.Join(s, ".") }

// DegradedTemplateName names the shape's template that also takes a degraded unit
// (unit-gpu.gpu-nic.gpu-nic.gpu-nvme-or-degraded).
func (s Shape) DegradedTemplateName() string { return s.TemplateName() + "-or-degraded" }

// RequestNames are the template's request names, one per function: the role, with an
// index when the shape has the role more than once (gpu, gpu-nic-0, gpu-nic-1, gpu-nvme).
func (s Shape) RequestNames() []string {
	count := map[string]int{}
	for _, r := range s {
		count[r]++
	}
	seen := map[string]int{}
	out := make([]string, len(s))
	for i, r := range s {
		out[i] = r
		if count[r] > 1 {
			out[i] = fmt.Sprintf("%s-%d", r, seen[r])
		}
		seen[r]++
	}
	return out
}

func shapeOf(u *manifest.Unit) Shape {
	s := make(Shape, len(u.Functions))
	for i, f := range u.Functions {
		s[i] = f.Role
	}
	return s
}

// DeviceName is the device of a function: the unit and the address as one DNS label
// (gpu3-0000-7b-00-0).
func DeviceName(unit, bdf string) string {
	return unit + "-" + strings.NewReplacer(":", "-", ".", "-").Replace(bdf)
}

// Render builds the objects of a verified manifest. It refuses, naming the unit or
// function, what the API would refuse: a name that is not a DNS label, a value longer
// than the API takes, a generation beyond int64.
func Render(v *manifest.Verified, opts Options) (*Objects, error) {
	m := v.Manifest
	node := opts.NodeName
	if node == "" {
		node = m.Node.Hostname
	}
	if errs := validation.IsDNS1123Subdomain(node); len(errs) > 0 {
		return nil, fmt.Errorf("node name %q: %s", manifest.Printable(node), strings.Join(errs, "; "))
	}
	pool := m.Node.Hostname
	if errs := validation.IsDNS1123Subdomain(pool); len(errs) > 0 {
		return nil, fmt.Errorf("hostname %q (the pool): %s", manifest.Printable(pool), strings.Join(errs, "; "))
	}
	if m.Generation > math.MaxInt64 {
		return nil, fmt.Errorf("manifest generation %d: beyond the API's int64", m.Generation)
	}
	o := &Objects{Node: node, Pool: pool, Generation: int64(m.Generation)}
	nv, sizes, err := nvlinkOf(m)
	if err != nil {
		return nil, fmt.Errorf("manifest: %w", err)
	}
	if opts.NoNVLink != "" {
		nv, sizes = nvlinkAttrs{}, nil
	}
	shapes := map[string]bool{}
	nvShapes := map[string]map[int]bool{} // shape → partition sizes its offered units are in
	for i := range m.Units {
		u := &m.Units[i]
		switch {
		case opts.Taints[u.ID] != nil:
		case opts.Withhold[u.ID]:
			continue
		case u.Status == manifest.StatusReady:
		case u.Status == manifest.StatusDegraded && opts.Degraded:
		default:
			continue
		}
		shape := shapeOf(u)
		if err := checkShape(u.ID, shape); err != nil {
			return nil, err
		}
		if !shapes[shape.String()] {
			shapes[shape.String()] = true
			o.Shapes = append(o.Shapes, shape)
		}
		for _, n := range sizes {
			if _, ok := nv[u.ID][AttrNVLinkPartition(n)]; ok {
				if nvShapes[shape.String()] == nil {
					nvShapes[shape.String()] = map[int]bool{}
				}
				nvShapes[shape.String()][n] = true
			}
		}
		for _, f := range u.Functions {
			d, err := device(m, u, f, shape, nv[u.ID], opts)
			if err != nil {
				return nil, fmt.Errorf("unit %q function %s: %w", manifest.Printable(u.ID), manifest.Printable(f.BDF), err)
			}
			o.Devices = append(o.Devices, d)
		}
	}
	o.Slices = slices(node, pool, o.Generation, o.Devices)
	o.Class = deviceClass()
	sort.Slice(o.Shapes, func(i, j int) bool { return o.Shapes[i].String() < o.Shapes[j].String() })
	for _, s := range o.Shapes {
		o.Templates = append(o.Templates, Template(s, false))
		if opts.Degraded {
			o.DegradedTemplates = append(o.DegradedTemplates, Template(s, true))
		}
	}
	for _, s := range o.Shapes {
		for _, n := range sizes {
			if !nvShapes[s.String()][n] {
				continue
			}
			if err := checkNVLink(s, n); err != nil {
				o.NVLinkLeftOut = append(o.NVLinkLeftOut, fmt.Sprintf("%s: %v", s.NVLinkTemplateName(n), err))
				continue
			}
			o.NVLinkTemplates = append(o.NVLinkTemplates, NVLinkTemplate(s, n))
		}
	}
	return o, nil
}

// checkShape refuses a shape whose names the API would refuse.
func checkShape(unit string, s Shape) error {
	name := fmt.Sprintf("unit %q", manifest.Printable(unit))
	if len(s) == 0 {
		return fmt.Errorf("%s: no functions", name)
	}
	if len(s) > resourceapi.DeviceRequestsMaxSize {
		return fmt.Errorf("%s: %d functions, a claim takes at most %d requests", name, len(s), resourceapi.DeviceRequestsMaxSize)
	}
	if len(s.String()) > resourceapi.DeviceAttributeMaxValueLength {
		return fmt.Errorf("%s: shape %q is longer than an attribute value (%d)", name, manifest.Printable(s.String()), resourceapi.DeviceAttributeMaxValueLength)
	}
	for _, r := range s.RequestNames() {
		if errs := validation.IsDNS1123Label(r); len(errs) > 0 {
			return fmt.Errorf("%s: role %q is not a request name: %s", name, manifest.Printable(r), strings.Join(errs, "; "))
		}
	}
	for _, t := range []string{s.TemplateName(), s.DegradedTemplateName()} {
		if errs := validation.IsDNS1123Subdomain(t); len(errs) > 0 {
			return fmt.Errorf("%s: template name %q: %s", name, manifest.Printable(t), strings.Join(errs, "; "))
		}
	}
	return nil
}

func str(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }
func num(n int64) resourceapi.DeviceAttribute  { return resourceapi.DeviceAttribute{IntValue: &n} }

func device(m *manifest.Manifest, u *manifest.Unit, f manifest.Function, shape Shape, nv map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, opts Options) (resourceapi.Device, error) {
	name := DeviceName(u.ID, f.BDF)
	if errs := validation.IsDNS1123Label(name); len(errs) > 0 {
		return resourceapi.Device{}, fmt.Errorf("device name %q: %s", manifest.Printable(name), strings.Join(errs, "; "))
	}
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		AttrUnit:       str(u.ID),
		AttrRole:       str(f.Role),
		AttrShape:      str(shape.String()),
		AttrStatus:     str(u.Status),
		AttrGeneration: num(int64(m.Generation)),
		AttrIOMMUGroup: num(int64(f.IOMMUGroup)),
		AttrPCIBusID:   str(f.BDF),
	}
	// A value of its own for each device, as every other attribute: no device's slice
	// shares a pointer with another's.
	for k, a := range nv {
		switch {
		case a.StringValue != nil:
			attrs[k] = str(*a.StringValue)
		case a.IntValue != nil:
			attrs[k] = num(*a.IntValue)
		}
	}
	// A function without NUMA affinity publishes no numaNode (deviceattribute's rule).
	if f.NUMANode >= 0 {
		attrs[AttrNUMANode] = num(int64(f.NUMANode))
	}
	if opts.PCIeRoot != nil {
		root, err := opts.PCIeRoot(f.BDF)
		if err != nil {
			return resourceapi.Device{}, fmt.Errorf("pcieRoot: %w", err)
		}
		attrs[AttrPCIeRoot] = str(root)
	}
	for k, a := range attrs {
		if a.StringValue != nil && len(*a.StringValue) > resourceapi.DeviceAttributeMaxValueLength {
			return resourceapi.Device{}, fmt.Errorf("attribute %s: %d characters, the API takes %d", k, len(*a.StringValue), resourceapi.DeviceAttributeMaxValueLength)
		}
	}
	if len(attrs) > resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice {
		return resourceapi.Device{}, fmt.Errorf("%d attributes, the API takes %d", len(attrs), resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice)
	}
	dev := resourceapi.Device{Name: name, Attributes: attrs}
	if t := opts.Taints[u.ID]; len(t) > 0 {
		if len(t) > resourceapi.DeviceTaintsMaxLength {
			return resourceapi.Device{}, fmt.Errorf("%d taints, the API takes %d", len(t), resourceapi.DeviceTaintsMaxLength)
		}
		dev.Taints = append([]resourceapi.DeviceTaint(nil), t...)
	}
	return dev, nil
}

// slices puts the devices into one pool (Objects.Pool) on the node, at most
// ResourceSliceMaxDevices a slice; the pool's generation is the manifest's, so a newer
// manifest's slices supersede an older one's (the allocator uses the highest generation
// of a pool).
func slices(node, pool string, gen int64, devs []resourceapi.Device) []*resourceapi.ResourceSlice {
	n := (len(devs) + resourceapi.ResourceSliceMaxDevices - 1) / resourceapi.ResourceSliceMaxDevices
	if n == 0 {
		n = 1 // an empty pool says "no devices", which the scheduler must know too
	}
	var out []*resourceapi.ResourceSlice
	for i := range n {
		lo := i * resourceapi.ResourceSliceMaxDevices
		hi := min(lo+resourceapi.ResourceSliceMaxDevices, len(devs))
		nodeName := node
		out = append(out, &resourceapi.ResourceSlice{
			TypeMeta:   metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceSlice"},
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%s-%d", node, DriverName, i)},
			Spec: resourceapi.ResourceSliceSpec{
				Driver:   DriverName,
				Pool:     resourceapi.ResourcePool{Name: pool, Generation: gen, ResourceSliceCount: int64(n)},
				NodeName: &nodeName,
				Devices:  devs[lo:hi:hi],
			},
		})
	}
	return out
}

func deviceClass() *resourceapi.DeviceClass {
	return &resourceapi.DeviceClass{
		TypeMeta:   metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "DeviceClass"},
		ObjectMeta: metav1.ObjectMeta{Name: ClassName},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{
			CEL: &resourceapi.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", DriverName)},
		}}},
	}
}

// ClaimSpec is the claim of one whole unit of the shape: one request per function,
// each selecting its role within the shape and the unit's status, all constrained to
// one unit. Every request selects status == "ready" unless degraded: then "ready" or
// "degraded". A degraded unit is thus allocated only when the operator publishes it
// (Options.Degraded, --degraded) and the tenant's claim asks for it (the
// -or-degraded template); a failed unit is never published.
func ClaimSpec(s Shape, degraded bool) resourceapi.ResourceClaimSpec {
	names := s.RequestNames()
	status := fmt.Sprintf("device.attributes[%q].%s == %q", DriverName, AttrStatus, manifest.StatusReady)
	if degraded {
		status = fmt.Sprintf("device.attributes[%q].%s in [%q, %q]", DriverName, AttrStatus, manifest.StatusReady, manifest.StatusDegraded)
	}
	var reqs []resourceapi.DeviceRequest
	for i, role := range s {
		expr := fmt.Sprintf("device.attributes[%q].%s == %q && device.attributes[%q].%s == %q && %s",
			DriverName, AttrRole, role, DriverName, AttrShape, s.String(), status)
		reqs = append(reqs, resourceapi.DeviceRequest{Name: names[i], Exactly: &resourceapi.ExactDeviceRequest{
			DeviceClassName: ClassName,
			Selectors:       []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}},
			AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
			Count:           1,
		}})
	}
	attr := UnitAttribute
	return resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
		Requests: reqs,
		// No request names: the constraint holds for all of them.
		Constraints: []resourceapi.DeviceConstraint{{MatchAttribute: &attr}},
	}}
}

// Template is the ResourceClaimTemplate of a unit shape: of a ready unit, or with
// degraded, of a ready or degraded one (ClaimSpec).
func Template(s Shape, degraded bool) *resourceapi.ResourceClaimTemplate {
	name := s.TemplateName()
	if degraded {
		name = s.DegradedTemplateName()
	}
	return &resourceapi.ResourceClaimTemplate{
		TypeMeta:   metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceClaimTemplate"},
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: ClaimSpec(s, degraded)},
	}
}
