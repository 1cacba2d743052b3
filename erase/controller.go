package erase

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Command is one admin command as the passthrough ioctl takes it.
type Command struct {
	Opcode uint8
	NSID   uint32
	CDW10  uint32
	CDW11  uint32
	CDW12  uint32
	CDW13  uint32
	CDW14  uint32
	CDW15  uint32
}

// Controller is the NVMe admin path erasing needs, at the ioctl boundary: the kernel's
// nvme driver on a node (Device), a simulated controller in tests (erasetest).
type Controller interface {
	// Admin submits one admin command; buf, when not nil, receives the data the command
	// returns. A completion with a non-zero status is a *StatusError; anything else (the
	// device gone, the ioctl refused) is returned as the kernel said it.
	Admin(ctx context.Context, cmd Command, buf []byte) error
	// Read reads len(buf)/blockSize logical blocks of namespace nsid starting at lba,
	// around any cache.
	Read(ctx context.Context, nsid uint32, lba uint64, blockSize int, buf []byte) error
	Close() error
}

// nvmePassthruCmd is struct nvme_passthru_cmd (include/uapi/linux/nvme_ioctl.h).
type nvmePassthruCmd struct {
	Opcode      uint8
	Flags       uint8
	Rsvd1       uint16
	NSID        uint32
	CDW2        uint32
	CDW3        uint32
	Metadata    uint64
	Addr        uint64
	MetadataLen uint32
	DataLen     uint32
	CDW10       uint32
	CDW11       uint32
	CDW12       uint32
	CDW13       uint32
	CDW14       uint32
	CDW15       uint32
	TimeoutMS   uint32
	Result      uint32
}

// nvmeIoctlAdminCmd is NVME_IOCTL_ADMIN_CMD: _IOWR('N', 0x41, struct nvme_passthru_cmd).
var nvmeIoctlAdminCmd = uintptr(3<<30 | uint32(unsafe.Sizeof(nvmePassthruCmd{}))<<16 | 'N'<<8 | 0x41)

// maxCommandTimeout bounds one admin command in the kernel when ctx has no deadline.
const maxCommandTimeout = 10 * time.Minute

// Device is a controller through the kernel's nvme driver: admin commands on its
// character device (/dev/nvmeN), reads with O_DIRECT from its namespaces' block devices.
type Device struct {
	f *os.File
	// Namespaces maps an NSID to the block device that reads it (/dev/nvmeNnM).
	Namespaces map[uint32]string
	// blockDev finds a namespace's block device not in Namespaces.
	blockDev func(ctx context.Context, nsid uint32) (string, error)
}

// OpenDevice opens the controller's character device.
func OpenDevice(char string, namespaces map[uint32]string) (*Device, error) {
	f, err := os.OpenFile(char, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	return &Device{f: f, Namespaces: namespaces}, nil
}

func (d *Device) Close() error { return d.f.Close() }

func (d *Device) Admin(ctx context.Context, c Command, buf []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	timeout := maxCommandTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(dl))
	}
	if timeout < time.Millisecond {
		return context.DeadlineExceeded
	}
	p := nvmePassthruCmd{Opcode: c.Opcode, NSID: c.NSID, CDW10: c.CDW10, CDW11: c.CDW11, CDW12: c.CDW12,
		CDW13: c.CDW13, CDW14: c.CDW14, CDW15: c.CDW15, TimeoutMS: uint32(timeout / time.Millisecond)}
	if len(buf) > 0 {
		p.Addr = uint64(uintptr(unsafe.Pointer(&buf[0])))
		p.DataLen = uint32(len(buf))
	}
	conn, err := d.f.SyscallConn()
	if err != nil {
		return err
	}
	var r uintptr
	var errno unix.Errno
	if cerr := conn.Control(func(fd uintptr) {
		r, _, errno = unix.Syscall(unix.SYS_IOCTL, fd, nvmeIoctlAdminCmd, uintptr(unsafe.Pointer(&p)))
	}); cerr != nil {
		return cerr
	}
	runtime.KeepAlive(buf)
	if errno != 0 {
		return fmt.Errorf("%s: %s: %w", opName(c.Opcode), d.f.Name(), errno)
	}
	if r != 0 {
		return &StatusError{Opcode: c.Opcode, Status: Status(r)}
	}
	return nil
}

func (d *Device) Read(ctx context.Context, nsid uint32, lba uint64, blockSize int, buf []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	dev, ok := d.Namespaces[nsid]
	if !ok && d.blockDev != nil {
		var err error
		if dev, err = d.blockDev(ctx, nsid); err != nil {
			return err
		}
		d.Namespaces[nsid] = dev
	} else if !ok {
		return fmt.Errorf("namespace %d: no block device", nsid)
	}
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// O_DIRECT wants the buffer aligned to the logical block size.
	al := alignedBuf(len(buf), blockSize)
	n, err := f.ReadAt(al, int64(lba)*int64(blockSize))
	if err != nil {
		return fmt.Errorf("%s: read lba %d: %w", dev, lba, err)
	}
	if n != len(buf) {
		return fmt.Errorf("%s: read lba %d: %d bytes, want %d", dev, lba, n, len(buf))
	}
	copy(buf, al)
	return nil
}

func alignedBuf(n, align int) []byte {
	if align <= 0 {
		align = 4096
	}
	b := make([]byte, n+align)
	off := 0
	if r := int(uintptr(unsafe.Pointer(&b[0])) % uintptr(align)); r != 0 {
		off = align - r
	}
	return b[off : off+n]
}

// Gone says the error means the device is no longer there to answer: removed, or its
// driver let go of it mid-command.
func Gone(err error) bool {
	return errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO) || errors.Is(err, os.ErrNotExist)
}
