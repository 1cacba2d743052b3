package resources

import (
	"fmt"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/manifest"
)

// NVLink partitions. In the shared NVSwitch model Fabric Manager joins a VM's GPUs by
// NVLink only when they are exactly one of its predefined partitions, named by GPU
// module IDs (on HGX B200/B300: 1-8, 1-4, 5-8, 1-2, 3-4, 5-6, 7-8; Fabric Manager User
// Guide, "GPU Partitions").
// Every device of a unit whose module ID the manifest knows carries, for each partition
// size of the manifest's layout (manifest.NVLink), the partition of that size holding
// it (AttrNVLinkPartition) and its place there (AttrNVLinkIndex); the NVLink template
// of n units (NVLinkClaimSpec) then takes exactly the n units of one partition, or
// nothing. A unit whose module ID is unknown, or any unit of a node without a layout,
// has neither attribute and is claimed alone, or with the per-unit templates, never by
// an NVLink template: no NVLink without the module ID Fabric Manager names GPUs by.

// AttrModuleID is the GPU's module ID (Fabric Manager's physicalId) on every device of a
// unit whose module ID the manifest knows.
const AttrModuleID = "moduleID"

// AttrNVLinkPartition is the attribute naming the partition of n GPUs the unit is in:
// its module IDs joined by dots ("1.2", "5.6.7.8"), the same on every device of every
// unit of the partition and on no other. An NVLink claim of n units matches it across
// all its devices.
func AttrNVLinkPartition(n int) resourceapi.QualifiedName {
	return resourceapi.QualifiedName(fmt.Sprintf("nvlinkPartition%d", n))
}

// AttrNVLinkIndex is the unit's place in its partition of n GPUs (0 to n-1, in module
// order). Group i of an NVLink claim selects place i, so each group has one unit to
// choose in a partition and the allocator, which backtracks request by request, never
// tries a partition's units in every order when it is not whole. Measured here with the
// real allocator (TestAllocatorNVLinkFailsFast: a claim of 8 with one NVMe taken): 0.2
// s to fail; with groups that take any unit of the partition, 161 s.
func AttrNVLinkIndex(n int) resourceapi.QualifiedName {
	return resourceapi.QualifiedName(fmt.Sprintf("nvlinkPartition%dIndex", n))
}

// NVLinkTemplateName names the template of an NVLink partition of n units of the shape
// (unit-gpu.gpu-nic.gpu-nic.gpu-nvme-nvlink4).
func (s Shape) NVLinkTemplateName(n int) string {
	return fmt.Sprintf("%s-nvlink%d", s.TemplateName(), n)
}

// NVLinkRequestNames are the requests of an NVLink claim of n units: the shape's
// requests once per unit, prefixed u<i>- (u0-gpu, u0-gpu-nic-0, ..., u1-gpu, ...), unit
// i's at [i*len(s), (i+1)*len(s)).
func (s Shape) NVLinkRequestNames(n int) []string {
	var out []string
	for i := range n {
		for _, r := range s.RequestNames() {
			out = append(out, fmt.Sprintf("u%d-%s", i, r))
		}
	}
	return out
}

// nvlinkAttrs are the NVLink attributes of each unit in a partition, by unit.
type nvlinkAttrs map[string]map[resourceapi.QualifiedName]resourceapi.DeviceAttribute

// nvlinkOf reads the manifest's partitions (hypervisor.NVLinkPartitions: a layout or
// module map that could mislead a claim is refused, naming it) into each unit's
// attributes, and returns the partition sizes.
func nvlinkOf(m *manifest.Manifest) (nvlinkAttrs, []int, error) {
	parts, err := hypervisor.NVLinkPartitions(m)
	if err != nil {
		return nil, nil, err
	}
	out := nvlinkAttrs{}
	var sizes []int
	for _, p := range parts {
		n := len(p.Modules)
		if len(sizes) == 0 || sizes[len(sizes)-1] != n {
			sizes = append(sizes, n) // NVLinkPartitions sorts by size
		}
		for i, u := range p.Units {
			if u == "" {
				continue
			}
			if out[u] == nil {
				out[u] = map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}
			}
			out[u][AttrNVLinkPartition(n)] = str(p.Name())
			out[u][AttrNVLinkIndex(n)] = num(int64(i))
		}
	}
	for _, u := range m.Units {
		if out[u.ID] != nil {
			out[u.ID][AttrModuleID] = num(int64(u.ModuleID))
		}
	}
	return out, sizes, nil
}

// checkNVLink refuses an NVLink template the API would refuse: more requests than a
// claim takes (eight units of five functions are 40; it takes 32), a request or
// template name that is not a DNS label or subdomain.
func checkNVLink(s Shape, n int) error {
	name := fmt.Sprintf("shape %s, NVLink partition of %d", s, n)
	names := s.NVLinkRequestNames(n)
	if len(names) > resourceapi.DeviceRequestsMaxSize {
		return fmt.Errorf("%s: %d requests, a claim takes at most %d", name, len(names), resourceapi.DeviceRequestsMaxSize)
	}
	if n+1 > resourceapi.DeviceConstraintsMaxSize {
		return fmt.Errorf("%s: %d constraints, a claim takes at most %d", name, n+1, resourceapi.DeviceConstraintsMaxSize)
	}
	for _, r := range names {
		if errs := validation.IsDNS1123Label(r); len(errs) > 0 {
			return fmt.Errorf("%s: request %q: %s", name, manifest.Printable(r), strings.Join(errs, "; "))
		}
	}
	if errs := validation.IsDNS1123Subdomain(s.NVLinkTemplateName(n)); len(errs) > 0 {
		return fmt.Errorf("%s: template name %q: %s", name, manifest.Printable(s.NVLinkTemplateName(n)), strings.Join(errs, "; "))
	}
	return nil
}

// NVLinkClaimSpec is the claim of one whole NVLink partition of n ready units of the
// shape: per unit i a group of the shape's requests (NVLinkRequestNames), each selecting
// its role, the shape, status "ready" and place i in a partition of n
// (AttrNVLinkIndex), the group constrained to one unit (matchAttribute unit); and all
// requests constrained to one partition (matchAttribute AttrNVLinkPartition(n)).
//
// Why this gives exactly the n units of one partition: the devices of a partition's
// units are its only devices with its AttrNVLinkPartition value, place i is one unit,
// and group i takes every function of that unit (a unit of the shape has exactly the
// shape's functions). A partition with a unit not offered (not ready, withheld,
// prepared, of another shape) or a function taken has no unit for some group: the
// claim takes another partition or waits. Units of two partitions never meet in one
// claim: their AttrNVLinkPartition values differ. One request per device, because
// KubeVirt (v1.9, pkg/dra/utils.go) takes one device per request; and no
// distinctAttribute, which needs the DRAConsumableCapacity gate: two groups cannot share
// a unit, whose functions one group takes all of.
func NVLinkClaimSpec(s Shape, n int) resourceapi.ResourceClaimSpec {
	status := fmt.Sprintf("device.attributes[%q].%s == %q", DriverName, AttrStatus, manifest.StatusReady)
	idx := AttrNVLinkIndex(n)
	names := s.NVLinkRequestNames(n)
	var reqs []resourceapi.DeviceRequest
	var cons []resourceapi.DeviceConstraint
	unit := UnitAttribute
	for i := range n {
		// has(): a device without the attribute (a unit of unknown module ID) is not
		// selected; reading it unguarded is an error that aborts the allocation.
		place := fmt.Sprintf("has(device.attributes[%q].%s) && device.attributes[%q].%s == %d", DriverName, idx, DriverName, idx, i)
		group := names[i*len(s) : (i+1)*len(s)]
		for j, role := range s {
			expr := fmt.Sprintf("device.attributes[%q].%s == %q && device.attributes[%q].%s == %q && %s && %s",
				DriverName, AttrRole, role, DriverName, AttrShape, s.String(), status, place)
			reqs = append(reqs, resourceapi.DeviceRequest{Name: group[j], Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: ClassName,
				Selectors:       []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}},
				AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
				Count:           1,
			}})
		}
		cons = append(cons, resourceapi.DeviceConstraint{Requests: group, MatchAttribute: &unit})
	}
	part := resourceapi.FullyQualifiedName(DriverName + "/" + string(AttrNVLinkPartition(n)))
	// No request names: the partition holds for all of them.
	cons = append(cons, resourceapi.DeviceConstraint{MatchAttribute: &part})
	return resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: reqs, Constraints: cons}}
}

// NVLinkTemplate is the ResourceClaimTemplate of an NVLink partition of n units of the
// shape (NVLinkClaimSpec).
func NVLinkTemplate(s Shape, n int) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{
		TypeMeta:   metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceClaimTemplate"},
		ObjectMeta: metav1.ObjectMeta{Name: s.NVLinkTemplateName(n)},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: NVLinkClaimSpec(s, n)},
	}
}
