// Package topology decides what every PCI function is (its role, from rules that are
// data), which functions travel together into a VM (units), what the ACS registers must
// hold, and what PCIe tree each guest should see. It reads a pci.Tree and never touches
// sysfs.
package topology

import (
	"fmt"

	"github.com/passage-boot/passage/pci"
)

// Role is what a function is for on this node.
type Role string

const (
	RoleGPU          Role = "gpu"
	RoleGPUNIC       Role = "gpu-nic"     // GPU-adjacent ConnectX PF
	RoleDataDirect   Role = "data-direct" // ConnectX-8 data-direct function; travels with its PF
	RoleGPUNVMe      Role = "gpu-nvme"
	RoleMgmtNIC      Role = "mgmt-nic"
	RoleNVSwitchMgmt Role = "nvswitch-mgmt"
	RoleSwitchPort   Role = "switch-port" // root, upstream or downstream port
	RolePlaceholder  Role = "placeholder" // Broadcom virtual placeholder endpoint
	RoleHostOther    Role = "host-other"
	RoleUnlabeled    Role = "unlabeled"
)

// Passthrough says whether functions of this role go to a guest with their unit.
func (r Role) Passthrough() bool {
	switch r {
	case RoleGPU, RoleGPUNIC, RoleDataDirect, RoleGPUNVMe:
		return true
	}
	return false
}

// Status is a unit's readiness for passthrough, as the manifest reports it.
type Status string

const (
	StatusReady    Status = "ready"
	StatusDegraded Status = "degraded" // usable, with a documented loss (e.g. no DT: no ATS)
	StatusFailed   Status = "failed"   // must not be scheduled
)

// Worse returns the more severe of two statuses.
func (s Status) Worse(o Status) Status {
	rank := map[Status]int{"": 0, StatusReady: 1, StatusDegraded: 2, StatusFailed: 3}
	if rank[o] > rank[s] {
		return o
	}
	return s
}

// Unit is one GPU and what travels with it into a VM.
type Unit struct {
	ID         UnitID
	GPU        *pci.Device
	NICs       []*pci.Device // adjacent ConnectX PFs, in address order
	DataDirect []*pci.Device // data-direct functions paired with the NICs
	NVMe       []*pci.Device
	Bridges    []*pci.Device // ports on the paths from the functions to the root port
	NUMANode   int
	// ModuleID is the GPU's Module ID as the profile's modules map declares it (1..N, what
	// Fabric Manager names partition members by); 0 when the map names none for it.
	// ModuleSource says which entry gave it: "profile b300: modules[0000:17:00.0]".
	ModuleID     int
	ModuleSource string
	Status       Status
	Reasons      []string
}

// Functions returns every passthrough function of the unit: GPU, NICs, data-direct, NVMe.
func (u *Unit) Functions() []*pci.Device {
	out := []*pci.Device{u.GPU}
	out = append(out, u.NICs...)
	out = append(out, u.DataDirect...)
	return append(out, u.NVMe...)
}

// Degrade lowers the unit's status (never raises it) and records why.
func (u *Unit) Degrade(s Status, format string, args ...any) {
	u.Status = u.Status.Worse(s)
	u.Reasons = append(u.Reasons, fmt.Sprintf(format, args...))
}

// ACSPort is the plan for one port's ACS Control register: Target = (Current &^ Mask) |
// Flags. Bits outside Mask are kept as they are, so egress control is never touched.
type ACSPort struct {
	Addr     pci.Address
	Unit     UnitID   // the unit whose path holds the port (the lowest, when several do)
	Shared   []UnitID // the other units whose paths hold it
	Position string   // "nic-port" (above the CX-8 PFs), "gpu-port", "root-port", ...
	Offset   int      // config offset of the ACS capability (0 when the port lacks one)
	Cap      pci.ACSBits
	Current  pci.ACSBits
	Mask     pci.ACSBits
	Flags    pci.ACSBits
	Reason   string
	// Verdict is what the port makes of its unit when it cannot be planned as wanted
	// (failed: no ACS capability; degraded: a NIC port without DT), Problem says why. The
	// decision (package decision) applies it; the plan only reports it.
	Verdict Status
	Problem string
	// Skip says why the port is not to be written ("" to write it): the decision sets it
	// for the ports of a unit that will not be passed through.
	Skip string
}

// Target is the control value the plan wants.
func (p ACSPort) Target() pci.ACSBits { return p.Current&^p.Mask | p.Flags }

// Units are every unit whose path holds the port.
func (p ACSPort) Units() []UnitID { return append([]UnitID{p.Unit}, p.Shared...) }

// CtlOffset is the config-space offset of the ACS Control register.
func (p ACSPort) CtlOffset() int { return p.Offset + pci.ACSCtlReg }
