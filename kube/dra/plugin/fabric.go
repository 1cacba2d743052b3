package plugin

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/passage-boot/passage/kube/fabricmanager"
	"github.com/passage-boot/passage/manifest"
)

// FabricEvery is how often the plugin reads Fabric Manager (ResumeFabric), whatever
// the manifest's reload period: an FM started with --restart rejects every call until
// it is handed the active partitions, and exits if they do not come within 60 s
// (NVLINK.md §0.6 and §3 "FM restart / HA"; FM User Guide, "Resiliency"). A reconnect
// of the connection FM restarted under is one of ResumeFabric's calls, so the list is
// handed at most FabricEvery, plus a call's connects (fabricmanager.DefaultReconnect, 2 s, and
// one connect timeout, 1 s), after FM came back: 8 s of the 60.
const FabricEvery = 5 * time.Second

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
// first: package fabricmanager); d.mu held.
func (d *Driver) activate(f *fabricmanager.Fabric, uid types.UID, units []string) error {
	mods, err := moduleIDs(d.v.Manifest, units)
	if err == nil {
		_, err = f.Activate(string(uid), mods)
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
	msg := fmt.Sprintf("units %s quarantined: claim %s released, its NVLink partition not deactivated: %s. Their GPUs are not reset while it may be active; once FM deactivated it (the plugin asks again every %v), clear: kubectl annotate node NODE %s=%s",
		strings.Join(units, ","), claim, lastError(err), FabricEvery, ClearAnnotation, strings.Join(units, ","))
	d.logf("fabric: %s", msg)
	if d.cfg.Turnaround != nil {
		d.event(ctx, corev1.EventTypeWarning, "UnitQuarantined", msg)
	}
}

// fabric is the Fabric Manager this node talks to (fabricFor the manifest verified
// last); d.mu held.
func (d *Driver) fabric() *fabricmanager.Fabric {
	if d.v == nil {
		return d.fabricFor(nil)
	}
	return d.fabricFor(d.v.Manifest)
}

// fabricFor is the Fabric Manager a node with manifest m talks to: Config.Fabric while
// m knows a GPU Module ID, or the ledger still gives a claim a partition. A node whose
// manifest knows none opens no FM (no library loaded, nothing logged) and prepares
// claims without a partition, so one DaemonSet serves every node.
func (d *Driver) fabricFor(m *manifest.Manifest) *fabricmanager.Fabric {
	f := d.cfg.Fabric
	if f == nil {
		return nil
	}
	if m != nil && slices.ContainsFunc(m.Units, func(u manifest.Unit) bool { return u.ModuleID > 0 }) {
		return f
	}
	if len(f.Entries()) > 0 {
		return f
	}
	return nil
}

// unmatched decides which units of m are neither published nor prepared because of
// FM (the one place that does), each with why: on a node that talks to FM (fabricFor)
// every claim is prepared only once FM activated the partition of exactly its units'
// GPUs, and a unit whose Module ID m does not know (moduleIDs refuses it) has none, so
// a claim of it would be allocated and then refused at every prepare. It is not
// prepared alone without a partition either: in shared NVSwitch mode a GPU in no
// active partition has no NVLink fabric (its fabric state stays "In Progress",
// NVLINK.md §1). A node that does not talk to FM offers such a unit alone, as any
// other.
func (d *Driver) unmatched(m *manifest.Manifest) map[string]string {
	if d.fabricFor(m) == nil {
		return nil
	}
	out := map[string]string{}
	for _, u := range m.Units {
		if _, err := moduleIDs(m, []string{u.ID}); err != nil {
			out[u.ID] = err.Error()
		}
	}
	return out
}

// unmatchedLines say which units unmatched leaves out of v, for ResumeFabric's log.
func (d *Driver) unmatchedLines(v *manifest.Verified) []string {
	if v == nil {
		return nil
	}
	um := d.unmatched(v.Manifest)
	var lines []string
	for _, u := range slices.Sorted(maps.Keys(um)) {
		lines = append(lines, fmt.Sprintf("unit %s is not offered: %s; this node prepares a claim only with its units' FM partition (a profile's modules: stanza gives the Module ID: passage-dra fabric modules)", u, um[u]))
	}
	return lines
}

// ResumeFabric brings Fabric Manager and the fabric ledger together (fabricmanager.Resume:
// FM waiting after a --restart is handed the active partitions, releases FM refused
// are asked again), releases the partitions of claims no longer prepared (no CDI
// spec: a prepare that failed after FM answered, a node restarted under them), and
// holds the NVLink partitions published to FM's list as read now (holdNVLink). What
// still differs is logged when it changes. New calls it; the command every
// FabricEvery and before every reload.
func (d *Driver) ResumeFabric() {
	d.mu.Lock()
	defer d.mu.Unlock()
	var lines []string
	var ferr error
	if f := d.fabric(); f != nil {
		var r fabricmanager.Report
		r, ferr = f.Resume()
		d.fmParts, d.fmErr = r.Partitions, ferr
		if ferr == nil && d.fmParts == nil {
			d.fmParts = []fabricmanager.Partition{} // read, and FM listed none
		}
		lines = append(lines, r.Lines()...)
		if ferr == nil {
			lines = append(lines, d.releaseUnprepared(f)...)
		}
	} else {
		d.fmParts, d.fmErr = nil, nil // read again once the node talks to FM
	}
	off, said := d.holdNVLink()
	// FM out of reach is said once: in why no NVLink partition is published, when it is.
	if ferr != nil && !strings.Contains(off, ferr.Error()) {
		lines = append(lines, ferr.Error())
	}
	lines = append(lines, said...)
	lines = append(lines, d.unmatchedLines(d.v)...)
	joined := strings.Join(lines, "\n")
	if joined == d.fabricSaid {
		return
	}
	d.fabricSaid = joined
	for _, l := range lines {
		d.logf("fabric: %s", l)
	}
}

// releaseUnprepared deactivates the partitions of the ledger's claims that no CDI spec
// holds, and says what it did; d.mu held.
func (d *Driver) releaseUnprepared(f *fabricmanager.Fabric) []string {
	specs, err := d.specs()
	if err != nil {
		return []string{fmt.Sprintf("prepared claims: %v", err)}
	}
	prepared := map[string]bool{}
	for _, s := range specs {
		prepared[string(s.uid)] = true
	}
	var lines []string
	entries := f.Entries()
	for _, c := range slices.Sorted(maps.Keys(entries)) {
		if e := entries[c]; !prepared[c] && e.State != fabricmanager.StateDeactivating {
			if err := f.Deactivate(c); err != nil {
				lines = append(lines, fmt.Sprintf("claim %s is not prepared: partition %d not released: %v", c, e.Partition, err))
			} else {
				lines = append(lines, fmt.Sprintf("claim %s is not prepared: partition %d released", c, e.Partition))
			}
		}
	}
	return lines
}

// holdNVLink renders the objects again when what nvlinkOffFor says of the NVLink
// partitions changed since they were rendered (published at the next publish: the
// reload follows). It returns why none is published ("" when they are) and the lines
// to log: the reason whenever there is one, the agreement once after a reason was
// said; d.mu held.
func (d *Driver) holdNVLink() (string, []string) {
	if d.v == nil {
		return "", nil
	}
	off := d.nvlinkOffFor(d.v)
	if off != d.nvlinkOff {
		if err := d.render(d.v); err != nil {
			return off, []string{fmt.Sprintf("NVLink partitions: render: %v", err)}
		}
	}
	var lines []string
	switch {
	case off != "":
		lines = append(lines, off)
	case d.nvlinkSaid != "":
		lines = append(lines, "Fabric Manager's partitions agree with the manifest: NVLink partitions published")
	}
	d.nvlinkSaid = off
	return off, lines
}

// nvlinkOffFor decides whether v's NVLink partitions are published (the one place that
// does): only while Fabric Manager's list, as ResumeFabric read it last, agrees with
// them (fabricmanager.Check over the units whose Module ID the manifest knows: the others
// publish none anyway). A claim of a partition is prepared only once FM activated it,
// so a partition published without FM's word would be allocated and then refused, or,
// with no FM configured, prepared with no NVLink at all. It returns why none is
// published: no FM configured, FM not read yet, FM out of reach (naming its error),
// FM and the manifest disagreeing (naming each mismatch); "" while they agree, and
// when v has nothing to publish (no layout, no Module ID known).
func (d *Driver) nvlinkOffFor(v *manifest.Verified) string {
	if v == nil {
		return ""
	}
	l := fabricmanager.LayoutOf(v.Manifest)
	if l.Partitions == nil {
		return ""
	}
	known := l.Units[:0:0]
	for _, u := range l.Units {
		if u.Module > 0 {
			known = append(known, u)
		}
	}
	if len(known) == 0 {
		return ""
	}
	l.Units = known
	const none = "no NVLink partition is published (units are offered alone)"
	switch {
	case d.cfg.Fabric == nil:
		return fmt.Sprintf("no Fabric Manager configured (--fm-socket, --fm-address, --fm-lib): nothing would activate a claim's partition: %s", none)
	case d.fmErr != nil:
		return fmt.Sprintf("Fabric Manager out of reach (%v): its partitions cannot be held to manifest generation %d: %s", d.fmErr, v.Manifest.Generation, none)
	case d.fmParts == nil:
		return fmt.Sprintf("Fabric Manager's partitions not read yet: %s", none)
	}
	mm := fabricmanager.Check(l, d.fmParts)
	if len(mm) == 0 {
		return ""
	}
	return fmt.Sprintf("Fabric Manager's %d partitions and manifest generation %d disagree (%d mismatches: %s): %s", len(d.fmParts), v.Manifest.Generation, len(mm), strings.Join(mm, "; "), none)
}

// NVLinkOff says why the objects published now carry no NVLink partition (the reason
// nvlinkOffFor gave when they were rendered); "" when they carry them or have none to
// carry.
func (d *Driver) NVLinkOff() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.nvlinkOff
}

// UsesFabric says whether the plugin talks to Fabric Manager now (fabric): --fm- flags
// given and the manifest knowing a GPU Module ID, or the ledger holding a partition.
func (d *Driver) UsesFabric() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.fabric() != nil
}
