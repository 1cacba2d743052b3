//go:build passagesim

package main

import (
	"fmt"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/internal/simnode"
)

// A passagesim binary is the cluster tests' node: its turnaround binds through
// vfiotest's kernel and erases simnode's NVMe controllers, all beneath --root, where the
// test reads what the erase left. A production build has no such file.
func init() {
	simulate = func(root string, t *plugin.Turnaround) error {
		k, err := simnode.Kernel(root)
		if err != nil {
			return fmt.Errorf("passagesim: %w", err)
		}
		t.Sysfs, t.Open = k, simnode.Opener(root)
		return nil
	}
}
