package fabric

import (
	"fmt"
	"slices"
	"strings"

	"github.com/passage-boot/passage/manifest"
)

// Layout is what a node's manifest says of its NVLink fabric, for Check: its units'
// GPU Module IDs and the partitions (module sets) its SKU declares.
type Layout struct {
	Units []LayoutUnit
	// Partitions are the SKU's module-ID sets; nil when the manifest declares none.
	Partitions [][]int
	Source     string // where the manifest took them from
}

// LayoutOf is what the manifest says of the node's NVLink fabric: the units' Module IDs
// and the SKU's declared partitions (fabric check, and the plugin before it publishes).
func LayoutOf(m *manifest.Manifest) Layout {
	var l Layout
	for _, u := range m.Units {
		l.Units = append(l.Units, LayoutUnit{ID: u.ID, Module: u.ModuleID, Source: u.ModuleSource})
	}
	if m.NVLink != nil {
		l.Partitions, l.Source = m.NVLink.Partitions, m.NVLink.Source
	}
	return l
}

// LayoutUnit is one unit's GPU.
type LayoutUnit struct {
	ID     string
	Module int    // 0: unknown
	Source string // where the manifest took the Module ID from
}

// Check holds FM's partition list to the layout, and returns each mismatch: a unit
// whose Module ID is unknown, given twice, or in none of FM's partitions; an FM
// partition whose module set the layout does not declare, a declared set FM does not
// offer; a partition with NVLinks down. None: FM and the manifest agree.
func Check(l Layout, fm []Partition) []string {
	var out []string
	inFM := map[int]bool{}
	for _, p := range fm {
		for _, m := range p.Modules() {
			inFM[m] = true
		}
	}
	seen := map[int]string{}
	for _, u := range l.Units {
		switch {
		case u.Module <= 0:
			src := ""
			if u.Source != "" {
				src = fmt.Sprintf(" (module_source %q)", u.Source)
			}
			out = append(out, fmt.Sprintf("unit %s: GPU Module ID unknown%s: no FM partition can be matched to it", u.ID, src))
			continue
		case seen[u.Module] != "":
			out = append(out, fmt.Sprintf("unit %s: module %d is unit %s's too", u.ID, u.Module, seen[u.Module]))
		case !inFM[u.Module]:
			out = append(out, fmt.Sprintf("unit %s: module %d is in none of FM's partitions", u.ID, u.Module))
		}
		seen[u.Module] = u.ID
	}
	if l.Partitions == nil {
		return append(out, "the manifest declares no NVLink layout (nvlink.partitions): FM's partitions cannot be checked")
	}
	declared := make([][]int, len(l.Partitions))
	for i, s := range l.Partitions {
		declared[i] = slices.Sorted(slices.Values(s))
	}
	has := func(list [][]int, s []int) bool {
		return slices.ContainsFunc(list, func(d []int) bool { return slices.Equal(d, s) })
	}
	var offered [][]int
	for _, p := range fm {
		m := p.Modules()
		offered = append(offered, m)
		if !has(declared, m) {
			out = append(out, fmt.Sprintf("FM %s: the manifest's NVLink layout has no such module set", p))
		}
		if d := p.Degraded(); len(d) > 0 {
			out = append(out, fmt.Sprintf("FM %s is degraded: %s", p, strings.Join(d, ", ")))
		}
	}
	for _, d := range declared {
		if !has(offered, d) {
			src := ""
			if l.Source != "" {
				src = fmt.Sprintf(" (%s)", l.Source)
			}
			out = append(out, fmt.Sprintf("the manifest's NVLink layout%s declares modules {%s}: FM offers no partition of them", src, moduleList(d)))
		}
	}
	return out
}
