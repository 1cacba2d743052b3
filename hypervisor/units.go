package hypervisor

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/topology"
)

// UnitsFormat names the units view's shape; it changes only with a new name.
const UnitsFormat = "passage-units/1"

// UnitsDoc is what a scheduler needs from a verified manifest, per unit: the verdict and
// why, where the unit sits, its host functions, and where the manifest's guest plan puts
// them. manifest/SCHEMA.md documents it; `passage verify --by-unit --json` prints it.
type UnitsDoc struct {
	Format        string     `json:"format"` // UnitsFormat
	Node          string     `json:"node"`   // hostname
	DMIUUID       string     `json:"dmi_uuid"`
	BootID        string     `json:"boot_id"`
	Generation    uint64     `json:"generation"`
	PayloadDigest string     `json:"payload_digest"`
	KeyID         string     `json:"key_id"`
	Units         []UnitView `json:"units"`
}

// UnitView is one unit of the view.
type UnitView struct {
	ID       string   `json:"id"`
	Status   string   `json:"status"`
	Reasons  []string `json:"reasons"`
	NUMANode int      `json:"numa_node"`
	// Functions are the unit's host functions in the manifest's order (GPU first).
	Functions []FunctionView `json:"functions"`
	// Guest is where the manifest's guest plan (every unit that may be passed through,
	// flat) puts the unit's functions; null for a unit the plan leaves out and for a
	// failed unit.
	Guest *GuestView `json:"guest"`
}

// FunctionView is one host function: address, role, IOMMU group, driver after the boot.
type FunctionView struct {
	BDF        string `json:"bdf"`
	Role       string `json:"role"`
	IOMMUGroup int    `json:"iommu_group"`
	Driver     string `json:"driver"`
}

// GuestView is a unit in the guest plan: its guest root port and each function's guest
// address.
type GuestView struct {
	RootPort  string           `json:"root_port"`
	Functions []GuestPlacement `json:"functions"`
}

// GuestPlacement is one function's host and guest address.
type GuestPlacement struct {
	Host  string `json:"host"`
	Guest string `json:"guest"`
	Role  string `json:"role"`
}

// Units builds the units view of a verified manifest.
func Units(v *manifest.Verified) (*UnitsDoc, error) {
	m := v.Manifest
	doc := &UnitsDoc{Format: UnitsFormat, Node: m.Node.Hostname, DMIUUID: m.Node.DMIUUID, BootID: m.BootID,
		Generation: m.Generation, PayloadDigest: v.Digest, KeyID: v.KeyID, Units: []UnitView{}}
	guest := map[string]*GuestView{}
	if m.GuestPlan != nil && len(m.GuestPlan.Plan) > 0 {
		var g topology.Guest
		if err := json.Unmarshal(m.GuestPlan.Plan, &g); err != nil {
			return nil, fmt.Errorf("manifest: guest_plan.plan: %w", err)
		}
		for _, u := range g.Units {
			gv := &GuestView{RootPort: u.RootPort.Addr.String(), Functions: []GuestPlacement{}}
			for _, f := range u.Functions {
				gv.Functions = append(gv.Functions, GuestPlacement{Host: f.HostID.String(), Guest: f.Addr.String(), Role: string(f.Role)})
			}
			guest[u.Unit.String()] = gv
		}
	}
	for _, u := range m.Units {
		uv := UnitView{ID: u.ID, Status: u.Status, Reasons: append([]string{}, u.Reasons...), NUMANode: u.NUMANode,
			Functions: []FunctionView{}}
		if u.Status != manifest.StatusFailed {
			// A plan that lists a failed unit does not make it placeable.
			uv.Guest = guest[u.ID]
		}
		for _, f := range u.Functions {
			uv.Functions = append(uv.Functions, FunctionView{BDF: f.BDF, Role: f.Role, IOMMUGroup: f.IOMMUGroup, Driver: f.DriverAfter})
		}
		doc.Units = append(doc.Units, uv)
	}
	return doc, nil
}

// WriteText writes the view as a table, one line per unit and its reasons below.
func (d *UnitsDoc) WriteText(w io.Writer) error {
	pr := manifest.Printable
	var b strings.Builder
	fmt.Fprintf(&b, "node %s boot %s generation %d payload %s\n", pr(d.Node), pr(d.BootID), d.Generation, d.PayloadDigest)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "unit\tstatus\tnuma\thost functions\tguest")
	for _, u := range d.Units {
		var host, guest []string
		for _, f := range u.Functions {
			host = append(host, pr(f.BDF+"="+f.Role))
		}
		if u.Guest != nil {
			for _, f := range u.Guest.Functions {
				guest = append(guest, pr(f.Host+"->"+f.Guest))
			}
		}
		if len(guest) == 0 {
			guest = []string{"-"}
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", pr(u.ID), pr(u.Status), u.NUMANode, strings.Join(host, " "), strings.Join(guest, " "))
		for _, r := range u.Reasons {
			fmt.Fprintf(tw, "\t\t\t%s\t\n", pr(r))
		}
	}
	tw.Flush()
	_, err := io.WriteString(w, b.String())
	return err
}
