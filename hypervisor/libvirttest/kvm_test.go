package libvirttest

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"
)

// The decision both ways: KVM proven, a kvm domain stays kvm and starts under KVM;
// not proven, it is defined as qemu and starts under TCG. A qemu domain is TCG's either way.
func TestHostDecision(t *testing.T) {
	kvm := Host{}
	noKVM := Host{KVM: errors.New("KVM internal error")}
	for _, c := range []struct {
		name        string
		h           Host
		typ         string
		wantType    string
		wantAccel   string
		wantCPUMode string
	}{
		{"kvm proven", kvm, "kvm", "kvm", "kvm", "host-passthrough"},
		{"kvm not proven", noKVM, "kvm", "qemu", "tcg,thread=single", "maximum"},
		{"qemu, kvm proven", kvm, "qemu", "qemu", "tcg,thread=single", "maximum"},
		{"qemu, kvm not proven", noKVM, "qemu", "qemu", "tcg,thread=single", "maximum"},
		{"no probe", TCG, "kvm", "qemu", "tcg,thread=single", "maximum"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := c.h.DomainType(c.typ); got != c.wantType {
				t.Errorf("DomainType(%s) = %s, want %s", c.typ, got, c.wantType)
			}
			if got := c.h.Accel(c.typ); got != c.wantAccel {
				t.Errorf("Accel(%s) = %s, want %s", c.typ, got, c.wantAccel)
			}
			d := domainWithCPU(c.typ, "host-passthrough")
			c.h.ForCommandLine(&d)
			if d.Type != c.wantType || d.CPU.Mode != c.wantCPUMode {
				t.Errorf("ForCommandLine: type %s cpu %s, want %s %s", d.Type, d.CPU.Mode, c.wantType, c.wantCPUMode)
			}
		})
	}
}

// The probe's refusals each name their step: no device, a device that is not KVM's, and
// a KVM that creates VMs but has no kernel to prove it runs one.
func TestProbeKVMRefuses(t *testing.T) {
	dir := t.TempDir()
	notKVM := filepath.Join(dir, "kvm")
	if err := os.WriteFile(notKVM, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		dev, kernel, want string
	}{
		{filepath.Join(dir, "none"), "", "open "},
		{notKVM, "", "KVM_GET_API_VERSION"},
		{os.DevNull, "", "KVM_GET_API_VERSION"},
	} {
		err := ProbeKVM(c.dev, c.kernel, time.Second)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ProbeKVM(%s) = %v, want an error naming %q", c.dev, err, c.want)
		}
	}
	// This machine's own /dev/kvm, where there is one that opens: without a kernel KVM is
	// never proven, whatever the ioctls say; with a kernel that is not there, neither.
	if _, err := os.Stat(KVMDevice); err == nil {
		if err := ProbeKVM(KVMDevice, "", time.Second); err == nil {
			t.Error("ProbeKVM with no kernel proved KVM")
		}
		if err := ProbeKVM(KVMDevice, filepath.Join(dir, "vmlinuz"), time.Second); err == nil {
			t.Error("ProbeKVM with a missing kernel proved KVM")
		} else {
			t.Logf("%s: %v", KVMDevice, err)
		}
	}
}

func domainWithCPU(typ, mode string) libvirtxml.Domain {
	return libvirtxml.Domain{Type: typ, CPU: &libvirtxml.DomainCPU{Mode: mode}, Devices: &libvirtxml.DomainDeviceList{}}
}
