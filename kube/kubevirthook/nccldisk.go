package kubevirthook

import (
	"bytes"
	"fmt"

	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/topology"
)

// The guest's NCCL topology file reaches the guest as a read-only SATA CD-ROM whose
// contents are the file itself (README.md, "The guest's switch"): of what
// virt-launcher keeps of a domain (api.DomainSpec), a <disk> is the one way to hand the
// guest bytes — DomainSpec has no fw_cfg and no SMBIOS OEM strings, its SMBIOS entries
// are short fixed fields — and a SATA drive sits on q35's built-in AHCI at 00:1f.2, so it
// adds no PCI device and changes no guest bus number the NCCL file names.
const (
	// NCCLDiskAlias marks the hook's disk, to be replaced at each call.
	NCCLDiskAlias = topology.AliasPrefix + "nccl"
	// NCCLDiskSerial is the drive's serial: udev names it
	// /dev/disk/by-id/ata-QEMU_DVD-ROM_passage-nccl in the guest.
	NCCLDiskSerial = "passage-nccl"
	// NCCLDiskSector is the CD-ROM's block size: the image is a whole number of them.
	NCCLDiskSector = 2048
	// MaxNCCLDisk bounds the image: eight units' NCCL files are under 16 KiB.
	MaxNCCLDisk = 1 << 20
)

// NCCLImage is the disk image for nccl: the file padded with newlines to a whole
// sector, so the device read whole is still the same XML document (whitespace after the
// root element) and the guest can point NCCL_TOPO_FILE at a copy of it as it is.
func NCCLImage(nccl []byte) ([]byte, error) {
	n := (len(nccl) + NCCLDiskSector) / NCCLDiskSector * NCCLDiskSector
	if n > MaxNCCLDisk {
		return nil, fmt.Errorf("nccl topology file: %d bytes, over the disk's %d", len(nccl), MaxNCCLDisk)
	}
	return append(bytes.Clone(nccl), bytes.Repeat([]byte{'\n'}, n-len(nccl))...), nil
}

// attachNCCLDisk replaces the hook's disk of an earlier call with one on image (the path
// QEMU opens, in virt-launcher's compute container), on the first free sdX target.
func attachNCCLDisk(devs *libvirtxml.DomainDeviceList, image string) error {
	var keep []libvirtxml.DomainDisk
	used := map[string]bool{}
	for _, d := range devs.Disks {
		if d.Alias != nil && d.Alias.Name == NCCLDiskAlias {
			continue
		}
		if d.Target != nil {
			used[d.Target.Dev] = true
		}
		keep = append(keep, d)
	}
	dev := ""
	for c := 'a'; c <= 'z'; c++ {
		if !used["sd"+string(c)] {
			dev = "sd" + string(c)
			break
		}
	}
	if dev == "" {
		return fmt.Errorf("nccl disk %s: no free sata target among sda-sdz", image)
	}
	devs.Disks = append(keep, libvirtxml.DomainDisk{
		Device:   "cdrom",
		Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
		Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: image}},
		Target:   &libvirtxml.DomainDiskTarget{Dev: dev, Bus: "sata"},
		ReadOnly: &libvirtxml.DomainDiskReadOnly{},
		Serial:   NCCLDiskSerial,
		Alias:    &libvirtxml.DomainAlias{Name: NCCLDiskAlias},
	})
	return nil
}
