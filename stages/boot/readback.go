package boot

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
)

// ReadbackName is the file WriteReadback leaves in /run/passage.
const ReadbackName = "readback.json"

// Readback is a second, independent look at the node once the stages are done: a fresh
// scan of sysfs and config space, not the stages' own read-backs. A test harness (or an
// operator at the console) compares it with the manifest's claims: ACS Control on the
// ports, drivers, IOMMU groups and their /dev/vfio nodes, the management NIC's lease.
type Readback struct {
	Functions []ReadbackFunction `json:"functions"`
	Leases    []string           `json:"leases"`
}

// ReadbackFunction is one function as sysfs shows it after the boot.
type ReadbackFunction struct {
	BDF        string `json:"bdf"`
	IDs        string `json:"ids"`   // "1af4:1041"
	Class      string `json:"class"` // "0x020000"
	Driver     string `json:"driver"`
	IOMMUGroup int    `json:"iommu_group"`
	// VFIODev is /dev/vfio/<group> when the function is on vfio-pci and the node exists.
	VFIODev string `json:"vfio_dev,omitempty"`
	// ACSCap and ACSCtl are the ACS registers (hex) of a function with the capability;
	// ACSCtlText is ACSCtl in lspci's words.
	ACSCap     string `json:"acs_cap,omitempty"`
	ACSCtl     string `json:"acs_ctl,omitempty"`
	ACSCtlText string `json:"acs_ctl_text,omitempty"`
}

// WriteReadback scans the node again and writes the result to <root>/run/passage.
func (b *Boot) WriteReadback() error {
	t, err := pci.Scan(b.Root)
	if err != nil {
		return fmt.Errorf("readback: %w", err)
	}
	rb := Readback{Functions: []ReadbackFunction{}, Leases: []string{}}
	for _, d := range t.Devices {
		f := ReadbackFunction{BDF: d.Addr.String(), IDs: d.IDs(), Class: fmt.Sprintf("0x%06x", d.Class),
			Driver: d.Driver, IOMMUGroup: d.IOMMUGroup}
		if d.Driver == "vfio-pci" && d.IOMMUGroup >= 0 {
			dev := filepath.Join("/dev/vfio", strconv.Itoa(d.IOMMUGroup))
			if _, err := os.Stat(b.path(dev)); err == nil {
				f.VFIODev = dev
			}
		}
		if d.ACS != nil {
			f.ACSCap = fmt.Sprintf("0x%04x", uint16(d.ACS.Cap))
			f.ACSCtl = fmt.Sprintf("0x%04x", uint16(d.ACS.Ctl))
			f.ACSCtlText = d.ACS.Ctl.Lspci()
		}
		rb.Functions = append(rb.Functions, f)
	}
	for _, l := range b.Leases {
		rb.Leases = append(rb.Leases, l.Describe())
	}
	j, err := json.MarshalIndent(rb, "", " ")
	if err != nil {
		return fmt.Errorf("readback: %w", err)
	}
	if err := os.MkdirAll(b.RunDir(), 0o755); err != nil {
		return fmt.Errorf("readback: %w", err)
	}
	return manifest.WriteAtomic(b.RunDir(), ReadbackName, append(j, '\n'))
}
