package hypervisor

import (
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/manifest"
)

// NVLinkPartition is one of the node's NVLink partitions: a set of GPU module IDs that
// Fabric Manager activates as a whole, in the shared NVSwitch model the only way GPUs of
// one VM get NVLink between them (Fabric Manager User Guide, "GPU Partitions": only a
// partition FM lists, matched exactly, is activated), with the manifest's units that
// hold those modules.
type NVLinkPartition struct {
	// Modules are the partition's module IDs (Fabric Manager's physicalId), ascending.
	Modules []int
	// Units[i] is the unit whose GPU is module Modules[i]; "" when no unit of the
	// manifest says it is.
	Units []string
}

// Name is the partition's module IDs joined by dots ("1.2.3.4"): the value every unit
// of the partition publishes, the same for all of them and for no other unit.
func (p NVLinkPartition) Name() string {
	s := make([]string, len(p.Modules))
	for i, m := range p.Modules {
		s[i] = strconv.Itoa(m)
	}
	return strings.Join(s, ".")
}

// Whole reports whether every module of the partition is a unit of the manifest. A
// partition that is not whole can never be one VM's: no unit stands for the module
// missing (its GPU not found, or its module ID not known).
func (p NVLinkPartition) Whole() bool { return !slices.Contains(p.Units, "") }

// Index is the place of unit in the partition (its module's, in ascending module
// order), -1 when the partition does not hold it.
func (p NVLinkPartition) Index(unit string) int {
	if unit == "" {
		return -1
	}
	return slices.Index(p.Units, unit)
}

// NVLinkPartitions reads the manifest's NVLink layout (manifest.NVLink, from the signed
// SKU profile) against its units' module IDs: every partition of two or more modules,
// by size and then by modules, each with the units that hold its modules. Single-module
// partitions are left out: one GPU has no NVLink peer, and a unit alone is claimed as
// it always was. No layout is no partition.
//
// A unit whose module ID is 0 (unknown: NVML cannot read it once the GPU is on
// vfio-pci) is in no partition. A layout or a module map a claim could be misled by is
// an error naming it: a module ID below 1, a module twice in one partition, two
// partitions of one size sharing a module (a unit would be in two of them, and a claim
// of that size could not tell which), a module ID two units give.
func NVLinkPartitions(m *manifest.Manifest) ([]NVLinkPartition, error) {
	if m.NVLink == nil {
		return nil, nil
	}
	unitOf := map[int]string{}
	for _, u := range m.Units {
		switch {
		case u.ModuleID == 0:
			continue
		case u.ModuleID < 0:
			return nil, fmt.Errorf("nvlink: unit %s: module ID %d", manifest.Printable(u.ID), u.ModuleID)
		}
		if other, dup := unitOf[u.ModuleID]; dup {
			return nil, fmt.Errorf("nvlink: module %d is both unit %s and unit %s", u.ModuleID, manifest.Printable(other), manifest.Printable(u.ID))
		}
		unitOf[u.ModuleID] = u.ID
	}
	var out []NVLinkPartition
	bySize := map[int]map[int][]int{} // size → module → the partition holding it
	for _, set := range m.NVLink.Partitions {
		mods := slices.Clone(set)
		sort.Ints(mods)
		for i, mod := range mods {
			if mod < 1 {
				return nil, fmt.Errorf("nvlink: partition %v: module ID %d", set, mod)
			}
			if i > 0 && mods[i-1] == mod {
				return nil, fmt.Errorf("nvlink: partition %v: module %d twice", set, mod)
			}
		}
		if len(mods) < 2 {
			continue
		}
		seen := bySize[len(mods)]
		if seen == nil {
			seen = map[int][]int{}
			bySize[len(mods)] = seen
		}
		for _, mod := range mods {
			if other, ok := seen[mod]; ok {
				if slices.Equal(other, mods) {
					return nil, fmt.Errorf("nvlink: partition %v listed twice", set)
				}
				return nil, fmt.Errorf("nvlink: partitions %v and %v share module %d", other, set, mod)
			}
			seen[mod] = mods
		}
		p := NVLinkPartition{Modules: mods, Units: make([]string, len(mods))}
		for i, mod := range mods {
			p.Units[i] = unitOf[mod]
		}
		out = append(out, p)
	}
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i].Modules, out[j].Modules
		if len(a) != len(b) {
			return len(a) < len(b)
		}
		return slices.Compare(a, b) < 0
	})
	return out, nil
}

// NVLinkGuest is the partition the units are, when they are exactly one whole partition
// of the manifest's layout (every unit of it, no other): the only guest whose GPUs
// Fabric Manager joins by NVLink. ok is false for any other set of units.
func NVLinkGuest(m *manifest.Manifest, units []string) (p NVLinkPartition, ok bool, err error) {
	parts, err := NVLinkPartitions(m)
	if err != nil {
		return NVLinkPartition{}, false, err
	}
	want := slices.Clone(units)
	sort.Strings(want)
	for _, p := range parts {
		have := slices.Clone(p.Units)
		sort.Strings(have)
		if p.Whole() && slices.Equal(have, want) {
			return p, true, nil
		}
	}
	return NVLinkPartition{}, false, nil
}

var nvWord = regexp.MustCompile(`^NV([1-9][0-9]*)$`)

// NVLinks is the number of NVLinks per GPU the manifest records: the profile's
// nvlinks (topology.Profile.NVLinks, 18 on HGX B200/B300), which the boot wrote into the
// guest plan's host matrix as the word between two GPUs (NV18, topology.HostMatrix). 0
// when the manifest records none: no guest plan, fewer than two GPUs in it, a platform
// without NVLink, or two GPU pairs that disagree.
func NVLinks(m *manifest.Manifest) int {
	if m.GuestPlan == nil {
		return 0
	}
	gp := m.GuestPlan
	gpu := func(i int) bool { return i < len(gp.MatrixLabels) && strings.HasPrefix(gp.MatrixLabels[i], "GPU") }
	n := 0
	for i, row := range gp.HostMatrix {
		for j, cell := range row {
			if i == j || !gpu(i) || !gpu(j) {
				continue
			}
			w := nvWord.FindStringSubmatch(cell)
			if w == nil {
				return 0
			}
			k, err := strconv.Atoi(w[1])
			if err != nil || (n != 0 && k != n) {
				return 0
			}
			n = k
		}
	}
	return n
}

// GuestNVLinks is what Input.NVLinks says for a guest of the units: the NVLinks per GPU
// the manifest records (NVLinks) when the units are one whole partition (NVLinkGuest),
// else 0.
func GuestNVLinks(m *manifest.Manifest, units []string) (int, error) {
	if _, ok, err := NVLinkGuest(m, units); !ok || err != nil {
		return 0, err
	}
	return NVLinks(m), nil
}
