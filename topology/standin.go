package topology

import "fmt"

// EmulatedDevice is a QEMUDevice for machines without the host's devices (tests, the
// qemu-tests guest-plan round trip): each passthrough function becomes an emulated
// device of its kind on the same port, the stand-ins the `qemu` and `qemu-guest`
// profiles label by QEMU ID and position. QEMU cannot give emulated devices NVIDIA or
// Mellanox IDs, only vfio-pci can.
//
//	gpu         virtio-gpu-pci (1af4:1050, display class)
//	gpu-nic     virtio-net-pci (1af4:1041), ATS on
//	data-direct virtio-net-pci (1af4:1041), as its PF
//	gpu-nvme    nvme (1b36:0010), serial = the function's id
//
// romfile= is empty so firmware runs no option ROM (iPXE) per NIC, and the NICs have no
// netdev: nothing in the guest sends on them.
func EmulatedDevice(f GuestFunction, bus string) string {
	switch f.Role {
	case RoleGPU:
		return fmt.Sprintf("virtio-gpu-pci,id=%s,bus=%s,addr=0x0,ats=on,iommu_platform=on,disable-legacy=on", f.ID, bus)
	case RoleGPUNVMe:
		return fmt.Sprintf("nvme,id=%s,bus=%s,addr=0x0,serial=%s", f.ID, bus, f.ID)
	}
	return fmt.Sprintf("virtio-net-pci,id=%s,bus=%s,addr=0x0,ats=on,iommu_platform=on,disable-legacy=on,romfile=", f.ID, bus)
}
