//go:build qemu

package qemutest

import (
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/hypervisor/libvirttest"
)

var (
	kvmOnce  sync.Once
	kvmProbe libvirttest.Host
)

// kvmHost is what this machine runs the suite's libvirt guests with, probed once with
// the suite's own kernel (libvirttest.ProbeKVM): KVM only where a guest kernel ran under
// it, TCG otherwise, whatever /dev/kvm's presence says. Every domain type, CPU and
// accelerator the libvirt tests use follows from it, so their outcome does not depend
// on the host having KVM.
func kvmHost(t testing.TB) libvirttest.Host {
	t.Helper()
	kernel := filepath.Join(buildDir(t), "kernel", "vmlinuz")
	kvmOnce.Do(func() {
		kvmProbe = libvirttest.Host{KVM: libvirttest.ProbeKVM(libvirttest.KVMDevice, kernel, time.Minute)}
	})
	if kvmProbe.KVM != nil {
		t.Logf("guests under TCG: KVM not proven here: %v", kvmProbe.KVM)
	} else {
		t.Logf("guests under KVM: %s booted %s", libvirttest.KVMDevice, kernel)
	}
	return kvmProbe
}
