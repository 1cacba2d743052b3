// Command passage-hook is passage's KubeVirt hook sidecar: it keeps each passage unit's
// GPU, NICs and NVMe behind one virtual PCIe switch in the guest (see dra/hook).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"kubevirt.io/kubevirt/pkg/hooks"

	"github.com/passage-boot/passage/dra/hook"
)

type options struct {
	c                                      hook.Config
	uuidFile, socket, ncclDir, ncclDiskDir string
	cpuinfo                                string // --cpuinfo: the node's address width
}

func parse(args []string, stderr io.Writer) (*options, error) {
	fs := flag.NewFlagSet("passage-hook", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	fs.StringVar(&o.c.Manifest, "manifest", "/run/passage/manifest.dsse.json", "the node's manifest")
	fs.StringVar(&o.c.Keys, "pub", "/etc/passage/keys", "enrolled public key file or directory")
	fs.BoolVar(&o.c.TPM, "tpm-pub", false, "the keys are TPM keys")
	fs.Uint64Var(&o.c.MinGeneration, "min-generation", 0, "refuse manifests of a lower generation")
	fs.StringVar(&o.uuidFile, "node-uuid-file", "/sys/class/dmi/id/product_uuid", "this node's DMI product UUID")
	fs.StringVar(&o.cpuinfo, "cpuinfo", "/proc/cpuinfo", "where the node's physical address width is read (address sizes); empty: guests' widths are not checked")
	// KubeVirt mounts the sidecar's /var/run/kubevirt-hooks at the compute container's
	// /var/run/kubevirt-hooks/$CONTAINER_NAME, where virt-launcher dials every plain
	// file as a socket and skips directories: the socket sits at the top, the NCCL files
	// one directory below.
	fs.StringVar(&o.socket, "socket", "/var/run/kubevirt-hooks/passage.sock", "the hook socket (in /var/run/kubevirt-hooks itself)")
	fs.StringVar(&o.ncclDir, "nccl-dir", "/var/run/kubevirt-hooks/passage", "where each VMI's NCCL topology file and disk image are written (empty: not written)")
	fs.StringVar(&o.ncclDiskDir, "nccl-disk-dir", "",
		"--nccl-dir as the compute container (QEMU) sees it; unset: /var/run/kubevirt-hooks/$CONTAINER_NAME/ and --nccl-dir's path below /var/run/kubevirt-hooks; empty: no NCCL disk in the guest")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("passage-hook: no arguments, not %q", fs.Args())
	}
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == "nccl-disk-dir" })
	if !set && o.ncclDir != "" {
		d, err := computeDir(o.ncclDir, os.Getenv(hooks.ContainerNameEnvVar))
		if err != nil {
			err = fmt.Errorf("passage-hook: --nccl-disk-dir: %w", err)
			fmt.Fprintln(stderr, err)
			return nil, err
		}
		o.ncclDiskDir = d
	}
	return &o, nil
}

// computeDir is the sidecar's dir as the compute container sees it. virt-controller
// mounts the shared hook volume into each sidecar at /var/run/kubevirt-hooks with the
// sub-path of the sidecar's container name (hook-sidecar-N for the Nth entry of the VMI's
// hooks.kubevirt.io/hookSidecars) and gives the container that name in CONTAINER_NAME
// (KubeVirt v1.9.0 template.go: newSidecarContainerRenderer, sidecarVolumeMount), while
// the compute container mounts the whole volume at /var/run/kubevirt-hooks. So the
// sidecar's /var/run/kubevirt-hooks/X is the compute container's
// /var/run/kubevirt-hooks/$CONTAINER_NAME/X, whichever place the VMI gives the hook.
func computeDir(dir, container string) (string, error) {
	if container == "" {
		return "", fmt.Errorf("%s is not set (virt-launcher's pod sets it in each hook sidecar): "+
			"outside KubeVirt, name --nccl-dir as QEMU sees it with --nccl-disk-dir, or give it empty for no NCCL disk", hooks.ContainerNameEnvVar)
	}
	if strings.ContainsRune(container, '/') || container == "." || container == ".." {
		return "", fmt.Errorf("%s=%q is not a container name", hooks.ContainerNameEnvVar, container)
	}
	rel, err := filepath.Rel(hooks.HookSocketsSharedDirectory, dir)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") || !filepath.IsAbs(dir) {
		return "", fmt.Errorf("--nccl-dir %s is not below %s, the sidecar's directory the compute container mounts: name it as QEMU sees it with --nccl-disk-dir",
			dir, hooks.HookSocketsSharedDirectory)
	}
	return filepath.Join(hooks.HookSocketsSharedDirectory, container, rel), nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr))
}

// run serves the hook until ctx ends: exit status 2 for bad usage, 1 when it cannot
// serve.
func run(ctx context.Context, args []string, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if err != nil {
		return 2
	}
	b, err := os.ReadFile(o.uuidFile)
	if err != nil {
		fmt.Fprintf(stderr, "passage-hook: node uuid: %v\n", err)
		return 1
	}
	o.c.NodeUUID = strings.TrimSpace(string(b))
	if o.cpuinfo != "" {
		if o.c.HostPhysBits, err = hook.HostPhysBits(o.cpuinfo); err != nil {
			fmt.Fprintf(stderr, "passage-hook: --cpuinfo: %v\n", err)
			return 1
		}
	}
	// The sidecar's /var/run/kubevirt-hooks is a fresh emptyDir: nothing else makes the
	// NCCL directory below it, and a VMI whose file cannot be written does not start.
	if o.ncclDir != "" {
		if err := os.MkdirAll(o.ncclDir, 0o755); err != nil {
			fmt.Fprintf(stderr, "passage-hook: --nccl-dir: %v\n", err)
			return 1
		}
	}
	if o.ncclDir != "" && o.ncclDiskDir != "" {
		fmt.Fprintf(stderr, "passage-hook: NCCL files in %s, which QEMU opens as %s\n", o.ncclDir, o.ncclDiskDir)
	}
	s := &hook.Server{Config: o.c, NCCLDir: o.ncclDir, NCCLDiskDir: o.ncclDiskDir, Log: log.New(stderr, "passage-hook: ", 0)}
	if err := hook.Serve(ctx, o.socket, s); err != nil {
		fmt.Fprintf(stderr, "passage-hook: %v\n", err)
		return 1
	}
	return 0
}
