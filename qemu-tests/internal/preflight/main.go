//go:build linux

// Command preflight runs as the uinit of a QEMU scenario in front of the real `passage
// boot`: it first asks `passage plan --json` and `passage apply --dry-run --json` what
// they decide on the guest's own /sys, writes their output into /run/passage (the boot
// sends that directory over the console), then execs `passage boot`. The scenario then
// compares those verdicts with what the boot did (qemu-tests/README.md).
package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

const (
	runDir  = "/run/passage"
	passage = "/bbin/passage"
)

// profile is passage.profile= from the kernel command line, as the boot reads it.
func profile() string {
	b, _ := os.ReadFile("/proc/cmdline")
	for _, f := range strings.Fields(string(b)) {
		if v, ok := strings.CutPrefix(f, "passage.profile="); ok {
			return v
		}
	}
	return "b300"
}

// run runs passage with args and keeps its stdout, exit code and stderr in runDir.
func run(name string, args ...string) {
	cmd := exec.Command(passage, args...)
	cmd.Args[0] = "passage" // the u-root multicall binary dispatches on argv[0]
	out, err := cmd.Output()
	code := 0
	var stderr []byte
	if ee, ok := err.(*exec.ExitError); ok {
		code, stderr = ee.ExitCode(), ee.Stderr
	} else if err != nil {
		code, stderr = -1, []byte(err.Error())
	}
	write(name+".json", out)
	write(name+".exit", []byte(fmt.Sprintf("%d\n%s", code, stderr)))
}

func write(name string, b []byte) {
	if err := os.WriteFile(filepath.Join(runDir, name), b, 0o644); err != nil {
		fmt.Fprintf(os.Stderr, "preflight: %v\n", err)
	}
}

func main() {
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		fmt.Fprintf(os.Stderr, "preflight: %v\n", err)
	}
	p := profile()
	run("preflight-plan", "plan", "--root", "/", "--profile", p, "--json")
	// The saved plan, as an operator takes it from a reference node for `make uki PLAN=`.
	run("preflight-saveplan", "plan", "--root", "/", "--profile", p, "-o", filepath.Join(runDir, "preflight-plan.saved.json"))
	run("preflight-dryrun", "apply", "--root", "/", "--profile", p, "--dry-run", "--json")
	// The names the image's pci.ids subset gives (qemu-tests/fleet_qemu_test.go).
	run("preflight-inspect", "inspect", "--root", "/", "--profile", p, "--json")
	err := syscall.Exec(passage, []string{"passage", "boot"}, os.Environ())
	fmt.Fprintf(os.Stderr, "preflight: exec passage boot: %v\n", err)
	os.Exit(1)
}
