package hypervisor

import (
	"fmt"
	"strings"

	"github.com/passage-boot/passage/topology"
)

// Formats render can write.
const (
	FormatQEMU           = "qemu"            // qemu-system-x86_64 arguments
	FormatLibvirt        = "libvirt"         // a complete libvirt <domain>
	FormatLibvirtDevices = "libvirt-devices" // the <devices> fragment only
	FormatNCCL           = "nccl-xml"        // NCCL_TOPO_FILE
)

// Formats lists the formats in the order usage names them.
var Formats = []string{FormatQEMU, FormatLibvirt, FormatLibvirtDevices, FormatNCCL}

// Input is everything a rendering reads: the units as sources (a decision's, or a
// verified manifest's), which of them go into the guest and how it is laid out.
type Input struct {
	Sources []topology.GuestSource
	// Units are the units asked for; nil asks for every unit the verdicts admit.
	Units []topology.UnitID
	NUMA  bool
	// AllowDegraded admits degraded units; without it only ready ones are.
	AllowDegraded bool
	// HostCPUs are the host NUMA nodes' CPU lists, for the libvirt domain's vCPU pins.
	HostCPUs map[int]string
	// PhysBits is the guest physical address width asked for; 0 takes the width the
	// units' BARs need (Guest.MMIO). A width that cannot hold them is refused.
	PhysBits int
	// NVLinks, when above 0, says the guest's units are one NVLink partition
	// (NVLinkGuest), each GPU with this many NVLinks (NVLinks): the NCCL file says so.
	NVLinks int
}

// Refused is a rendering refused by a unit's verdict.
type Refused struct{ Err error }

func (r *Refused) Error() string { return r.Err.Error() }
func (r *Refused) Unwrap() error { return r.Err }

// Plan is the guest plan of the admitted units, and which of them are degraded. A unit
// refused by its verdict is a *Refused error.
func Plan(in Input) (*topology.Guest, []topology.GuestSource, error) {
	ids, degraded, err := topology.Admit(in.Sources, in.Units, in.AllowDegraded)
	if err != nil {
		return nil, nil, &Refused{err}
	}
	g, err := topology.PlanGuest(in.Sources, topology.GuestOptions{Units: ids, NUMA: in.NUMA})
	if err != nil {
		return nil, nil, err
	}
	var deg []topology.GuestSource
	for _, id := range degraded {
		for _, s := range in.Sources {
			if s.ID == id {
				deg = append(deg, s)
			}
		}
	}
	return g, deg, nil
}

// Rendering is one rendered guest.
type Rendering struct {
	Guest *topology.Guest
	// Degraded are the degraded units it holds (admitted with AllowDegraded).
	Degraded []topology.GuestSource
	// MMIO is what the guest's firmware must map, and PhysBits the width rendered.
	MMIO     topology.MMIO
	PhysBits int
	Out      []byte
}

// LeftOut names the units a rendering of every admitted unit (Units nil) leaves out,
// with their verdicts ("" when none is).
func LeftOut(in Input, g *topology.Guest) string {
	inGuest := map[topology.UnitID]bool{}
	for _, u := range g.Units {
		inGuest[u.Unit] = true
	}
	var out []string
	for _, s := range in.Sources {
		if !inGuest[s.ID] {
			out = append(out, fmt.Sprintf("%s (%s)", s.ID, s.Status))
		}
	}
	return strings.Join(out, ", ")
}

// DegradedNote names the degraded units a rendering holds and why ("" for none).
func (r *Rendering) DegradedNote() string {
	var parts []string
	for _, s := range r.Degraded {
		parts = append(parts, fmt.Sprintf("%s is degraded: %s", s.ID, strings.Join(s.Reasons, "; ")))
	}
	return strings.Join(parts, "; ")
}

// Render plans the guest and writes it in format; dom gives the libvirt domain what
// the plan does not (ignored by the other formats).
func Render(in Input, format string, dom topology.DomainOptions) (*Rendering, error) {
	switch format {
	case FormatQEMU, FormatLibvirt, FormatLibvirtDevices, FormatNCCL:
	default:
		return nil, fmt.Errorf("format %q: want %s", format, strings.Join(Formats, ", "))
	}
	g, deg, err := Plan(in)
	if err != nil {
		return nil, err
	}
	r := &Rendering{Guest: g, Degraded: deg, MMIO: g.MMIO(), PhysBits: in.PhysBits}
	if r.PhysBits == 0 {
		r.PhysBits = r.MMIO.Width
	}
	if err := r.MMIO.CheckWidth(r.PhysBits, len(g.Units)); err != nil {
		return nil, &Refused{err}
	}
	switch format {
	case FormatQEMU:
		// The guest's width first: OVMF's 64-bit window follows it. As libvirt's
		// <maxphysaddr mode='emulate'>, the width exactly; the host must have it.
		r.Out = []byte(fmt.Sprintf("-cpu host,phys-bits=%d \\\n", r.PhysBits) + g.QEMUText(nil))
		if note := r.DegradedNote(); note != "" {
			// A shell comment line ahead of the arguments: the rendering names what it
			// admitted degraded, as the domain's <description> does.
			r.Out = append([]byte("# passage: "+strings.Join(strings.Fields(note), " ")+"\n"), r.Out...)
		}
	case FormatLibvirt:
		dom.HostCPUs = in.HostCPUs
		dom.PhysBits = r.PhysBits
		if note := r.DegradedNote(); note != "" {
			dom.Description = strings.TrimSpace(dom.Description + " " + note)
		}
		r.Out, err = g.Domain(dom)
	case FormatLibvirtDevices:
		r.Out, err = g.Libvirt()
	case FormatNCCL:
		r.Out, err = g.NCCLTopologyWith(topology.NCCLOptions{NVLinks: in.NVLinks})
	}
	if err != nil {
		return nil, err
	}
	return r, nil
}
