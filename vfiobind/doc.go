// Package vfiobind hands passthrough functions to vfio-pci, one BDF at a time, and only
// whole units whose IOMMU groups hold nothing else: a group is the smallest set the
// IOMMU can isolate, so binding part of one (or sharing one with a host-kept device)
// would let a guest's DMA reach the host or another guest.
//
// Which functions pass through is topology's decision; this package checks that the
// decision is safe (Audit), loads the vfio stack (ModuleLoader), binds through
// driver_override and drivers_probe (never vfio-pci.ids=: the same PCI ID can be a
// management NIC), verifies the result, and returns a failed unit to where it was.
// Every sysfs access goes through Sysfs, rooted at "/" on a node and at a synthetic
// tree in tests (see vfiotest).
package vfiobind
