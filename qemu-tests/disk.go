package qemutest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// NewDisk creates a raw disk image of sizeMiB with an ext4 filesystem on the whole
// device (no partition table): /dev/vda in the guest, so passage.out=/dev/vda:/passage.
// mkfs.ext4 writes the image file directly; nothing is mounted on the host.
func NewDisk(path string, sizeMiB int) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("disk %s: %w", path, err)
	}
	err = f.Truncate(int64(sizeMiB) << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("disk %s: %w", path, err)
	}
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-L", "passage", path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("disk %s: mkfs.ext4: %v: %s", path, err, out)
	}
	return nil
}

// ReadDiskFile reads one file from an ext4 disk image with debugfs (e2fsprogs), so a
// test can check what the guest left on its disk without mounting it on the host.
func ReadDiskFile(disk, path string) ([]byte, error) {
	if strings.ContainsAny(path, "\"\n") {
		return nil, fmt.Errorf("disk %s: bad path %q", disk, path)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("debugfs", "-R", fmt.Sprintf("cat \"%s\"", path), disk)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("disk %s: debugfs cat %s: %v: %s", disk, path, err, stderr.String())
	}
	// debugfs exits 0 for a missing file and says so on stderr.
	if strings.Contains(stderr.String(), "File not found") {
		return nil, fmt.Errorf("disk %s: %s: %w", disk, path, os.ErrNotExist)
	}
	return stdout.Bytes(), nil
}

// NewGPTDisk creates a raw disk image of sizeMiB with a GPT holding one partition
// (partition GUID partUUID, from 1 MiB to the end) and in it an ext4 filesystem with
// the given UUID and label, filled from the directory tree (mkfs.ext4 -d). sfdisk and
// mkfs.ext4 write image files; nothing is mounted on the host.
func NewGPTDisk(path string, sizeMiB int, partUUID, fsUUID, label, tree string) error {
	const start = 2048 // sectors: 1 MiB
	sectors := int64(sizeMiB)<<11 - start - 34
	part := path + ".part"
	defer os.Remove(part)
	for _, f := range []struct {
		name string
		size int64
	}{{path, int64(sizeMiB) << 20}, {part, sectors * 512}} {
		if err := os.WriteFile(f.name, nil, 0o644); err != nil {
			return fmt.Errorf("disk %s: %w", path, err)
		}
		if err := os.Truncate(f.name, f.size); err != nil {
			return fmt.Errorf("disk %s: %w", path, err)
		}
	}
	sf := exec.Command("sfdisk", "-q", path)
	sf.Stdin = strings.NewReader(fmt.Sprintf("label: gpt\nstart=%d, size=%d, uuid=%s\n", start, sectors, partUUID))
	if out, err := sf.CombinedOutput(); err != nil {
		return fmt.Errorf("disk %s: sfdisk: %v: %s", path, err, out)
	}
	mk := []string{"-q", "-F", "-U", fsUUID, "-L", label}
	if tree != "" {
		mk = append(mk, "-d", tree)
	}
	if out, err := exec.Command("mkfs.ext4", append(mk, part)...).CombinedOutput(); err != nil {
		return fmt.Errorf("disk %s: mkfs.ext4: %v: %s", path, err, out)
	}
	fs, err := os.ReadFile(part)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteAt(fs, start*512)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("disk %s: %w", path, err)
	}
	return nil
}
