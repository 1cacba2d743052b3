// Package hypervisor is the hypervisor's side of the manifest: what a verified manifest
// says a scheduler and a VM builder may use, read from the signed payload alone. It
// turns the payload into the render input the topology package's renderers take
// (topology.GuestSource), the same value a decision's units give, so a VM rendered from
// a manifest is the VM planned from the tree the manifest was written on. It reads no
// sysfs and decides nothing: every verdict it passes on is the manifest's.
package hypervisor

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// Sources reads the manifest's units as guest sources: each unit's verdict, host NUMA
// node and uplink, and its passthrough functions in the manifest's order. A value the
// renderers would need and cannot read (an address, an ID, a role, a link) is an error
// naming the unit and function: a signed payload is still outside input.
func Sources(m *manifest.Manifest) ([]topology.GuestSource, error) {
	out := make([]topology.GuestSource, 0, len(m.Units))
	var errs []error
	seen := map[topology.UnitID]bool{}
	for _, u := range m.Units {
		s, err := source(u, m.SchemaVersion)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if seen[s.ID] {
			errs = append(errs, fmt.Errorf("unit %s: listed twice", u.ID))
			continue
		}
		seen[s.ID] = true
		out = append(out, s)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("manifest: %w", err)
	}
	return out, nil
}

// HostCPUs reads the manifest's NUMA nodes' CPU lists, each checked as a cpulist.
func HostCPUs(m *manifest.Manifest) (map[int]string, error) {
	out := make(map[int]string, len(m.NUMACPUs))
	for _, n := range m.NUMACPUs {
		if _, dup := out[n.Node]; dup || n.Node < 0 {
			return nil, fmt.Errorf("manifest: numa_cpus: node %d listed twice or negative", n.Node)
		}
		if err := pci.CheckCPUList(n.CPUs); err != nil {
			return nil, fmt.Errorf("manifest: numa_cpus: node %d: %w", n.Node, err)
		}
		out[n.Node] = n.CPUs
	}
	return out, nil
}

func source(u manifest.Unit, schema int) (topology.GuestSource, error) {
	id, err := topology.ParseUnitName(u.ID)
	if err != nil || id.String() != u.ID {
		return topology.GuestSource{}, fmt.Errorf("unit %q: not a unit name (gpuN)", u.ID)
	}
	s := topology.GuestSource{ID: id, Status: topology.Status(u.Status), Reasons: u.Reasons, NUMANode: u.NUMANode}
	switch s.Status {
	case topology.StatusReady, topology.StatusDegraded, topology.StatusFailed:
	default:
		return s, fmt.Errorf("unit %s: status %q: want ready, degraded or failed", u.ID, u.Status)
	}
	if s.UpLink, err = topology.LinkFrom(u.UpLink.Speed, u.UpLink.Width); err != nil {
		return s, fmt.Errorf("unit %s: uplink: %w", u.ID, err)
	}
	gpus := 0
	for _, f := range u.Functions {
		hf, err := function(f)
		if err != nil {
			return s, fmt.Errorf("unit %s: function %s: %w", u.ID, f.BDF, err)
		}
		if schema >= 4 && f.BARs == nil {
			hf.BARs = []pci.BAR{} // schema 4 leaves out the bars of a function without any
		}
		if hf.Role == topology.RoleGPU {
			gpus++
		}
		s.Functions = append(s.Functions, hf)
	}
	if s.Status != topology.StatusFailed && (gpus != 1 || s.Functions[0].Role != topology.RoleGPU) {
		return s, fmt.Errorf("unit %s: %d GPUs, want its GPU first and only one", u.ID, gpus)
	}
	return s, nil
}

func function(f manifest.Function) (topology.HostFunction, error) {
	var hf topology.HostFunction
	addr, err := pci.ParseAddress(f.BDF)
	if err != nil {
		return hf, err
	}
	hf.Addr, hf.Role = addr, topology.Role(f.Role)
	if !hf.Role.Passthrough() {
		return hf, fmt.Errorf("role %q: not a passthrough role", f.Role)
	}
	for _, x := range []struct {
		name string
		s    string
		bits int
		to   any
	}{
		{"vendor", f.Vendor, 16, &hf.Vendor}, {"device", f.Device, 16, &hf.Device},
		{"subsystem_vendor", f.SubsystemVendor, 16, &hf.SubsystemVendor}, {"subsystem_device", f.SubsystemDevice, 16, &hf.SubsystemDevice},
		{"class", f.Class, 24, &hf.Class},
	} {
		v, err := hexID(x.s, x.bits)
		if err != nil {
			return hf, fmt.Errorf("%s: %w", x.name, err)
		}
		switch p := x.to.(type) {
		case *uint16:
			*p = uint16(v)
		case *uint32:
			*p = uint32(v)
		}
	}
	if hf.Link, err = topology.LinkFrom(f.Link.Speed, f.Link.Width); err != nil {
		return hf, err
	}
	if hf.BARs, err = bars(f.BARs); err != nil {
		return hf, err
	}
	return hf, nil
}

// bars reads a function's BARs from the manifest: nil when it gives none (see source
// for schema 4's function without BARs) or a BAR it could not size. A BAR's index is 0..5, its size a power of
// two (PCI 3.0 6.2.5.1), or 0 where the scan could not size it.
func bars(in []manifest.BAR) ([]pci.BAR, error) {
	if in == nil {
		return nil, nil
	}
	out := make([]pci.BAR, 0, len(in))
	for _, b := range in {
		if b.Index < 0 || b.Index > 5 || b.Size&(b.Size-1) != 0 {
			return nil, fmt.Errorf("bar %d: index or size 0x%x out of range (index 0..5, a power of two)", b.Index, b.Size)
		}
		if b.Size == 0 {
			return nil, nil
		}
		out = append(out, pci.BAR{Index: b.Index, Size: b.Size, IO: b.IO, Is64: b.Is64, Prefetch: b.Prefetchable})
	}
	return out, nil
}

// hexID reads "0x10de" as the manifest writes IDs: lower-case hex with a 0x prefix.
func hexID(s string, bits int) (uint64, error) {
	h, ok := strings.CutPrefix(s, "0x")
	if !ok || h == "" || strings.ToLower(h) != h {
		return 0, fmt.Errorf("%q: want lower-case hex with 0x", s)
	}
	v, err := strconv.ParseUint(h, 16, bits)
	if err != nil {
		return 0, fmt.Errorf("%q: not a %d-bit hex value", s, bits)
	}
	return v, nil
}
