package manifest

import "time"

// ResetClears is the record's plain statement of what a reset does and does not clear,
// carried in every unit's erase record so no reader has to look it up.
const ResetClears = "a function reset (FLR, or the bus/PM reset the kernel falls back to) returns the " +
	"function's registers and queues to their power-on state as its designer defined them; it does " +
	"not zero device memory: a GPU's memory (HBM) and a NIC's on-board memory are not guaranteed " +
	"cleared by it. NVMe user data is cleared only by the erase recorded above it, never by a reset."

// UnitErase is what the erase stage did to a unit between tenants (schema 2): each NVMe
// erased and read back, each passthrough function reset.
type UnitErase struct {
	Policy string      `json:"policy"` // passage.erase= as the boot ran: auto or require
	NVMe   []NVMeErase `json:"nvme"`
	Resets []Reset     `json:"resets"`
	// Error is what stopped the unit outside any one device ("" when nothing did).
	Error string `json:"error,omitempty"`
	// ResetClears is ResetClears.
	ResetClears string `json:"reset_clears"`
}

// NVMeErase is one NVMe controller's erase.
type NVMeErase struct {
	BDF        string          `json:"bdf"`
	Controller string          `json:"controller"` // the kernel's name (nvme3)
	Model      string          `json:"model"`
	Serial     string          `json:"serial"`
	Firmware   string          `json:"firmware"`
	SANICAP    string          `json:"sanicap"` // Identify Controller, "0x00000003"
	FNA        string          `json:"fna"`     // "0x04"
	Namespaces []NVMeNamespace `json:"namespaces"`
	// Method is the method that erased it ("sanitize-crypto-erase", ...; "" none did).
	Method string `json:"method"`
	// Attempts are the methods tried in order, each with the controller's answer.
	Attempts []string `json:"attempts"`
	// SanitizeStatus is the Sanitize Status log's state after a sanitize.
	SanitizeStatus string        `json:"sanitize_status"`
	Duration       time.Duration `json:"duration_ns"`
	VerifiedLBAs   int           `json:"verified_lbas"`
	// Error is why it is not known erased; "" when erased and every sampled block read
	// back as deallocated.
	Error string `json:"error,omitempty"`
}

// NVMeNamespace is one namespace's size and how many of its blocks were read back.
type NVMeNamespace struct {
	NSID         uint32 `json:"nsid"`
	Blocks       uint64 `json:"blocks"`
	BlockSize    int    `json:"block_size"`
	VerifiedLBAs int    `json:"verified_lbas"`
}

// Reset is one function's reset.
type Reset struct {
	BDF     string `json:"bdf"`
	Methods string `json:"methods"` // reset_method as offered, tried in that order
	Result  string `json:"result"`  // "done" or why not
}

func normalizeErase(e *UnitErase) *UnitErase {
	if e == nil {
		return nil
	}
	c := *e
	c.NVMe = nonNil(c.NVMe)
	c.Resets = nonNil(c.Resets)
	for i := range c.NVMe {
		c.NVMe[i].Namespaces = nonNil(c.NVMe[i].Namespaces)
		c.NVMe[i].Attempts = nonNil(c.NVMe[i].Attempts)
	}
	return &c
}
