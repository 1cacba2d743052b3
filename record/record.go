// Package record turns a decision, the final verdicts and what the execution steps
// reported into the manifest's unit records. The boot and recycle both sign manifests,
// so both build the records here: a unit's record says the same whichever wrote it, and
// a manifest written by recycle renders exactly as one written by the boot.
//
// It copies; it decides nothing. The verdicts come from decision.Conclude.
package record

import (
	"fmt"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// Execution is what the steps reported; a nil report is a step that did not complete
// (or did not run).
type Execution struct {
	ACS   *apply.Report
	Bind  *vfiobind.Report
	Erase *erase.Report
}

// DriverNow reads a function's driver as sysfs holds it now; ok is false when sysfs
// cannot say.
type DriverNow func(*pci.Device) (driver string, ok bool)

// Drivers reads driver links beneath root, through vfiobind's resolver (a link that
// leaves the root is an error, not a path followed).
func Drivers(root string) DriverNow {
	sys := vfiobind.Root(root)
	return func(d *pci.Device) (string, bool) {
		drv, err := vfiobind.Driver(sys, d.Addr)
		return drv, err == nil
	}
}

// Units are the records of the decision's units under the verdicts vs. A unit without a
// verdict is recorded failed: no verdict is no promise about it.
func Units(d *decision.Decision, vs []decision.Verdict, x Execution, now DriverNow) []manifest.Unit {
	if d == nil {
		return nil
	}
	bind := map[string]vfiobind.FunctionReport{}
	if x.Bind != nil {
		for _, u := range x.Bind.Units {
			for _, f := range u.Functions {
				bind[f.Addr.String()] = f
			}
		}
	}
	acs := map[topology.UnitID][]manifest.ACSChange{}
	if x.ACS != nil {
		for _, c := range x.ACS.Changes {
			for _, u := range c.Units() {
				acs[u] = append(acs[u], ACSChange(c))
			}
		}
	}
	ats := map[topology.UnitID][]manifest.Finding{}
	for _, f := range d.ATS {
		sev := "info"
		if f.Missing() {
			sev = "warning"
		}
		ats[f.Unit] = append(ats[f.Unit], manifest.Finding{Object: f.Addr.String(), Severity: sev, Message: f.String()})
	}
	verdict := map[topology.UnitID]decision.Verdict{}
	for _, v := range vs {
		verdict[v.Unit] = v
	}
	var out []manifest.Unit
	for _, u := range d.Units() {
		v := verdict[u.ID]
		mu := manifest.Unit{ID: u.ID.String(), Status: string(v.Status), Reasons: v.Reasons, NUMANode: u.NUMANode,
			ModuleID: u.ModuleID, ModuleSource: u.ModuleSource,
			ACSChanges: acs[u.ID], ATSFindings: ats[u.ID], Erase: erase.Record(d.Erase, x.Erase.Unit(u.ID))}
		if rp := u.RootPort(); rp != nil {
			mu.UpLink = Link(rp)
		}
		if mu.Status == "" {
			mu.Status = string(topology.StatusFailed)
		}
		for _, fn := range u.Functions() {
			if fn == nil {
				continue
			}
			bdf := fn.Addr.String()
			f := manifest.Function{
				BDF: bdf, Vendor: fmt.Sprintf("0x%04x", fn.VendorID), Device: fmt.Sprintf("0x%04x", fn.DeviceID),
				SubsystemVendor: fmt.Sprintf("0x%04x", fn.SubsystemVendor), SubsystemDevice: fmt.Sprintf("0x%04x", fn.SubsystemDevice),
				Class: fmt.Sprintf("0x%06x", fn.Class), Role: string(d.Labels.RoleOf(fn.Addr)), IOMMUGroup: fn.IOMMUGroup, NUMANode: fn.NUMANode,
				DriverBefore: fn.Driver, DriverAfter: fn.Driver, Link: Link(fn), BARs: BARs(fn),
			}
			br, bound := bind[bdf]
			if bound {
				f.DriverBefore, f.DriverAfter, f.IOMMUGroup = br.DriverBefore, br.DriverAfter, br.Group
			}
			if !bound || br.Err != "" || !v.Usable() {
				// Not bound by this run, or not cleanly (unit refused or failed, a step
				// cut short, dry run): what sysfs says now, so the hypervisor never trusts
				// a stale scan.
				if now != nil {
					if drv, ok := now(fn); ok {
						f.DriverAfter = drv
					}
				}
			}
			mu.Functions = append(mu.Functions, f)
		}
		out = append(out, mu)
	}
	return out
}

// NVLink is the profile's NVLink partition layout in the manifest's words; nil when the
// profile declares none.
func NVLink(p *topology.Profile) *manifest.NVLink {
	if p == nil || len(p.NVLinkPartitions) == 0 {
		return nil
	}
	nv := &manifest.NVLink{Source: fmt.Sprintf("profile %s: nvlink_partitions", p.Name)}
	for _, set := range p.NVLinkPartitions {
		nv.Partitions = append(nv.Partitions, append([]int(nil), set...))
	}
	return nv
}

// BARs are a function's BARs in the manifest's words; nil without any.
func BARs(d *pci.Device) []manifest.BAR {
	var out []manifest.BAR
	for _, b := range d.BARs {
		out = append(out, manifest.BAR{Index: b.Index, Size: b.Size, IO: b.IO, Is64: b.Is64, Prefetchable: b.Prefetch})
	}
	return out
}

// Link is a function's link in the manifest's words (zero without a PCIe link).
func Link(d *pci.Device) manifest.Link {
	e := d.Express
	if e == nil || !e.HasLink {
		return manifest.Link{}
	}
	return manifest.Link{Speed: e.Speed.String(), Width: int(e.Width), MaxSpeed: e.MaxSpeed.String(), MaxWidth: int(e.MaxWidth)}
}

// ACSResult is apply's word for a port, with its error and note.
func ACSResult(c apply.Change) string {
	s := string(c.Result)
	if c.Error != "" {
		s += ": " + c.Error
	}
	if c.Note != "" {
		s += " (" + c.Note + ")"
	}
	return s
}

// ACSChange is apply's record of one port in the manifest; before and after only when
// the port was read.
func ACSChange(c apply.Change) manifest.ACSChange {
	mc := manifest.ACSChange{Port: c.Addr.String(), Target: c.Target.Lspci(), Result: ACSResult(c)}
	if c.Read {
		mc.Before, mc.After = c.Before.Lspci(), c.After.Lspci()
	}
	return mc
}

// NUMACPUs are the host NUMA nodes' CPU lists beneath root, in node order.
func NUMACPUs(root string) ([]manifest.NUMACPUs, error) {
	cpus, err := pci.NodeCPUs(root)
	if err != nil {
		return nil, err
	}
	var out []manifest.NUMACPUs
	for _, n := range pci.SortedNodes(cpus) {
		out = append(out, manifest.NUMACPUs{Node: n, CPUs: cpus[n]})
	}
	return out, nil
}
