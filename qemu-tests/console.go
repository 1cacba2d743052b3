// Package qemutest boots the real initramfs on Debian's kernel under QEMU (TCG) with a
// vIOMMU, B300-shaped emulated PCIe switches and a swtpm TPM, and reads back what the
// guest reports over the serial console (the protocol the boot stage implements:
// file blocks, PASSAGE-DONE, PASSAGE-T timeline markers; initramfs/emit writes and
// decodes it).
package qemutest

import "github.com/passage-boot/passage/initramfs/emit"

// Report is what the guest said on its console, as emit's decoder read it live.
type Report = emit.Report
