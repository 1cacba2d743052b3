package fabricmanager

import (
	"fmt"
	"slices"
	"strings"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
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

// CheckMap holds each unit's Module ID in the manifest to the one the NVIDIA driver
// reported for the unit's GPU (topology.ParseNVSMI of `nvidia-smi -q`, captured on this
// node while its GPUs were still on nvidia): the one thing FM cannot say, which GPU is
// which module, since it names members by Module ID with the PCI fields zeroed. It
// returns each mismatch: a unit whose GPU the capture does not hold, or holds with
// another Module ID (or none). None: the manifest's map is the driver's.
func CheckMap(m *manifest.Manifest, gpus []topology.NVSMIGPU) []string {
	driver := map[pci.Address]int{}
	for _, g := range gpus {
		driver[g.Addr] = g.Module
	}
	var out []string
	for _, u := range m.Units {
		for _, f := range u.Functions {
			if f.Role != string(topology.RoleGPU) {
				continue
			}
			a, err := pci.ParseAddress(f.BDF)
			if err != nil {
				out = append(out, fmt.Sprintf("unit %s: GPU %q: %v", u.ID, f.BDF, err))
				continue
			}
			mod, ok := driver[a]
			switch {
			case !ok:
				out = append(out, fmt.Sprintf("unit %s: GPU %s is not in nvidia-smi's output: the capture is of another node, or was taken after the GPU left nvidia", u.ID, a))
			case mod == 0:
				out = append(out, fmt.Sprintf("unit %s: GPU %s: the driver reports no Module ID; the manifest says %d", u.ID, a, u.ModuleID))
			case mod != u.ModuleID:
				out = append(out, fmt.Sprintf("unit %s: GPU %s is module %d to the driver, %d to the manifest (module_source %q)", u.ID, a, mod, u.ModuleID, u.ModuleSource))
			}
		}
	}
	return out
}
