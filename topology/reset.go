package topology

import (
	"fmt"

	"github.com/passage-boot/passage/pci"
)

// ResetRefusal says why passage must not reset the function at a; nil when it may. Only
// a function passage passes through may be reset: every other role is the host's, and
// one of them is never reset by anyone but its own driver. On HGX B200/B300 the NVSwitches
// are not PCI devices; Fabric Manager and NVLSM reach them through the baseboard
// ConnectX-7 bridge's limited PFs (nvswitch-mgmt), and an FLR of one resets its NVSwitch
// (NVIDIA Fabric Manager User Guide, "NVIDIA HGX B200/B300 GPU Baseboard"), under every
// running partition at once.
//
// A bridge is never a passthrough function, so a secondary bus reset, which resets
// everything below the bridge, is refused here too. The kernel's own reset of an endpoint
// (the reset attribute) reaches only that function: its bus and slot methods are refused
// for a function that shares its bus or is multi-function (pci_parent_bus_reset and
// pci_dev_reset_slot_function in drivers/pci/pci.c).
func (l *Labels) ResetRefusal(a pci.Address) error {
	if l == nil || l.Tree == nil {
		return fmt.Errorf("%s: no labelling says what the function is", a)
	}
	d := l.Tree.Lookup(a)
	if d == nil {
		return fmt.Errorf("%s: not in the labelled tree, so nothing says what it is", a)
	}
	fl := l.Of(a)
	switch {
	case fl.Role == RoleNVSwitchMgmt:
		return fmt.Errorf("%s (%s) is %s (rule %q): an FLR of an NVSwitch management function resets its NVSwitch under every partition using it",
			a, d.IDs(), fl.Role, fl.Rule)
	case !fl.Role.Passthrough():
		return fmt.Errorf("%s (%s) is %s: passage resets only the functions it passes through", a, d.IDs(), fl.Role)
	case d.IsBridge() || len(d.Children) > 0:
		return fmt.Errorf("%s (%s) is a bridge: its secondary bus reset reaches every function below it", a, d.IDs())
	}
	return nil
}
