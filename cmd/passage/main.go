// Command passage is the one binary of the project: the boot stage (the u-root uinit)
// and the tools an operator and a hypervisor use around it. Each subcommand is flag
// parsing and output around a package call; the logic lives in the packages.
package main

import (
	"fmt"
	"io"
	"os"
	"sort"

	"github.com/u-root/u-root/pkg/libinit"
)

// command is one subcommand: run gets the arguments after the subcommand's name and
// returns the process exit status (0 ok, 1 a check failed, 2 bad usage or bad input).
type command struct {
	summary string
	run     func(args []string, stdout, stderr io.Writer) int
}

func commands() map[string]command {
	return map[string]command{
		"boot":       {"run the boot stage (the initramfs uinit); never returns", cmdBoot},
		"inspect":    {"show the PCIe tree with links, ACS and ATS", cmdInspect},
		"snapshot":   {"capture the sysfs files a scan reads into a tar.gz", cmdSnapshot},
		"plan":       {"label roles, group GPU units, plan ACS and the guest topology", cmdPlan},
		"render":     {"print a guest (QEMU args, libvirt domain, NCCL XML) from a verified manifest, or from a tree to plan", cmdRender},
		"apply":      {"program ACS and bind passthrough devices to vfio-pci", cmdApply},
		"unbind":     {"return a unit's devices to their host drivers", cmdUnbind},
		"recycle":    {"erase and reset units between tenants on a running host, sign a new generation", cmdRecycle},
		"keygen":     {"write an ed25519 key pair for signing manifests", cmdKeygen},
		"tpm-pubkey": {"print the public part of the TPM-resident signing key", cmdTPMPubkey},
		"verify":     {"verify a signed manifest (the hypervisor side)", cmdVerify},
		"perfcheck":  {"compare host and guest nccl-tests/nvbandwidth results", cmdPerfcheck},
		"metrics":    {"print a verified manifest as Prometheus metrics", cmdMetrics},
		"version":    {"print the build: module version, VCS revision, Go version", cmdVersion},
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: passage <command> [flags]\n\ncommands:")
	cmds := commands()
	names := make([]string, 0, len(cmds))
	for n := range cmds {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-11s %s\n", n, cmds[n].summary)
	}
}

func main() {
	if os.Getpid() == 1 {
		// The image's /init: the kernel started passage itself, so it sets up what u-root's
		// init would (mounts, environment) and runs the boot. Being PID 1 is what lets the
		// handoff switch_root into the real root, whose init must be PID 1 too.
		libinit.SetEnv()
		libinit.CreateRootfs()
		os.Exit(cmdBoot(nil, os.Stdout, os.Stderr)) // cmdBoot never returns without --no-handoff
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout)
		return 0
	}
	if args[0] == "--version" || args[0] == "-version" {
		return cmdVersion(nil, stdout, stderr)
	}
	c, ok := commands()[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "passage: unknown command %q\n", args[0])
		usage(stderr)
		return 2
	}
	return c.run(args[1:], stdout, stderr)
}
