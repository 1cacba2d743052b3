package rootdev

import (
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func ext4(uuid [16]byte, label string) []byte {
	b := make([]byte, 4096)
	binary.LittleEndian.PutUint16(b[1024+0x38:], 0xEF53)
	copy(b[1024+0x68:], uuid[:])
	copy(b[1024+0x78:1024+0x88], label)
	return b
}

// gptDisk is a disk with a protective MBR, a GPT header at LBA 1 and entries at LBA 2,
// partition n (1-based) holding guid.
func gptDisk(n int, guid [16]byte) []byte {
	b := make([]byte, 64<<10)
	b[510], b[511] = 0x55, 0xAA
	copy(b[512:], "EFI PART")
	binary.LittleEndian.PutUint64(b[512+72:], 2)
	binary.LittleEndian.PutUint32(b[512+80:], 128)
	binary.LittleEndian.PutUint32(b[512+84:], 128)
	e := 1024 + (n-1)*128
	b[e] = 0xAF // a nonzero type GUID: the entry is used
	copy(b[e+16:], guid[:])
	return b
}

func mbrDisk(sig uint32) []byte {
	b := make([]byte, 4096)
	b[510], b[511] = 0x55, 0xAA
	binary.LittleEndian.PutUint32(b[440:], sig)
	return b
}

type node struct {
	sysPath string // under sys/devices
	part    int    // partition number, 0 for a disk
	data    []byte // /dev/<name>
}

func tree(t *testing.T, nodes map[string]node) string {
	t.Helper()
	root := t.TempDir()
	class := filepath.Join(root, "sys", "class", "block")
	os.MkdirAll(class, 0o755)
	os.MkdirAll(filepath.Join(root, "dev"), 0o755)
	for name, n := range nodes {
		dir := filepath.Join(root, "sys", "devices", n.sysPath)
		os.MkdirAll(dir, 0o755)
		if n.part > 0 {
			os.WriteFile(filepath.Join(dir, "partition"), []byte(strconv.Itoa(n.part)+"\n"), 0o644)
		}
		rel, _ := filepath.Rel(class, dir)
		if err := os.Symlink(rel, filepath.Join(class, name)); err != nil {
			t.Fatal(err)
		}
		if n.data != nil {
			os.WriteFile(filepath.Join(root, "dev", name), n.data, 0o644)
		}
	}
	return root
}

var (
	rootUUID = [16]byte{0x9e, 0x2c, 0x1b, 0x3f, 0x44, 0x5d, 0x4e, 0x6f, 0x80, 0x91, 0xa2, 0xb3, 0xc4, 0xd5, 0xe6, 0xf7}
	partGUID = [16]byte{0x78, 0x56, 0x34, 0x12, 0xbc, 0x9a, 0xf0, 0xde, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88}
	decoy    = [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
)

// A node with three NVMe namespaces: the root is a GPT partition on the disk that
// probed second; nvme0n1 holds another filesystem. Identities find the root whatever
// the names are.
func node3() map[string]node {
	return map[string]node{
		"nvme0n1":   {sysPath: "pci0000:00/0000:00:12.0/nvme/nvme0/nvme0n1", data: ext4(decoy, "scratch")},
		"nvme1n1":   {sysPath: "pci0000:00/0000:00:11.0/nvme/nvme1/nvme1n1", data: gptDisk(2, partGUID)},
		"nvme1n1p2": {sysPath: "pci0000:00/0000:00:11.0/nvme/nvme1/nvme1n1/nvme1n1p2", part: 2, data: ext4(rootUUID, "root")},
		"vda":       {sysPath: "pci0000:00/0000:00:10.0/virtio3/block/vda", data: mbrDisk(0xdeadbeef)},
		"vda1":      {sysPath: "pci0000:00/0000:00:10.0/virtio3/block/vda/vda1", part: 1, data: ext4(decoy, "")},
		"loop0":     {sysPath: "virtual/block/loop0"}, // no node in /dev: listed, no identity
	}
}

func TestFind(t *testing.T) {
	root := tree(t, node3())
	devs, err := Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	for spec, want := range map[string]string{
		"UUID=9e2c1b3f-445d-4e6f-8091-a2b3c4d5e6f7": "nvme1n1p2",
		"UUID=9E2C1B3F-445D-4E6F-8091-A2B3C4D5E6F7": "nvme1n1p2",
		"LABEL=root": "nvme1n1p2",
		"PARTUUID=12345678-9abc-def0-1122-334455667788": "nvme1n1p2",
		"PARTUUID=deadbeef-01":                          "vda1",
		"LABEL=scratch":                                 "nvme0n1",
		"/dev/nvme0n1":                                  "nvme0n1",
	} {
		s, err := Parse(spec)
		if err != nil {
			t.Fatalf("Parse(%q): %v", spec, err)
		}
		d, err := Find(devs, s, nil)
		if err != nil || d.Name != want {
			t.Errorf("Find(%s) = %s, %v; want %s", spec, d.Name, err, want)
		}
	}
	// Two filesystems with one UUID (nvme0n1 and vda1): refused, both named.
	s, _ := Parse("UUID=01020304-0506-0708-090a-0b0c0d0e0f10")
	if _, err := Find(devs, s, nil); err == nil || !strings.Contains(err.Error(), "2 devices match") ||
		!strings.Contains(err.Error(), "nvme0n1") || !strings.Contains(err.Error(), "vda1") {
		t.Errorf("duplicate UUID: %v", err)
	}
	s, _ = Parse("LABEL=nope")
	if _, err := Find(devs, s, nil); err == nil || !strings.Contains(err.Error(), "nvme1n1p2 (ext4 UUID=9e2c1b3f-445d-4e6f-8091-a2b3c4d5e6f7 LABEL=root PARTUUID=12345678-9abc-def0-1122-334455667788)") {
		t.Errorf("missing label: %v, want the devices seen listed", err)
	}
}

func TestParse(t *testing.T) {
	for _, bad := range []string{"", "/dev/", "sda1", "UUID=", "PARTLABEL=x", "uuid=abc"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) accepted", bad)
		}
	}
}

// Wait returns as soon as the device appears, and at its deadline names what it waited
// for and what it saw.
func TestWait(t *testing.T) {
	nodes := node3()
	late := nodes["nvme1n1p2"]
	delete(nodes, "nvme1n1p2")
	root := tree(t, nodes)
	s, _ := Parse("LABEL=root")

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := Wait(ctx, root, s, nil)
	if err == nil || !strings.Contains(err.Error(), "waiting for the root block device LABEL=root") || !strings.Contains(err.Error(), "nvme0n1 (ext4") {
		t.Fatalf("absent root: %v", err)
	}

	go func() {
		time.Sleep(150 * time.Millisecond)
		dir := filepath.Join(root, "sys", "devices", late.sysPath)
		os.MkdirAll(dir, 0o755)
		os.WriteFile(filepath.Join(dir, "partition"), []byte("2\n"), 0o644)
		os.WriteFile(filepath.Join(root, "dev", "nvme1n1p2"), late.data, 0o644)
		rel, _ := filepath.Rel(filepath.Join(root, "sys", "class", "block"), dir)
		os.Symlink(rel, filepath.Join(root, "sys", "class", "block", "nvme1n1p2"))
	}()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	p, err := Wait(ctx2, root, s, nil)
	if err != nil || p != filepath.Join(root, "dev", "nvme1n1p2") {
		t.Errorf("late root: %q, %v", p, err)
	}
}

// The identities Scan reads are the ones the real tools write and read: sfdisk makes a
// GPT with a chosen partition UUID, mkfs.ext4 a filesystem with a chosen UUID and label
// inside that partition, and blkid (util-linux) reads them back the same way.
func TestScanAgreesWithBlkid(t *testing.T) {
	for _, tool := range []string{"sfdisk", "mkfs.ext4", "blkid"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s: %v (image/deps.sh installs it)", tool, err)
		}
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Truncate(img, 16<<20)
	const partUUIDWant = "6b1f0c8e-2d44-4b7a-9a31-5c0e8f2d7a19"
	const uuidWant = "c0ffee00-1234-4cde-8f00-abcdef012345"
	layout := "label: gpt\nstart=2048, size=28672, uuid=" + partUUIDWant + "\n"
	cmd := exec.Command("sfdisk", "-q", img)
	cmd.Stdin = strings.NewReader(layout)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sfdisk: %v: %s", err, out)
	}
	// The partition's bytes as their own file: what /dev/<disk>p1 reads.
	part := filepath.Join(dir, "part.img")
	os.WriteFile(part, nil, 0o644)
	os.Truncate(part, 28672*512)
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-L", "passage-root", "-U", uuidWant, part).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	blk, err := exec.Command("blkid", "-p", "-o", "export", part).Output()
	if err != nil {
		t.Fatalf("blkid: %v", err)
	}
	disk, _ := os.ReadFile(img)
	pdata, _ := os.ReadFile(part)
	root := tree(t, map[string]node{
		"nvme3n1":   {sysPath: "pci/nvme3/nvme3n1", data: disk},
		"nvme3n1p1": {sysPath: "pci/nvme3/nvme3n1/nvme3n1p1", part: 1, data: pdata},
	})
	devs, err := Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	var got Device
	for _, d := range devs {
		if d.Name == "nvme3n1p1" {
			got = d
		}
	}
	for _, want := range []string{"UUID=" + got.UUID, "LABEL=" + got.Label, "TYPE=ext4"} {
		if !strings.Contains(string(blk), want+"\n") {
			t.Errorf("blkid says\n%s\nScan says %s", blk, want)
		}
	}
	if got.UUID != uuidWant || got.Label != "passage-root" || got.PartUUID != partUUIDWant {
		t.Errorf("Scan: %+v, want UUID %s LABEL passage-root PARTUUID %s", got, uuidWant, partUUIDWant)
	}
}
