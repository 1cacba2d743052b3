// Package applytest plays, on a synthetic tree, what a Linux 6.11+ kernel does with a
// pci=config_acs= argument before passage runs: it sets each listed port and logs it.
package applytest

import (
	"fmt"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// KernelSets writes each port's plan target into its ACS Control through cfg, as
// __pci_config_acs does for each entry of the argument, and returns the kernel log
// records it prints ("pci 0000:05:00.0: Configured ACS to 0x005d", in /dev/kmsg's
// "level,seq,usec,flags;" form). Ports without an ACS capability are left out, as
// topology.KernelArg leaves them out of the argument.
func KernelSets(cfg pci.ConfigIO, ports []topology.ACSPort) ([]string, error) {
	var log []string
	for _, p := range ports {
		if p.Offset == 0 || p.Mask == 0 {
			continue
		}
		if _, err := pci.WriteRegister(cfg, p.Addr, p.CtlOffset(), 2, uint32(p.Target())); err != nil {
			return nil, fmt.Errorf("acs %s: %w", p.Addr, err)
		}
		log = append(log, fmt.Sprintf("6,%d,%d,-;pci %s: Configured ACS to %#06x", 400+len(log), 1000000+len(log), p.Addr, uint16(p.Target())))
	}
	return log, nil
}
