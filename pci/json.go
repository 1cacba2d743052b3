package pci

import "fmt"

// DeviceJSON is one function as `passage inspect --json` prints it. IDs are "0x10de"-style
// hex strings and the class "0x030200", as sysfs prints them; the address is the
// kernel's "0000:f2:00.0". Values a source cannot give (a dump has no NUMA node, IOMMU
// group or driver; a conventional function has no link) are null.
//
// Other packages extend it by embedding: encoding/json flattens an embedded struct, so
//
//	type labelled struct {
//		pci.DeviceJSON
//		Role string `json:"role"`
//	}
//
// prints the same object with "role" added.
type DeviceJSON struct {
	BDF             string    `json:"bdf"`
	Vendor          string    `json:"vendor"`
	Device          string    `json:"device"`
	SubsystemVendor string    `json:"subsystem_vendor"`
	SubsystemDevice string    `json:"subsystem_device"`
	Class           string    `json:"class"`
	Parent          *string   `json:"parent"`
	NUMANode        *int      `json:"numa_node"`
	IOMMUGroup      *int      `json:"iommu_group"`
	Driver          *string   `json:"driver"`
	Link            *LinkJSON `json:"link"`
	ACS             *ACSJSON  `json:"acs"`
	ATS             ATSJSON   `json:"ats"`
	Problems        []string  `json:"problems"`
}

// LinkJSON is the Express link: current (LnkSta) and maximum (LnkCap) speed and width.
// Speeds are lspci's words ("64GT/s"), widths lane counts.
type LinkJSON struct {
	Speed    string `json:"speed"`
	Width    int    `json:"width"`
	MaxSpeed string `json:"max_speed"`
	MaxWidth int    `json:"max_width"`
}

// ACSJSON holds the ACS Capability and Control registers as "0x005f"-style hex (flag
// bits only for cap), with the set flags spelt out by their spec abbreviations
// ("SV RR CR UF") beside them for people.
type ACSJSON struct {
	Cap      string `json:"cap"`
	Ctl      string `json:"ctl"`
	CapFlags string `json:"cap_flags"`
	CtlFlags string `json:"ctl_flags"`
}

// ATSJSON says whether the ATS capability is there and whether ATS Control Enable is set.
type ATSJSON struct {
	Present bool `json:"present"`
	Enabled bool `json:"enabled"`
}

// TreeJSON is the whole document: {"devices":[...]} plus tree-level problems.
type TreeJSON struct {
	Devices  []DeviceJSON `json:"devices"`
	Problems []string     `json:"problems"`
}

func hex16(v uint16) string { return fmt.Sprintf("0x%04x", v) }

// JSON renders the function for --json output.
func (d *Device) JSON() DeviceJSON {
	j := DeviceJSON{
		BDF:             d.Addr.String(),
		Vendor:          hex16(d.VendorID),
		Device:          hex16(d.DeviceID),
		SubsystemVendor: hex16(d.SubsystemVendor),
		SubsystemDevice: hex16(d.SubsystemDevice),
		Class:           fmt.Sprintf("0x%06x", d.Class),
		Problems:        append([]string{}, d.Problems...),
	}
	if d.Parent != nil {
		p := d.Parent.Addr.String()
		j.Parent = &p
	}
	if d.NUMANode >= 0 {
		n := d.NUMANode
		j.NUMANode = &n
	}
	if d.IOMMUGroup >= 0 {
		g := d.IOMMUGroup
		j.IOMMUGroup = &g
	}
	if d.Driver != "" {
		s := d.Driver
		j.Driver = &s
	}
	if e := d.Express; e != nil && e.HasLink {
		j.Link = &LinkJSON{Speed: e.Speed.String(), Width: int(e.Width), MaxSpeed: e.MaxSpeed.String(), MaxWidth: int(e.MaxWidth)}
	}
	if a := d.ACS; a != nil {
		j.ACS = &ACSJSON{Cap: hex16(uint16(a.Cap)), Ctl: hex16(uint16(a.Ctl)), CapFlags: a.Cap.String(), CtlFlags: a.Ctl.String()}
	}
	if d.ATS != nil {
		j.ATS = ATSJSON{Present: true, Enabled: d.ATS.Enable}
	}
	return j
}

// JSON renders every function, in address order.
func (t *Tree) JSON() TreeJSON {
	out := TreeJSON{Devices: make([]DeviceJSON, 0, len(t.Devices)), Problems: append([]string{}, t.Problems...)}
	for _, d := range t.Devices {
		out.Devices = append(out.Devices, d.JSON())
	}
	return out
}
