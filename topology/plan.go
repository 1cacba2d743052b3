package topology

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/passage-boot/passage/pci"
)

// Plan is what topology contributes to a node's decision, laid out to print: labels and
// units, the ACS plan, the host matrix, and the guest plan for the chosen units with its
// matrix. package decision fills it; the units' statuses are the decision's.
type Plan struct {
	Labels      *Labels
	ACS         []ACSPort
	KernelArg   string
	Host        *Matrix
	Guest       *Guest
	GuestMatrix *Matrix
	// Namer names the functions: WriteText's table prints its Label ("Mellanox
	// Technologies CX8 Family [ConnectX-8] [15b3:1023]"), Doc adds its Names. Nil: IDs
	// alone.
	Namer Namer
}

// Namer gives vendor and device names (pciids.DB is one).
type Namer interface {
	Label(vendor, device uint16) string
	Names(vendor, device uint16) (vendorName, deviceName string)
}

// UnitName is a unit's name wherever passage prints one: JSON documents, the console,
// log.jsonl and the manifest ("gpu0").
func UnitName(id int) string { return UnitID(id).String() }

// UnitID is a unit's number: from the profile's slot map, else from the position of its
// root port (topology/PROFILES.md), so it stays put when another GPU stops answering. It
// marshals as the unit's name, so every JSON document names a unit one way ("gpu3").
type UnitID int

func (u UnitID) String() string { return fmt.Sprintf("gpu%d", int(u)) }

// MarshalText writes the unit's name ("gpu3").
func (u UnitID) MarshalText() ([]byte, error) { return []byte(u.String()), nil }

// UnmarshalText reads "gpu3" or "3".
func (u *UnitID) UnmarshalText(b []byte) error {
	n, err := ParseUnitName(string(b))
	*u = UnitID(n)
	return err
}

// ParseUnitName reads a unit as an operator may write it: "gpu3" or "3".
func ParseUnitName(s string) (UnitID, error) {
	n, err := strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(s), "gpu"))
	if err != nil || n < 0 {
		return 0, fmt.Errorf("unit %q: want gpuN or N", s)
	}
	return UnitID(n), nil
}

// UnitJSON is a unit as passage inspect --json and the manifest list it.
type UnitJSON struct {
	ID         string   `json:"id"` // UnitName
	GPU        string   `json:"gpu"`
	NICs       []string `json:"nics"`
	DataDirect []string `json:"data_direct"`
	NVMe       []string `json:"nvme"`
	NUMANode   int      `json:"numa_node"`
	Status     Status   `json:"status"`
	Reasons    []string `json:"reasons,omitempty"`
	Bridges    []string `json:"bridges,omitempty"`
}

func addrs(ds []*pci.Device) []string {
	out := []string{}
	for _, d := range ds {
		out = append(out, d.Addr.String())
	}
	return out
}

// JSON renders a unit for inspect --json and the manifest.
func (u *Unit) JSON() UnitJSON {
	return UnitJSON{ID: u.ID.String(), GPU: u.GPU.Addr.String(), NICs: addrs(u.NICs), DataDirect: addrs(u.DataDirect),
		NVMe: addrs(u.NVMe), NUMANode: u.NUMANode, Status: u.Status, Reasons: u.Reasons, Bridges: addrs(u.Bridges)}
}

// UnitsJSON is the top-level "units" list of passage inspect --json.
func (l *Labels) UnitsJSON() []UnitJSON {
	out := []UnitJSON{}
	for _, u := range l.Units {
		out = append(out, u.JSON())
	}
	return out
}

type functionJSON struct {
	Addr   string  `json:"addr"`
	IDs    string  `json:"ids"`
	Class  string  `json:"class"`
	Role   Role    `json:"role"`
	Rule   string  `json:"rule,omitempty"`
	Reason string  `json:"reason,omitempty"`
	Unit   *UnitID `json:"unit,omitempty"`
	// Names from pci.ids, with a Namer and where the database has them.
	VendorName string `json:"vendor_name,omitempty"`
	DeviceName string `json:"device_name,omitempty"`
}

type acsJSON struct {
	Addr     string `json:"addr"`
	Unit     UnitID `json:"unit"`
	Position string `json:"position"`
	Cap      string `json:"cap"`
	Current  string `json:"current"`
	Target   string `json:"target"`
	CtlFrom  string `json:"ctl_current"`
	CtlTo    string `json:"ctl_target"`
	Flags    string `json:"config_acs"`
	Reason   string `json:"reason"`
	Skip     string `json:"skip,omitempty"`
}

// PlanDoc is the plan as JSON; package decision adds its own fields beside these.
type PlanDoc struct {
	Profile     string         `json:"profile"`
	Functions   []functionJSON `json:"functions"`
	Units       []UnitJSON     `json:"units"`
	Problems    []string       `json:"problems,omitempty"`
	ACS         []acsJSON      `json:"acs"`
	KernelArg   string         `json:"kernel_arg"`
	Host        *Matrix        `json:"host_matrix"`
	Guest       *Guest         `json:"guest,omitempty"`
	GuestMatrix *Matrix        `json:"guest_matrix,omitempty"`
}

// Doc is the plan as one JSON document.
func (pl *Plan) Doc() PlanDoc {
	l := pl.Labels
	doc := PlanDoc{Profile: l.Profile.Name, Units: l.UnitsJSON(), Problems: l.Problems, KernelArg: pl.KernelArg,
		Host: pl.Host, Guest: pl.Guest, GuestMatrix: pl.GuestMatrix, ACS: []acsJSON{}}
	for _, d := range l.Tree.Devices {
		fl := l.Of(d.Addr)
		fj := functionJSON{Addr: d.Addr.String(), IDs: d.IDs(), Class: fmt.Sprintf("%06x", d.Class), Role: fl.Role, Rule: fl.Rule, Reason: fl.Reason}
		if pl.Namer != nil {
			fj.VendorName, fj.DeviceName = pl.Namer.Names(d.VendorID, d.DeviceID)
		}
		if fl.Unit >= 0 {
			u := fl.Unit
			fj.Unit = &u
		}
		doc.Functions = append(doc.Functions, fj)
	}
	for _, p := range pl.ACS {
		doc.ACS = append(doc.ACS, acsJSON{Addr: p.Addr.String(), Unit: UnitID(p.Unit), Position: p.Position, Cap: p.Cap.String(),
			Current: p.Current.String(), Target: p.Target().String(), CtlFrom: fmt.Sprintf("0x%04x", uint16(p.Current)),
			CtlTo: fmt.Sprintf("0x%04x", uint16(p.Target())), Flags: ConfigACSFlags(p.Mask, p.Flags), Reason: p.Reason, Skip: p.Skip})
	}
	return doc
}

// WriteText writes the plan for a person: the tree with a role column (lspci -t's
// nesting), the units, the ACS plan with its kernel argument, and the host and guest
// matrices laid out like nvidia-smi topo -m.
func (pl *Plan) WriteText(w io.Writer) error {
	l := pl.Labels
	var b strings.Builder
	fmt.Fprintf(&b, "profile %s", l.Profile.Name)
	if l.Profile.Description != "" {
		fmt.Fprintf(&b, " (%s)", l.Profile.Description)
	}
	b.WriteString("\n\nfunctions\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	var walk func(d *pci.Device, depth int)
	walk = func(d *pci.Device, depth int) {
		fl := l.Of(d.Addr)
		unit := ""
		if fl.Unit >= 0 {
			unit = fl.Unit.String()
		}
		note := fl.Rule
		if fl.Reason != "" {
			note = fl.Reason
		}
		ids := d.IDs()
		if pl.Namer != nil {
			ids = pl.Namer.Label(d.VendorID, d.DeviceID)
		}
		fmt.Fprintf(tw, "%s%s\t%s\t%s\t%s\t%s\n", strings.Repeat("  ", depth), d.Addr, ids, fl.Role, unit, note)
		for _, c := range d.Children {
			walk(c, depth+1)
		}
	}
	for _, r := range l.Tree.Roots {
		walk(r, 0)
	}
	tw.Flush()

	b.WriteString("\nunits\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "unit\tnuma\tstatus\tgpu\tnics\tdata-direct\tnvme\treasons")
	for _, u := range l.Units {
		j := u.JSON()
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", u.ID, u.NUMANode, u.Status, j.GPU, dash(j.NICs), dash(j.DataDirect), dash(j.NVMe), strings.Join(u.Reasons, "; "))
	}
	tw.Flush()
	for _, p := range l.Problems {
		fmt.Fprintf(&b, "problem: %s\n", p)
	}

	b.WriteString("\nacs plan\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "port\tunit\tposition\tACSCtl now\ttarget\tconfig_acs\treason")
	for _, p := range pl.ACS {
		now, target, flags := "-", "-", "-"
		if p.Offset != 0 {
			now = fmt.Sprintf("%#04x %s", uint16(p.Current), p.Current)
			target = fmt.Sprintf("%#04x %s", uint16(p.Target()), p.Target())
			flags = ConfigACSFlags(p.Mask, p.Flags)
		}
		reason := p.Reason
		if p.Skip != "" {
			reason = "not written: " + p.Skip
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.Addr, p.Unit, p.Position, now, target, flags, reason)
	}
	tw.Flush()
	if pl.KernelArg != "" {
		fmt.Fprintf(&b, "kernel argument: %s\n", pl.KernelArg)
	}

	b.WriteString("\nhost matrix\n")
	b.WriteString(pl.Host.Text())
	if pl.Guest != nil {
		var ids []string
		for _, u := range pl.Guest.Units {
			ids = append(ids, fmt.Sprint(u.Unit))
		}
		layout := "flat (every unit on pcie.0)"
		if pl.Guest.NUMA {
			layout = "one pxb-pcie per unit on its NUMA node"
		}
		fmt.Fprintf(&b, "\nguest matrix (units %s; %s)\n", strings.Join(ids, ","), layout)
		b.WriteString(pl.GuestMatrix.Text())
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func dash(s []string) string {
	if len(s) == 0 {
		return "-"
	}
	return strings.Join(s, ",")
}

// pci.Address has no text form for encoding/json; these marshalers write "0000:f2:00.0".

func (m *Matrix) MarshalJSON() ([]byte, error) {
	type plain Matrix
	var as []string
	for _, a := range m.Addrs {
		as = append(as, a.String())
	}
	return json.Marshal(struct {
		*plain
		Addrs []string `json:"addrs"`
	}{(*plain)(m), as})
}

func (p GuestPort) MarshalJSON() ([]byte, error) {
	type plain GuestPort
	return json.Marshal(struct {
		plain
		Addr string `json:"addr"`
	}{plain(p), p.Addr.String()})
}

func (f GuestFunction) MarshalJSON() ([]byte, error) {
	type plain GuestFunction
	return json.Marshal(struct {
		plain
		HostID string `json:"host"`
		Addr   string `json:"addr"`
	}{plain(f), f.HostID.String(), f.Addr.String()})
}
