// Package libvirttest starts a libvirtd of a test's own, so that what passage renders
// for a hypervisor is judged by libvirt itself (virsh define) without touching the
// host's libvirt: the unit tests of cmd/passage and the QEMU scenarios use it.
package libvirttest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"
)

// Start starts libvirtd as root in a mount namespace of its own: tmpfs over
// /run, /var/lib, /var/cache and /var/log, and a private /etc/libvirt whose qemu.conf
// runs QEMU as root, so the daemon's state, its domain definitions and its sockets live
// and die with the test and nothing on the host changes. No network is defined, so none
// is started. It returns the qemu:///system URI of its socket; cleanup stops it and
// waits for it.
func Start(t testing.TB) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Fatal("libvirtd's system instance needs root (CI runs as root)")
	}
	for _, tool := range []string{"libvirtd", "virsh", "unshare"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed for this test (image/deps.sh installs it): %v", tool, err)
		}
	}
	dir := t.TempDir()
	for _, d := range []string{"etc", "run"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"etc/qemu.conf": "user = \"root\"\ngroup = \"root\"\n",
		"libvirtd.conf": fmt.Sprintf("unix_sock_dir = %q\nauth_unix_rw = \"none\"\nauth_unix_ro = \"none\"\nlog_outputs = \"3:file:%s\"\n",
			filepath.Join(dir, "run"), filepath.Join(dir, "libvirtd.log")),
		"start.sh": fmt.Sprintf("set -e\nfor d in /run /var/lib /var/cache /var/log; do mount -t tmpfs -o mode=0755 passage-libvirt $d; done\n"+
			"mount --bind %s /etc/libvirt\nexec libvirtd -f %s -p %s\n",
			filepath.Join(dir, "etc"), filepath.Join(dir, "libvirtd.conf"), filepath.Join(dir, "run/libvirtd.pid")),
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var out bytes.Buffer
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", filepath.Join(dir, "start.sh"))
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	sock := filepath.Join(dir, "run", "libvirt-sock")
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-done:
			log, _ := os.ReadFile(filepath.Join(dir, "libvirtd.log"))
			t.Fatalf("libvirtd exited: %v\n%s\n%s", err, out.String(), log)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("libvirtd: no socket %s after 30 s\n%s", sock, out.String())
		}
	}
	return "qemu:///system?socket=" + sock
}

// Virsh runs virsh against uri and returns its output; a failure fails the test.
func Virsh(t testing.TB, uri string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "virsh", append([]string{"-c", uri}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("virsh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// kvmDomain is the domain element's opening tag where it asks for KVM.
var kvmDomain = regexp.MustCompile(`(<domain\s+type=)(["'])kvm(["'])`)

// Define defines the domain file describes with virsh define, as type h.DomainType
// gives: a domain asked as type kvm is defined as type qemu where KVM was not proven to
// run a guest (libvirt refuses type kvm without /dev/kvm, "Emulator ... does not support
// virt type 'kvm'", and the rest of the domain is judged the same either way). A test
// that compares virsh dumpxml with the file compares h.DomainType of the file's type.
func (h Host) Define(t testing.TB, uri, file string) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if !kvmDomain.Match(b) || h.DomainType("kvm") == "kvm" {
		Virsh(t, uri, "define", file)
		return
	}
	qemu := filepath.Join(t.TempDir(), filepath.Base(file))
	if err := os.WriteFile(qemu, kvmDomain.ReplaceAll(b, []byte("${1}${2}qemu${3}")), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: defined as type qemu: KVM not proven here (%v)", file, h.KVM)
	Virsh(t, uri, "define", qemu)
}

// ForCommandLine takes out of d what this machine cannot give `virsh domxml-to-native`,
// nothing of the guest's PCI tree, so a test can read libvirt's own command line for a
// node's domain: the host NUMA binding (<numatune>: the test machine has one node), each
// PCI hostdev's backend left to libvirt's probing (it names vfio; a test boots its
// stand-in instead), and, where KVM was not proven, KVM itself: the type is
// h.DomainType's, and a host-passthrough CPU (KVM only: libvirt refuses it for type
// qemu) is TCG's nearest, maximum. The guest's address width is then the test's to give
// (QEMU's phys-bits); the guest starts with h.Accel(d.Type).
func (h Host) ForCommandLine(d *libvirtxml.Domain) {
	d.NUMATune = nil
	d.Type = h.DomainType(d.Type)
	if d.Type == "qemu" && d.CPU != nil && d.CPU.Mode == "host-passthrough" {
		d.CPU.Mode = "maximum"
	}
	for i := range d.Devices.Hostdevs {
		if p := d.Devices.Hostdevs[i].SubsysPCI; p != nil {
			p.Driver = &libvirtxml.DomainHostdevSubsysPCIDriver{Name: "vfio"}
		}
	}
}
