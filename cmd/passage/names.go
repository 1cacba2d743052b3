package main

import (
	"flag"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pciids"
	"github.com/passage-boot/passage/topology"
)

// namesFlag is --pci-ids and --hwdb: where vendor and device names come from, as lspci
// takes them. Without them the system's pci.ids (pciids.DefaultPath; in the initramfs, the
// subset the image carries) names what it knows and udev's hwdb what pci.ids does not, and
// a node with neither shows IDs only, as lspci -n does.
type namesFlag struct{ file, hwdb string }

func (n *namesFlag) register(fs *flag.FlagSet) {
	fs.StringVar(&n.file, "pci-ids", "", "read vendor and device names from the pci.ids `FILE` (default "+pciids.DefaultPath+" when it exists)")
	fs.StringVar(&n.hwdb, "hwdb", "", "name what pci.ids does not from udev's hwdb.bin `FILE` (default: the one libudev opens, when there is one), or "+pciids.NoHwdb+" (lspci -O hwdb.disable=1)")
}

// open reads the names of tree's functions, and no others (pciids.OpenFor).
func (n *namesFlag) open(tree *pci.Tree) (*pciids.DB, error) {
	ids := make([]pciids.ID, 0, len(tree.Devices))
	for _, d := range tree.Devices {
		ids = append(ids, pciids.ID{Vendor: d.VendorID, Device: d.DeviceID})
	}
	return pciids.OpenDefaultFor(n.file, n.hwdb, ids)
}

// deviceNames is a function's names in a JSON document; absent where the database has
// none (or there is no database).
type deviceNames struct {
	VendorName string `json:"vendor_name,omitempty"`
	DeviceName string `json:"device_name,omitempty"`
}

// namer is db as the plan's Namer: nil (IDs only) without a database.
func namer(db *pciids.DB) topology.Namer {
	if db == nil {
		return nil
	}
	return db
}

func namesOf(db *pciids.DB, d *pci.Device) deviceNames {
	v, dev := db.Names(d.VendorID, d.DeviceID)
	return deviceNames{VendorName: v, DeviceName: dev}
}
