// Package rootdev finds the real root's block device by what it is (UUID=, LABEL=,
// PARTUUID=), as initramfs-tools and the kernel's root= do, not by the name the kernel
// gave it. On a B300 node the name says nothing: nvme0 is whichever controller probed
// first, and passage rebinds passthrough NVMe during boot, so the host's disk may be
// nvme3n1 on one boot and nvme0n1 on the next.
package rootdev

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Spec is a parsed passage.root= value.
type Spec struct {
	Key   string // "UUID", "LABEL", "PARTUUID", or "" for a device path
	Value string // the identity, or the path (/dev/...)
}

func (s Spec) String() string {
	if s.Key == "" {
		return s.Value
	}
	return s.Key + "=" + s.Value
}

// Parse reads UUID=..., LABEL=..., PARTUUID=... or a /dev/ path. UUIDs compare without
// regard to case, labels exactly.
func Parse(v string) (Spec, error) {
	k, val, ok := strings.Cut(v, "=")
	if !ok {
		if !strings.HasPrefix(v, "/dev/") || len(v) == len("/dev/") {
			return Spec{}, fmt.Errorf("want UUID=, LABEL=, PARTUUID= or a block device such as /dev/vda")
		}
		return Spec{Value: v}, nil
	}
	if val == "" {
		return Spec{}, fmt.Errorf("%s= is empty", k)
	}
	switch k {
	case "UUID", "PARTUUID":
		return Spec{Key: k, Value: strings.ToLower(val)}, nil
	case "LABEL":
		return Spec{Key: k, Value: val}, nil
	}
	return Spec{}, fmt.Errorf("%s=: want UUID=, LABEL= or PARTUUID=", k)
}

// Device is one block device as Scan saw it.
type Device struct {
	Name     string // /sys/class/block/<Name>, /dev/<Name>
	FSType   string // "ext4" (ext2/3/4 share the superblock) or "xfs"; "" unknown
	UUID     string // filesystem UUID, lower case
	Label    string // filesystem label
	PartUUID string // GPT unique partition GUID, or MBR "SSSSSSSS-NN"; "" for a whole disk
	// PCI are the PCI functions the device sits below (its sysfs path's 0000:bb:dd.f
	// components, the root port first): what says it is a passthrough function's.
	PCI []string
}

// Path is the device node under root.
func (d Device) Path(root string) string { return filepath.Join(root, "dev", d.Name) }

func (d Device) matches(s Spec) bool {
	switch s.Key {
	case "UUID":
		return d.UUID != "" && d.UUID == s.Value
	case "LABEL":
		return d.Label != "" && d.Label == s.Value
	case "PARTUUID":
		return d.PartUUID != "" && d.PartUUID == s.Value
	}
	return "/dev/"+d.Name == s.Value
}

func (d Device) describe() string {
	var ids []string
	if d.FSType != "" {
		ids = append(ids, d.FSType)
	}
	if d.UUID != "" {
		ids = append(ids, "UUID="+d.UUID)
	}
	if d.Label != "" {
		ids = append(ids, "LABEL="+d.Label)
	}
	if d.PartUUID != "" {
		ids = append(ids, "PARTUUID="+d.PartUUID)
	}
	if len(ids) == 0 {
		return d.Name
	}
	return d.Name + " (" + strings.Join(ids, " ") + ")"
}

// Scan lists the block devices under root/sys/class/block and reads each one's
// filesystem superblock and, for a partition, its disk's partition table, from
// root/dev/<name>. A device that cannot be read is listed without identities.
func Scan(root string) ([]Device, error) {
	dir := filepath.Join(root, "sys", "class", "block")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("rootdev %s: %w", dir, err)
	}
	var out []Device
	for _, e := range ents {
		d := Device{Name: e.Name()}
		if f, err := os.Open(d.Path(root)); err == nil {
			d.FSType, d.UUID, d.Label = superblock(f)
			f.Close()
		}
		d.PartUUID = partUUID(root, dir, d.Name)
		if real, err := filepath.EvalSymlinks(filepath.Join(dir, d.Name)); err == nil {
			for _, c := range strings.Split(filepath.ToSlash(real), "/") {
				if pciAddr().MatchString(c) {
					d.PCI = append(d.PCI, c)
				}
			}
		}
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// superblock reads an ext2/3/4 superblock (1024 bytes in: s_magic 0xEF53 at 0x38,
// s_uuid at 0x68, s_volume_name at 0x78; the kernel's fs/ext4/ext4.h) or an XFS one
// (offset 0: "XFSB", sb_uuid at 32, sb_fname at 108; fs/xfs/libxfs/xfs_format.h).
func superblock(r io.ReaderAt) (fstype, uuid, label string) {
	b := make([]byte, 2048)
	if n, _ := r.ReadAt(b, 0); n < len(b) {
		return "", "", ""
	}
	if binary.LittleEndian.Uint16(b[1024+0x38:]) == 0xEF53 {
		return "ext4", formatUUID(b[1024+0x68 : 1024+0x78]), cString(b[1024+0x78 : 1024+0x88])
	}
	if string(b[0:4]) == "XFSB" {
		return "xfs", formatUUID(b[32:48]), cString(b[108:120])
	}
	return "", "", ""
}

func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// formatUUID prints 16 bytes in the order they are stored (filesystem UUIDs).
func formatUUID(b []byte) string {
	if bytes.Equal(b, make([]byte, 16)) {
		return ""
	}
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// formatGUID prints a GPT GUID: its first three fields are little-endian (UEFI spec,
// appendix A).
func formatGUID(b []byte) string {
	return fmt.Sprintf("%08x-%04x-%04x-%x-%x", binary.LittleEndian.Uint32(b[0:4]),
		binary.LittleEndian.Uint16(b[4:6]), binary.LittleEndian.Uint16(b[6:8]), b[8:10], b[10:16])
}

// partUUID is the PARTUUID of partition name (sysfs holds its number in "partition"
// and sits in its disk's directory), read from the disk's GPT, or from its MBR as
// "<disk signature>-<number>" as the kernel's root=PARTUUID= does (block/partitions).
func partUUID(root, classDir, name string) string {
	num, err := os.ReadFile(filepath.Join(classDir, name, "partition"))
	if err != nil {
		return ""
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(num)))
	if err != nil || n < 1 {
		return ""
	}
	real, err := filepath.EvalSymlinks(filepath.Join(classDir, name))
	if err != nil {
		return ""
	}
	disk := filepath.Base(filepath.Dir(real))
	f, err := os.Open(filepath.Join(root, "dev", disk))
	if err != nil {
		return ""
	}
	defer f.Close()
	sector := int64(512)
	if b, err := os.ReadFile(filepath.Join(classDir, disk, "queue", "logical_block_size")); err == nil {
		if s, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && s >= 512 && s <= 4096 {
			sector = s
		}
	}
	return gptPartUUID(f, sector, n)
}

func gptPartUUID(r io.ReaderAt, sector int64, n int) string {
	if n < 1 {
		return ""
	}
	mbr := make([]byte, 512)
	if _, err := r.ReadAt(mbr, 0); err != nil || mbr[510] != 0x55 || mbr[511] != 0xAA {
		return ""
	}
	hdr := make([]byte, 92)
	if _, err := r.ReadAt(hdr, sector); err == nil && string(hdr[0:8]) == "EFI PART" {
		entries := int64(binary.LittleEndian.Uint64(hdr[72:80]))
		count := binary.LittleEndian.Uint32(hdr[80:84])
		size := int64(binary.LittleEndian.Uint32(hdr[84:88]))
		if uint32(n) > count || size < 128 || size > 4096 {
			return ""
		}
		e := make([]byte, 32)
		if _, err := r.ReadAt(e, entries*sector+int64(n-1)*size); err != nil {
			return ""
		}
		if bytes.Equal(e[0:16], make([]byte, 16)) { // unused entry
			return ""
		}
		return formatGUID(e[16:32])
	}
	sig := binary.LittleEndian.Uint32(mbr[440:444])
	if sig == 0 || n > 4 {
		return ""
	}
	return fmt.Sprintf("%08x-%02x", sig, n)
}

// pciAddr is compiled on first use: every passage process links this package, and only
// the boot's root search reads sysfs block-device paths.
var pciAddr = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)
})

// under says the device sits below one of the PCI functions in not.
func (d Device) under(not map[string]bool) string {
	for _, a := range d.PCI {
		if not[a] {
			return a
		}
	}
	return ""
}

// Find returns the one device matching s. No match and several matches are errors that
// list what was seen: two disks with one filesystem UUID (a cloned image) must not be
// guessed between. A device below one of the PCI functions in notRoot (passthrough
// functions: a tenant's disk, whatever identity the tenant wrote on it) is never a
// candidate; the error names it when it would have matched.
func Find(devs []Device, s Spec, notRoot []string) (Device, error) {
	not := map[string]bool{}
	for _, a := range notRoot {
		not[strings.ToLower(a)] = true
	}
	var hits []Device
	var passthrough []string
	for _, d := range devs {
		if !d.matches(s) {
			continue
		}
		if a := d.under(not); a != "" {
			passthrough = append(passthrough, d.describe()+" below passthrough function "+a)
			continue
		}
		hits = append(hits, d)
	}
	if len(hits) == 0 && len(passthrough) > 0 {
		return Device{}, fmt.Errorf("root %s: %w (not a candidate: %s); block devices: %s", s, ErrNotFound, strings.Join(passthrough, ", "), list(devs))
	}
	switch len(hits) {
	case 1:
		return hits[0], nil
	case 0:
		return Device{}, fmt.Errorf("root %s: %w; block devices: %s", s, ErrNotFound, list(devs))
	}
	return Device{}, fmt.Errorf("root %s: %d devices match, refusing to guess: %s", s, len(hits), list(hits))
}

// ErrNotFound says no block device matched (yet).
var ErrNotFound = errors.New("no such block device")

func list(devs []Device) string {
	if len(devs) == 0 {
		return "none"
	}
	var s []string
	for _, d := range devs {
		s = append(s, d.describe())
	}
	return strings.Join(s, ", ")
}

// Poll is how often Wait scans again.
const Poll = 100 * time.Millisecond

// Wait scans until exactly one device under root matches s, none below a function of
// notRoot (Find), and returns its node (under root), or fails when ctx ends, naming what it waited for and what it saw. A disk's
// driver may still be probing when the handoff starts (the host drivers load late, after
// vfio binding), so a missing device is waited for; an ambiguous one is not.
func Wait(ctx context.Context, root string, s Spec, notRoot []string) (string, error) {
	start := time.Now()
	t := time.NewTicker(Poll)
	defer t.Stop()
	for {
		devs, err := Scan(root)
		if err == nil {
			d, ferr := Find(devs, s, notRoot)
			if ferr == nil {
				return d.Path(root), nil
			}
			if !errors.Is(ferr, ErrNotFound) {
				return "", ferr
			}
			err = ferr
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("waiting for the root block device %s, %s: %w (%v)", s, time.Since(start).Round(time.Millisecond), ctx.Err(), err)
		case <-t.C:
		}
	}
}
