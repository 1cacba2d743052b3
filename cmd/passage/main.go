// Command passage is the one binary of the project: the boot stage (the u-root uinit)
// and the tools an operator and a hypervisor use around it. Each subcommand is flag
// parsing and output around a package call; the logic lives in the packages.
package main

import (
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/u-root/u-root/pkg/libinit"
)

// command is one subcommand: run gets the arguments after the subcommand's name and
// returns the process exit status (0 ok, 1 a check failed, 2 bad usage or bad input).
// synopsis follows "passage NAME" in the help (one form a line), summary is its one line
// in the command list, detail what else its help says (exit statuses, what it refuses).
type command struct {
	synopsis, summary, detail string
	run                       func(args []string, stdout, stderr io.Writer) int
}

func commands() map[string]command {
	return map[string]command{
		"boot": {"[--root DIR] [--dry-run] [--no-handoff]",
			"run the boot stage (the initramfs uinit); never returns", "Configured by passage.* kernel arguments (initramfs/README.md); flags only for a synthetic\n--root. Without --no-handoff it hands off (switch_root, poweroff, shell or hold) and never returns.", cmdBoot},
		"inspect": {"[--root DIR | --snapshot FILE | --lspci-dump FILE] [--json] [--profile NAME|FILE] [--pci-ids FILE]",
			"show the PCIe tree with links, ACS and ATS", "Exit status: 0 all read cleanly; 1 shown, but with problems (lines marked !, or \"problems\" in\n--json): a function's config space truncated, not answering or malformed, a damaged dump;\n2 nothing readable.", cmdInspect},
		"snapshot": {"-o FILE [--root DIR]",
			"capture the sysfs files a scan reads into a tar.gz", "Exactly the files a scan reads (config and vpd included, with their links); passage inspect,\nplan and render read it back with --snapshot FILE.", cmdSnapshot},
		"plan": {"[--root DIR | --snapshot FILE | --lspci-dump FILE] [--profile NAME|FILE] [--ats prefer|require] [--erase off|auto|require] [--unit gpu0,gpu1|all] [--numa] [--json] [-o FILE]",
			"label roles, group GPU units, plan ACS and the guest topology", "-o saves the decision for apply --plan. Exit status: 0 every unit ready, 1 a unit degraded or\nfailed, 2 bad input.", cmdPlan},
		"cmdline": {"--plan FILE [--base ARGUMENTS]",
			"print the kernel arguments a signed boot image carries for a saved plan", "Prints the saved plan's pci=config_acs= (Linux 6.11+ programs it before passage runs; under\nlockdown the only way ACS is set) and passage.plan=sha256:<digest of FILE>, which the\nmanifest records. make uki PLAN=FILE appends them to the signed command line. A plan\nlisting a port twice is refused (the kernel applies the first entry that matches a port),\nand so is a line, with --base's arguments before the plan's, of the kernel's length or\nmore (2047 bytes on x86: the boot cannot tell it from a cut one): exit 2, nothing printed.", cmdCmdline},
		"render": {"[flags] (--pub KEY | --tpm-pub KEY) MANIFEST\n[flags] --root DIR | --snapshot FILE | --lspci-dump FILE",
			"print a guest (QEMU args, libvirt domain, NCCL XML) from a verified manifest, or from a tree to plan", "From MANIFEST it reads the verified manifest and nothing else: what a hypervisor builds a VM\nfrom. From a tree it decides as plan does (planning output, said so on stderr). A unit that\nis not ready is refused (exit 1); --allow-degraded admits degraded ones and names them.", cmdRender},
		"apply": {"[--root DIR] [--dry-run | --plan FILE] [--profile NAME|FILE] [--erase off|auto|require] [--no-bind] [--json]",
			"program ACS and bind passthrough devices to vfio-pci", "", cmdApply},
		"unbind": {"--unit N[,M...] | --bdf DDDD:BB:DD.F[,...] [--root DIR] [--profile NAME|FILE] [--json] [--signing-key FILE] [--dir DIR] [--tpm on|off|auto] [--nonce HEX] [--generation-file FILE]",
			"return units' devices to their host drivers", "Refuses while a unit's /dev/vfio/<group> or a function's /dev/vfio/devices/vfioN is open.\nWith the boot's manifest in --dir it first signs a generation marking the units failed (a key\nand a generation counter needed, as for recycle). With --nonce, a generation it cannot attest\nover the verifier's nonce exits 1 (the functions are released all the same).", cmdUnbind},
		"recycle": {"--unit N[,M...] [--signing-key FILE] [--tpm on|off|auto] [--nonce HEX] [--erase auto|require] [flags]",
			"erase and reset units between tenants on a running host, sign a new generation", "Refuses while a unit's /dev/vfio/<group> or /dev/vfio/devices/vfioN is open, and without a\ngeneration counter (the TPM's, or --generation-file). Otherwise: a signed generation marking the\nunits not ready, release from vfio-pci, NVMe erase, function resets, vfio-pci again, and a\nsigned generation with the verdicts.", cmdRecycle},
		"keygen": {"[-o DIR] [--wait DUR] [--enrol [--root DIR] [--enrol-hostname]]",
			"write an ed25519 key pair for signing manifests", "Creates DIR (mode 0700) when it does not exist. --enrol also writes passage.enrol.json, the\nkey's enrolment for this node (its DMI UUID and serial, read under --root): a fleet key\ndirectory needs one beside each key.", cmdKeygen},
		"tpm-pubkey": {"[--tpm-device DEVICE] [-o FILE [--enrol [--root DIR] [--enrol-hostname]]]",
			"print the public part of the TPM-resident signing key", "--enrol (with -o FILE) also writes the key's enrolment for this node beside FILE.", cmdTPMPubkey},
		"attest": {"enroll --ek-ca FILE --challenge FILE --pending FILE ATTESTATION\nenroll --pending FILE --answer FILE -o NODE [--tpm-pub-out KEY]\nactivate [--tpm-device DEVICE] -o ANSWER CHALLENGE\nquote [--tpm-device DEVICE] [--dir DIR] [--nonce HEX] -o ATTESTATION\nnonce --nonces STORE",
			"enrol a node's TPM for remote attestation, answer the challenge, quote on demand", "Enrolment is a round: the verifier checks the EK certificate of the node's attestation\n(MANIFEST.attest.json, which the boot writes and publishes beside the manifest) against\n--ek-ca and seals a credential to the EK for the AK (enroll); the node recovers it with its\nTPM (activate); the verifier checks the answer and writes the node record the fleet keeps\n(enroll --answer), and with --tpm-pub-out the signing key the AK certified. verify --attest\nchecks an attestation against the record. nonce issues a nonce from the verifier's store\n(what a control plane answers the boot's GET of passage.url with); verify --attest --nonces\naccepts an attestation only over a nonce the store issued and has not seen used. Exit status: 0 done, 1 refused, 2 bad usage or file.", cmdAttest},
		"verify": {"(--pub KEY | --tpm-pub KEY) [--min-generation N] [--boot-id ID] [--by-unit] [--json] MANIFEST\n--tpm-pub KEY --attest FILE --node FILE --ek-ca FILE --approved FILE [--nonce HEX | --nonces STORE] [--update-node] MANIFEST\n--pub KEY|KEYDIR [--min-generation N] MANIFEST|DIR...",
			"verify a signed manifest (the hypervisor side)", "With a directory or several manifests: a fleet, verified in parallel, one line per node (its\nsigner and build) and a summary; with a key directory each manifest is checked with its\nnode's key, enrolled for that node (KEY.enrol.json beside KEY.pub; a key without one makes\nthe directory unusable; files there that are not public keys are ignored, and named once). Exit status: 0 all verified, 1 one\nrefused, 2 one unreadable or bad usage.", cmdVerify},
		"perfcheck": {"--host DIR --guest DIR [--json] [--html FILE] [limits]",
			"compare host and guest nccl-tests/nvbandwidth results", "Exit status 1 when a limit is crossed.", cmdPerfcheck},
		"metrics": {"(--pub KEY|KEYDIR | --tpm-pub KEY) [--root DIR] [--min-generation N] [--boot-id ID] MANIFEST",
			"print a verified manifest as Prometheus metrics", "Metrics report the manifest, they judge nothing.", cmdMetrics},
		"version": {"[--json]",
			"print the build: module version, VCS revision, Go version", "The same build the manifest, log.jsonl, the console and passage_build_info name.", cmdVersion},
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: passage <command> [flags]\n       passage help <command>\n       passage --version\n\ncommands:")
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
		if args[0] != "help" || len(args) == 1 {
			usage(stdout)
			return 0
		}
		// passage help CMD is passage CMD -h.
		if _, ok := commands()[args[1]]; !ok || len(args) > 2 {
			fmt.Fprintf(stderr, "passage help: want one command, got %q\n", strings.Join(args[1:], " "))
			usage(stderr)
			return 2
		}
		args = []string{args[1], "-h"}
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
