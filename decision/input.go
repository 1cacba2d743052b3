package decision

import "github.com/passage-boot/passage/pci"

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
