//go:build linux

// Command recycler runs as the uinit of the recycle scenario: it runs `passage boot
// --no-handoff` (passage.erase=off on the command line, so the tenant's marker survives
// the boot), keeps the boot's manifest, then, as a hypervisor would between two VMs,
// runs `passage recycle --unit 0` once while it holds unit 0's /dev/vfio/<group> open
// (which must be refused) and once after closing it. It records each exit code and
// output and where unit 0's functions ended, sends /run/passage over the console and
// powers off.
package main

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/passage-boot/passage/initramfs/emit"
)

const (
	runDir  = "/run/passage"
	passage = "/bbin/passage"
	// unit0NVMe is unit 0's NVMe in the qemu topology (qemu-tests/README.md).
	unit0NVMe = "0000:0a:00.0"
)

// unit0 are unit 0's passthrough functions: GPU, CX-8 PF0 and PF1, NVMe.
var unit0 = []string{"0000:09:00.0", "0000:06:00.0", "0000:06:00.1", unit0NVMe}

func run(name string, args ...string) {
	cmd := exec.Command(passage, args...)
	cmd.Args[0] = "passage"
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		code, out = -1, append(out, err.Error()...)
	}
	write(name+".out", out)
	write(name+".exit", []byte(fmt.Sprintf("%d\n", code)))
}

func write(name string, b []byte) {
	if err := os.WriteFile(filepath.Join(runDir, name), b, 0o644); err != nil {
		fmt.Fprintf(os.Stderr, "recycler: %v\n", err)
	}
}

func drivers() string {
	var b strings.Builder
	for _, a := range unit0 {
		t, _ := os.Readlink("/sys/bus/pci/devices/" + a + "/driver")
		fmt.Fprintf(&b, "%s %s\n", a, filepath.Base(t))
	}
	return b.String()
}

func main() {
	run("boot", "boot", "--no-handoff")
	if b, err := os.ReadFile(filepath.Join(runDir, "manifest.dsse.json")); err == nil {
		write("boot-manifest.dsse.json", b)
	}
	write("drivers-boot.txt", []byte(drivers()))
	t, err := os.Readlink("/sys/bus/pci/devices/" + unit0NVMe + "/iommu_group")
	if err != nil {
		write("recycler-error.txt", []byte(err.Error()))
	}
	node := "/dev/vfio/" + filepath.Base(t)
	f, err := os.OpenFile(node, os.O_RDWR, 0)
	if err != nil {
		write("recycler-error.txt", []byte(fmt.Sprintf("open %s: %v", node, err)))
	}
	run("recycle-held", "recycle", "--unit", "0")
	write("drivers-held.txt", []byte(drivers()))
	if f != nil {
		f.Close()
	}
	run("recycle", "recycle", "--unit", "0")
	write("drivers-recycled.txt", []byte(drivers()))

	var ws []io.Writer
	for _, c := range emit.OpenConsoles("/") {
		ws = append(ws, c)
	}
	console := io.MultiWriter(ws...)
	if err := emit.Dir(console, runDir); err != nil {
		fmt.Fprintf(console, "recycler: %v\n", err)
	}
	emit.Done(console, "ok")
	for _, c := range ws {
		emit.Drain(c)
	}
	syscall.Sync()
	syscall.Reboot(syscall.LINUX_REBOOT_CMD_POWER_OFF)
}
