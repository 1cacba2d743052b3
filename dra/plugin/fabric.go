package plugin

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/passage-boot/passage/dra/fabric"
	"github.com/passage-boot/passage/manifest"
)

// StepFabric is the quarantine taint's value (and the failed step in units.json) of a
// unit whose NVLink partition Fabric Manager would not deactivate: its GPUs are neither
// reset nor offered while FM may still route NVLink traffic to them.
const StepFabric = "fabric"

// moduleIDs are the GPU Module IDs of units (Fabric Manager's physicalId) in m. A unit
// whose Module ID the manifest does not know cannot be matched to FM's partitions.
func moduleIDs(m *manifest.Manifest, units []string) ([]int, error) {
	var out []int
	for _, id := range units {
		i := slices.IndexFunc(m.Units, func(u manifest.Unit) bool { return u.ID == id })
		if i < 0 {
			return nil, fmt.Errorf("unit %s: not in manifest generation %d", id, m.Generation)
		}
		u := m.Units[i]
		if u.ModuleID <= 0 {
			src := ""
			if u.ModuleSource != "" {
				src = fmt.Sprintf(" (module_source %q)", manifest.Printable(u.ModuleSource))
			}
			return nil, fmt.Errorf("unit %s: GPU Module ID unknown in manifest generation %d%s: no FM partition can be matched to it", id, m.Generation, src)
		}
		out = append(out, u.ModuleID)
	}
	return out, nil
}

// activate gives the claim's units their NVLink partition, the one whose members are
// exactly their GPUs' Module IDs, before the claim is answered (the ledger records it
// first: package fabric); d.mu held.
func (d *Driver) activate(uid types.UID, units []string) error {
	mods, err := moduleIDs(d.v.Manifest, units)
	if err == nil {
		_, err = d.cfg.Fabric.Activate(string(uid), mods)
	}
	if err != nil {
		return fmt.Errorf("nvlink partition of units %s: %w", strings.Join(units, ","), err)
	}
	return nil
}

// releaseFabric deactivates the partitions the fabric ledger still gives the unit's
// GPU to (a release FM refused before, an operator's clear since): the turnaround
// resets nothing FM may route NVLink traffic to. The unit is released, so no claim may
// hold its module but the one that released it.
func (d *Driver) releaseFabric(id string) error {
	f := d.cfg.Fabric
	if f == nil {
		return nil
	}
	d.mu.Lock()
	mods, err := moduleIDs(d.v.Manifest, []string{id})
	d.mu.Unlock()
	if err != nil {
		return nil // no Module ID: prepare activated no partition for it
	}
	for _, c := range f.Holding(mods) {
		if err := f.Deactivate(c); err != nil {
			return fmt.Errorf("nvlink partition of claim %s still active: %w", c, err)
		}
	}
	return nil
}

// fabricHolds says whether the fabric ledger still gives unit's GPU (in m) to a claim.
func (d *Driver) fabricHolds(m *manifest.Manifest, unit string) bool {
	if d.cfg.Fabric == nil {
		return false
	}
	mods, err := moduleIDs(m, []string{unit})
	return err == nil && len(d.cfg.Fabric.Holding(mods)) > 0
}

// quarantineFabric tells why a claim's units were quarantined for the partition FM
// would not deactivate: in the log and, with a turnaround, as an Event on the Node.
func (d *Driver) quarantineFabric(ctx context.Context, claim string, units []string, err error) {
	msg := fmt.Sprintf("units %s quarantined: claim %s released, its NVLink partition not deactivated: %s. Their GPUs are not reset while it may be active; once FM deactivated it (the plugin asks again at every reload), clear: kubectl annotate node NODE %s=%s",
		strings.Join(units, ","), claim, lastError(err), ClearAnnotation, strings.Join(units, ","))
	d.logf("fabric: %s", msg)
	if d.cfg.Turnaround != nil {
		d.event(ctx, corev1.EventTypeWarning, "UnitQuarantined", msg)
	}
}

// ResumeFabric brings Fabric Manager and the fabric ledger together (fabric.Resume:
// FM waiting after a --restart is handed the active partitions, releases FM refused
// are asked again) and releases the partitions of claims no longer prepared (no CDI
// spec: a prepare that failed after FM answered, a node restarted under them). What
// still differs is logged when it changes. New calls it; the command at every reload.
func (d *Driver) ResumeFabric() {
	f := d.cfg.Fabric
	if f == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	var lines []string
	r, err := f.Resume()
	lines = append(lines, r.Lines()...)
	if err == nil {
		lines = append(lines, d.holdNVLink(r.Partitions)...)
	}
	if err != nil {
		lines = append(lines, err.Error())
	} else if specs, err := d.specs(); err != nil {
		lines = append(lines, fmt.Sprintf("prepared claims: %v", err))
	} else {
		prepared := map[string]bool{}
		for _, s := range specs {
			prepared[string(s.uid)] = true
		}
		entries := f.Entries()
		for _, c := range slices.Sorted(maps.Keys(entries)) {
			if e := entries[c]; !prepared[c] && e.State != fabric.StateDeactivating {
				if err := f.Deactivate(c); err != nil {
					lines = append(lines, fmt.Sprintf("claim %s is not prepared: partition %d not released: %v", c, e.Partition, err))
				} else {
					lines = append(lines, fmt.Sprintf("claim %s is not prepared: partition %d released", c, e.Partition))
				}
			}
		}
	}
	said := strings.Join(lines, "\n")
	if said == d.fabricSaid {
		return
	}
	d.fabricSaid = said
	for _, l := range lines {
		d.logf("fabric: %s", l)
	}
}

// holdNVLink takes FM's list as Resume read it and renders the objects again when what
// it says of the NVLink partitions changed (published at the next publish: the reload
// follows). FM out of reach changes nothing: prepare fails closed on its own. It returns
// lines to log.
func (d *Driver) holdNVLink(fm []fabric.Partition) []string {
	d.fmParts = fm
	if d.v == nil {
		return nil
	}
	off := d.nvlinkOffFor(d.v)
	var lines []string
	if off != d.nvlinkOff {
		if err := d.render(d.v); err != nil {
			return []string{fmt.Sprintf("NVLink partitions: render: %v", err)}
		}
	}
	switch {
	case off != "":
		lines = append(lines, off)
	case d.nvlinkSaid != "":
		lines = append(lines, "Fabric Manager's partitions agree with the manifest: NVLink partitions published")
	}
	d.nvlinkSaid = off
	return lines
}

// nvlinkOffFor holds v's NVLink partitions to FM's list as last read (fabric.Check over
// the units whose Module ID the manifest knows: the others publish none anyway): why
// none may be published while they disagree, so that no claim of a partition is
// allocated that prepare would refuse; "" while they agree, without a layout, or
// before FM was read.
func (d *Driver) nvlinkOffFor(v *manifest.Verified) string {
	if d.fmParts == nil || v == nil {
		return ""
	}
	l := fabric.LayoutOf(v.Manifest)
	if l.Partitions == nil {
		return ""
	}
	known := l.Units[:0:0]
	for _, u := range l.Units {
		if u.Module > 0 {
			known = append(known, u)
		}
	}
	l.Units = known
	mm := fabric.Check(l, d.fmParts)
	if len(mm) == 0 {
		return ""
	}
	return fmt.Sprintf("Fabric Manager's %d partitions and manifest generation %d disagree (%d mismatches: %s): no NVLink partition is published", len(d.fmParts), v.Manifest.Generation, len(mm), strings.Join(mm, "; "))
}
