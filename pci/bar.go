package pci

import (
	"fmt"
	"strconv"
	"strings"
)

// Base Address Registers (PCI Local Bus 3.0 6.2.5.1; PCI_BASE_ADDRESS_* in the kernel's
// include/uapi/linux/pci_regs.h).
const (
	ConfigBAR0 = 0x10

	barSpaceIO    = 0x01 // PCI_BASE_ADDRESS_SPACE_IO
	barMemType    = 0x06 // PCI_BASE_ADDRESS_MEM_TYPE_MASK
	barMemType64  = 0x04 // PCI_BASE_ADDRESS_MEM_TYPE_64
	barMemPrefetc = 0x08 // PCI_BASE_ADDRESS_MEM_PREFETCH

	// The flags the kernel writes in the third column of sysfs "resource"
	// (include/linux/ioport.h).
	ioresourceIO       = 0x00000100
	ioresourceMem      = 0x00000200
	ioresourcePrefetch = 0x00002000
	ioresourceMem64    = 0x00100000
)

// BAR is one Base Address Register of a function, in lspci's terms: "Region 2: Memory at
// ... (64-bit, prefetchable) [size=512G]".
type BAR struct {
	Index    int    // the register, 0..5 (0..1 on a bridge); a 64-bit BAR also takes Index+1
	IO       bool   // I/O space (bit 0); else memory
	Is64     bool   // memory type 64-bit (bits 2:1 = 10b)
	Prefetch bool   // prefetchable memory (bit 3)
	Base     uint64 // where it is mapped: the resource's start, or the register's address in a dump; 0 when unassigned
	// Size is end - start + 1 of line Index of <bdf>/resource: the kernel sized the BAR
	// when it enumerated the function (__pci_read_base). 0 when the input cannot say: an
	// lspci dump holds config space, where a size is found only by writing all ones.
	Size uint64
}

// Kind is lspci's description: "Memory (64-bit, prefetchable)", "I/O ports".
func (b BAR) Kind() string {
	if b.IO {
		return "I/O ports"
	}
	w, p := "32-bit", "non-"
	if b.Is64 {
		w = "64-bit"
	}
	if b.Prefetch {
		p = ""
	}
	return fmt.Sprintf("Memory (%s, %sprefetchable)", w, p)
}

// barCount is how many BARs a header type has: six in a type 0 header, two in a type 1
// (PCI-PCI bridge) header, none in CardBus's.
func barCount(headerType uint8) int {
	switch headerType {
	case HeaderTypeNormal:
		return 6
	case HeaderTypeBridge:
		return 2
	}
	return 0
}

// decodeBARs reads the BAR registers' flags and addresses from config space, as lspci
// does (show_bases in lspci.c): a register reading 0 or all ones holds no BAR, and a
// 64-bit BAR's upper half is the next register. Sizes come from sysfs (setResources).
func (d *Device) decodeBARs() {
	d.BARs = nil
	n := barCount(d.HeaderType)
	c := d.Config
	for i := 0; i < n; i++ {
		v, ok := c.U32(ConfigBAR0 + 4*i)
		if !ok || v == 0 || v == 0xffffffff {
			continue
		}
		b := BAR{Index: i}
		if v&barSpaceIO != 0 {
			b.IO = true
			b.Base = uint64(v &^ 0x3)
		} else {
			b.Prefetch = v&barMemPrefetc != 0
			b.Base = uint64(v &^ 0xf)
			if v&barMemType == barMemType64 {
				b.Is64 = true
				if hi, ok := c.U32(ConfigBAR0 + 4*(i+1)); ok && i+1 < n {
					b.Base |= uint64(hi) << 32
				}
				i++
			}
		}
		d.BARs = append(d.BARs, b)
	}
}

// setResources takes the sizes and assigned addresses from sysfs "resource": one line per
// resource, "0x%016llx 0x%016llx 0x%016llx" start, end, flags (resource_show in
// drivers/pci/pci-sysfs.c); lines 0..5 are the BARs. A BAR config space did not show (a
// VF's registers read 0: its BARs are in the PF's SR-IOV capability) is taken from the
// resource flags. Malformed input is a problem naming the line; nothing read is dropped.
func (d *Device) setResources(text string) {
	n := barCount(d.HeaderType)
	byIndex := map[int]int{}
	for i, b := range d.BARs {
		byIndex[b.Index] = i
	}
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	skip := -1
	for i := 0; i < n && i < len(lines); i++ {
		f := strings.Fields(lines[i])
		if len(f) != 3 {
			d.problem("resource: line %d: %q is not start, end and flags", i+1, lines[i])
			return
		}
		var v [3]uint64
		for k := range f {
			x, err := strconv.ParseUint(strings.TrimPrefix(f[k], "0x"), 16, 64)
			if err != nil || !strings.HasPrefix(f[k], "0x") {
				d.problem("resource: line %d: %q is not a hex number", i+1, f[k])
				return
			}
			v[k] = x
		}
		start, end, flags := v[0], v[1], v[2]
		if i == skip || flags == 0 && start == 0 && end == 0 {
			continue
		}
		if end < start {
			d.problem("resource: line %d: end 0x%x below start 0x%x", i+1, end, start)
			continue
		}
		size := end - start + 1
		if size == 0 {
			d.problem("resource: line %d: 0x%x-0x%x spans the whole address space", i+1, start, end)
			continue
		}
		k, ok := byIndex[i]
		if !ok {
			b := BAR{Index: i, IO: flags&ioresourceIO != 0, Prefetch: flags&ioresourcePrefetch != 0, Is64: flags&ioresourceMem64 != 0}
			if flags&(ioresourceIO|ioresourceMem) == 0 {
				continue
			}
			d.BARs = append(d.BARs, b)
			k = len(d.BARs) - 1
			byIndex[i] = k
		}
		b := &d.BARs[k]
		b.Base, b.Size = start, size
		if b.Is64 {
			skip = i + 1
		}
	}
	sortBARs(d.BARs)
}

func sortBARs(bs []BAR) {
	for i := 1; i < len(bs); i++ {
		for j := i; j > 0 && bs[j].Index < bs[j-1].Index; j-- {
			bs[j], bs[j-1] = bs[j-1], bs[j]
		}
	}
}
