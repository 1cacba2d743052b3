package resources

// The VMI stanza for KubeVirt's DRA host devices (HostDevicesWithDRA, KubeVirt v1.9):
// spec.resourceClaims names the claim (here made from a unit shape's template) and each
// domain.devices.hostDevices[] entry takes one request of it. KubeVirt's own types are
// not a dependency: these are the fields of its API the stanza sets.

// VMIClaims is the part of a VirtualMachineInstance spec that claims one whole unit.
type VMIClaims struct {
	ResourceClaims []VMIResourceClaim `json:"resourceClaims"`
	Domain         VMIDomain          `json:"domain"`
}

// VMIResourceClaim is a pod resource claim: a claim made from a template.
type VMIResourceClaim struct {
	Name                      string `json:"name"`
	ResourceClaimTemplateName string `json:"resourceClaimTemplateName"`
}

// VMIDomain holds the host devices.
type VMIDomain struct {
	Devices VMIDevices `json:"devices"`
}

// VMIDevices holds the host devices.
type VMIDevices struct {
	HostDevices []VMIHostDevice `json:"hostDevices"`
}

// VMIHostDevice is one function: the claim's request that virt-launcher finds the PCI
// address of in the device metadata.
type VMIHostDevice struct {
	Name        string `json:"name"`
	ClaimName   string `json:"claimName"`
	RequestName string `json:"requestName"`
}

// KubeVirt is the stanza claiming one unit of shape s under the claim name claim: from
// the shape's template, or with degraded from the one that also takes a degraded unit.
func KubeVirt(s Shape, claim string, degraded bool) VMIClaims {
	tmpl := s.TemplateName()
	if degraded {
		tmpl = s.DegradedTemplateName()
	}
	v := VMIClaims{ResourceClaims: []VMIResourceClaim{{Name: claim, ResourceClaimTemplateName: tmpl}}}
	for _, r := range s.RequestNames() {
		v.Domain.Devices.HostDevices = append(v.Domain.Devices.HostDevices, VMIHostDevice{Name: claim + "-" + r, ClaimName: claim, RequestName: r})
	}
	return v
}

// KubeVirtNVLink is the stanza claiming one whole NVLink partition of n units of shape s
// under the claim name claim: one claim from the shape's NVLink template of n
// (NVLinkTemplate), and a host device per request (claim-u0-gpu, claim-u0-gpu-nic-0,
// ...), since KubeVirt takes one device per request.
func KubeVirtNVLink(s Shape, n int, claim string) VMIClaims {
	v := VMIClaims{ResourceClaims: []VMIResourceClaim{{Name: claim, ResourceClaimTemplateName: s.NVLinkTemplateName(n)}}}
	for _, r := range s.NVLinkRequestNames(n) {
		v.Domain.Devices.HostDevices = append(v.Domain.Devices.HostDevices, VMIHostDevice{Name: claim + "-" + r, ClaimName: claim, RequestName: r})
	}
	return v
}
