package libvirttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Host is what this machine runs a test's guests with: KVM when a probe proved that KVM
// runs one here, TCG otherwise. Every choice a test makes that depends on it (the
// domain type it defines, the CPU libvirt's command line may ask for, the accelerator
// QEMU starts with) comes from one Host, so a test's outcome and what it compares with
// a golden file do not depend on whether the host has a /dev/kvm.
type Host struct {
	// KVM is nil when KVM was proven to run a guest here; otherwise why not.
	KVM error
}

// TCG is the host of a test that starts no guest of its own and so proves nothing of
// KVM: every domain it defines is judged as type qemu.
var TCG = Host{KVM: errors.New("not probed: the test starts no guest to prove KVM with")}

// KVMDevice is the device the probe opens.
const KVMDevice = "/dev/kvm"

// KVM ioctls (include/uapi/linux/kvm.h).
const (
	kvmGetAPIVersion = 0xAE00 // _IO(KVMIO, 0x00)
	kvmCreateVM      = 0xAE01 // _IO(KVMIO, 0x01)
	kvmAPIVersion    = 12
)

// ProbeKVM says whether KVM runs a guest on this machine: nil when it does. A /dev/kvm
// that exists proves nothing (a machine of this project's kind has one whose guests stop
// with "KVM internal error" once the kernel runs), and neither does a VM the kernel
// creates, so the probe has three steps, each cheaper than the next:
//   - dev opens read-write and answers KVM_GET_API_VERSION with 12;
//   - KVM_CREATE_VM succeeds;
//   - QEMU under KVM (`-accel kvm -cpu host`) boots kernel, a Linux kernel image, to its
//     own panic for want of a root (its last words: "Kernel panic - not syncing"), within
//     timeout. A kernel is what every guest of the QEMU suite runs.
//
// With kernel empty the last step cannot be taken, and the probe says so: KVM is then not
// proven.
func ProbeKVM(dev, kernel string, timeout time.Duration) error {
	fd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", dev, err)
	}
	defer unix.Close(fd)
	v, err := unix.IoctlRetInt(fd, kvmGetAPIVersion)
	if err != nil {
		return fmt.Errorf("%s: KVM_GET_API_VERSION: %w", dev, err)
	}
	if v != kvmAPIVersion {
		return fmt.Errorf("%s: KVM API version %d, want %d", dev, v, kvmAPIVersion)
	}
	vm, err := unix.IoctlRetInt(fd, kvmCreateVM)
	if err != nil {
		return fmt.Errorf("%s: KVM_CREATE_VM: %w", dev, err)
	}
	unix.Close(vm)
	if kernel == "" {
		return fmt.Errorf("%s creates a VM, but no guest kernel was given to boot under KVM", dev)
	}
	return bootUnderKVM(kernel, timeout)
}

// bootUnderKVM boots kernel with no initramfs and no disk under QEMU with KVM: a kernel
// that runs reaches its panic ("VFS: Unable to mount root fs") in seconds, and with
// panic=-1 and -no-reboot QEMU then exits. QEMU reports a guest KVM cannot run as
// "KVM internal error" or "emulation failure" and stops the guest without exiting, so
// those end the probe at once.
func bootUnderKVM(kernel string, timeout time.Duration) error {
	if _, err := os.Stat(kernel); err != nil {
		return fmt.Errorf("guest kernel: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", "-accel", "kvm", "-cpu", "host", "-machine", "q35",
		"-m", "256", "-nodefaults", "-display", "none", "-no-reboot", "-serial", "stdio",
		"-kernel", kernel, "-append", "console=ttyS0 panic=-1 loglevel=4")
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("qemu-system-x86_64 -accel kvm: %w", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			s := out.String()
			if strings.Contains(s, "Kernel panic - not syncing") {
				return nil
			}
			return fmt.Errorf("qemu-system-x86_64 -accel kvm -cpu host: %v before the kernel's panic: %s", err, lastLines(s, 3))
		case <-tick.C:
			s := out.String()
			for _, bad := range []string{"KVM internal error", "emulation failure"} {
				if strings.Contains(s, bad) {
					cmd.Process.Kill()
					<-done
					return fmt.Errorf("qemu-system-x86_64 -accel kvm -cpu host: %q booting %s", bad, kernel)
				}
			}
		}
	}
}

// DomainType is the type a test defines a domain asked as typ with: kvm only where KVM
// was proven.
func (h Host) DomainType(typ string) string {
	if typ == "kvm" && h.KVM != nil {
		return "qemu"
	}
	return typ
}

// Accel is QEMU's -accel for a guest of a domain of type typ on this host: KVM's guests
// (libvirt gives them `-cpu host`, which TCG refuses) only where KVM was proven.
func (h Host) Accel(typ string) string {
	if h.DomainType(typ) == "kvm" {
		return "kvm"
	}
	return "tcg,thread=single"
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// lockedBuffer is QEMU's output, read while QEMU writes it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
