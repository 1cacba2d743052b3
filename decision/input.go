package decision

import (
	"fmt"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// notJudged is what the tree cannot show: an lspci dump carries no IOMMU groups, so
// whether each unit's groups hold it alone is not judged from it (the audit skips
// groups on such a tree) and is left to a decision on the node itself.
func notJudged(t *pci.Tree) []string {
	var out []string
	if t.NoGroups != "" {
		out = append(out, "iommu groups: "+t.NoGroups+"; whether each unit's groups hold it alone is judged on the node (plan --root, apply, boot)")
	}
	return out
}

// noUnits says why a profile that found none of the units it exists for is not a node
// to pass anything through from: a GPU node's profile on a host without GPUs, or a node
// whose GPUs the profile's rules do not match. "" when it found units.
func noUnits(p *topology.Profile, l *topology.Labels) string {
	if len(l.Units) > 0 {
		return ""
	}
	what := p.Name
	if p.Description != "" {
		what += " (" + p.Description + ")"
	}
	return fmt.Sprintf("profile %s found none of the units it is for: no function matches its gpu rules; this node is not what the profile describes", what)
}
