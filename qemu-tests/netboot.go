package qemutest

import (
	"debug/pe"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/passage-boot/passage/internal/checkout"
)

// NetBoot boots the way a node does: UEFI firmware (OVMF) with Secure Boot, the
// management NIC's iPXE option ROM (Debian's ipxe-qemu, efi-e1000e.rom), DHCP and TFTP
// from QEMU's user network (restrict=on), boot.ipxe chaining a signed unified kernel
// image. There is no -kernel, -initrd or -append: the image carries all three, and the
// firmware verifies it before it runs.
type NetBoot struct {
	// Code and Vars are the firmware and its variable store (copied; the original is
	// never written). Zero: Debian's OVMF_CODE_4M.secboot.fd and OVMF_VARS_4M.snakeoil.fd,
	// Secure Boot on with the snakeoil test key in PK, KEK and db.
	Code, Vars string
	// Key and Cert sign the image (sbsign). Zero: the snakeoil key (SnakeoilKey).
	Key, Cert string
	// Tamper, when set, alters the signed image before it is served (TamperSection).
	Tamper func(uki string) error
	// StopAt ends the boot (QEMU is killed) at the first console line containing it: a
	// refused image leaves the firmware waiting, not powered off.
	StopAt string
	// ControlPlane, when set, is the host address (127.0.0.1:PORT) of a control plane
	// the test serves: the guest reaches it as ControlPlaneURL (a guestfwd on the
	// management network, internal/fwd per connection), which goes into the signed
	// command line as passage.url.
	ControlPlane string
}

// ControlPlaneURL is passage.url in a boot with a ControlPlane.
const ControlPlaneURL = "http://10.0.2.100/m"

// Debian's ovmf package.
const (
	OVMFCode         = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd"
	OVMFVarsSnakeoil = "/usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd"
	OVMFVarsNoKeys   = "/usr/share/OVMF/OVMF_VARS_4M.fd" // Secure Boot off: no PK enrolled
	// OVMFCodeNoSecureBoot is the build without Secure Boot (no SMM needed).
	OVMFCodeNoSecureBoot = "/usr/share/OVMF/OVMF_CODE_4M.fd"
	snakeoilKey          = "/usr/share/ovmf/PkKek-1-snakeoil.key"
	snakeoilCert         = "/usr/share/ovmf/PkKek-1-snakeoil.pem"
	snakeoilPass         = "snakeoil" // the key's passphrase (Debian's ovmf README)
)

// SnakeoilKey writes the snakeoil private key, decrypted, into dir for sbsign: a test
// key, published with the firmware, that no real node trusts.
func SnakeoilKey(dir string) (key, cert string, err error) {
	key = filepath.Join(dir, "snakeoil.key")
	out, err := exec.Command("openssl", "pkey", "-in", snakeoilKey, "-passin", "pass:"+snakeoilPass, "-out", key).CombinedOutput()
	if err != nil {
		return "", "", fmt.Errorf("snakeoil key: openssl pkey: %v: %s", err, out)
	}
	return key, snakeoilCert, nil
}

// TamperSection flips one byte in the middle of a PE section of the image (".initrd":
// the initramfs), leaving its headers and signature as they were: what a network that
// rewrites a served image produces.
func TamperSection(path, section string) error {
	f, err := pe.Open(path)
	if err != nil {
		return fmt.Errorf("tamper %s: %w", path, err)
	}
	s := f.Section(section)
	f.Close()
	if s == nil || s.Size == 0 {
		return fmt.Errorf("tamper %s: no section %s", path, section)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	off := int64(s.Offset) + int64(s.Size)/2
	if off >= int64(len(b)) {
		return fmt.Errorf("tamper %s: section %s beyond the file", path, section)
	}
	b[off] ^= 0xff
	return os.WriteFile(path, b, 0o644)
}

// netbootArgs prepares the TFTP directory (the signed image and boot.ipxe, from
// image/uki.sh) and returns QEMU's firmware arguments; topology gets the management
// NIC's ROM and the TFTP service on its network.
func (n *NetBoot) args(work, kernel, initrd, cmdline string, topology []string) ([]string, error) {
	tftp := filepath.Join(work, "tftp")
	key, cert := n.Key, n.Cert
	if key == "" {
		var err error
		if key, cert, err = SnakeoilKey(work); err != nil {
			return nil, err
		}
	}
	// image/uki.sh of this source tree, wherever the harness runs from (go test, qemurun).
	script, err := checkout.Path("image/uki.sh")
	if err != nil {
		return nil, fmt.Errorf("netboot: %w", err)
	}
	guestfwd := ""
	if n.ControlPlane != "" {
		fwd, err := BuildFwd(work)
		if err != nil {
			return nil, fmt.Errorf("netboot: %w", err)
		}
		guestfwd = ",guestfwd=tcp:10.0.2.100:80-cmd:" + fwd + " " + n.ControlPlane
		// The test's control plane is plain http on the management network: the boot
		// publishes there only when told it may.
		cmdline += " passage.url=" + ControlPlaneURL + " passage.url_insecure=1"
	}
	if out, err := exec.Command("bash", script, tftp, kernel, initrd, cmdline, key, cert).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("netboot: uki.sh: %v: %s", err, out)
	}
	if n.Tamper != nil {
		if err := n.Tamper(filepath.Join(tftp, "passage.efi")); err != nil {
			return nil, err
		}
	}
	code, vars := n.Code, n.Vars
	if code == "" {
		code = OVMFCode
	}
	if vars == "" {
		vars = OVMFVarsSnakeoil
	}
	v, err := os.ReadFile(vars)
	if err != nil {
		return nil, fmt.Errorf("netboot: firmware variables: %w (make deps installs ovmf)", err)
	}
	varsCopy := filepath.Join(work, "ovmf-vars.fd")
	if err := os.WriteFile(varsCopy, v, 0o644); err != nil {
		return nil, err
	}
	// The management NIC: QEMU's TFTP on its user network, its iPXE ROM, first to boot.
	var netdev, device bool
	topo := append([]string(nil), topology...)
	for i, a := range topo {
		if strings.HasPrefix(a, "user,id=mgmt0,") {
			topo[i] = a + ",tftp=" + tftp + ",bootfile=boot.ipxe" + guestfwd
			netdev = true
		}
		if strings.HasPrefix(a, "e1000e,id=mgmt0d,") && strings.Contains(a, ",romfile=") {
			topo[i] = strings.Replace(a, ",romfile=", ",bootindex=0,romfile=efi-e1000e.rom", 1)
			device = true
		}
	}
	if !netdev || !device {
		return nil, fmt.Errorf("netboot: the topology has no management NIC mgmt0 (e1000e) to boot from")
	}
	fw := []string{
		// SMM: OVMF's Secure Boot build keeps its variables (db, PK) where the OS cannot
		// write them (the secure pflash).
		"-global", "driver=cfi.pflash01,property=secure,value=on",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=" + code,
		"-drive", "if=pflash,format=raw,unit=1,file=" + varsCopy,
	}
	return append(fw, topo...), nil
}
