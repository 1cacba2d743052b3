// Command passage-hook is passage's KubeVirt hook sidecar: it keeps each passage unit's
// GPU, NICs and NVMe behind one virtual PCIe switch in the guest (see kube/kubevirthook).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"kubevirt.io/kubevirt/pkg/hooks"

	"github.com/passage-boot/passage/kube/kubevirthook"
	"github.com/passage-boot/passage/manifest"
)

type options struct {
	c                                                        kubevirthook.Config
	uuidFile, bootIDFile, root, socket, ncclDir, ncclDiskDir string
	cpuinfo                                                  string // --cpuinfo: the node's address width
}

func parse(args []string, stderr io.Writer) (*options, error) {
	fs := flag.NewFlagSet("passage-hook", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	fs.StringVar(&o.c.Manifest, "manifest", "/run/passage/manifest.dsse.json", "the node's manifest")
	fs.StringVar(&o.c.Keys, "pub", "/etc/passage/keys", "enrolled public key file or directory: on --image-root's filesystem or a read-only mount")
	fs.BoolVar(&o.c.TPM, "tpm-pub", false, "the keys are TPM keys")
	fs.Uint64Var(&o.c.MinGeneration, "min-generation", 0, "refuse manifests of a lower generation")
	fs.StringVar(&o.uuidFile, "node-uuid-file", "", "this node's DMI product UUID, when the hook may read it: on --image-root's filesystem or a read-only mount (empty: not checked)")
	fs.StringVar(&o.bootIDFile, "boot-id-file", "/proc/sys/kernel/random/boot_id",
		"the kernel's boot ID, which the manifest must carry (procfs only; empty: not checked, --node-uuid-file then required)")
	fs.StringVar(&o.root, "image-root", "/", "the sidecar image's root filesystem, where no other container writes")
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
	if err := o.trustRoot(); err != nil {
		fmt.Fprintf(stderr, "passage-hook: %v\n", err)
		return 1
	}
	if o.cpuinfo != "" {
		if o.c.HostPhysBits, err = kubevirthook.HostPhysBits(o.cpuinfo); err != nil {
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
	s := &kubevirthook.Server{Config: o.c, NCCLDir: o.ncclDir, NCCLDiskDir: o.ncclDiskDir, Log: log.New(stderr, "passage-hook: ", 0)}
	if err := kubevirthook.Serve(ctx, o.socket, s); err != nil {
		fmt.Fprintf(stderr, "passage-hook: %v\n", err)
		return 1
	}
	return 0
}

// trustRoot reads the node identity and checks where the trust root comes from: the keys
// (and their enrolments beside them) and the node UUID file must be on the sidecar
// image's own filesystem or on a read-only mount, the boot ID the kernel's procfs.
//
// KubeVirt v1.9 mounts a sidecar's PVC read-write, in the compute container too when it
// names a sharedComputePath, whatever the PV's access mode (pkg/virt-controller/services/
// template.go: the PersistentVolumeClaimVolumeSource without ReadOnly, pvcVolumeMount
// without ReadOnly), and any pod of a namespace can mount that namespace's PVC: a file
// there is what every such pod may write. The image's root filesystem is the sidecar's
// own (no other container writes it), and procfs's boot_id is the running kernel's
// random 128-bit ID, the same in every container of the node and written by none.
func (o *options) trustRoot() error {
	if o.c.Keys == "" {
		return errors.New("--pub: no keys named")
	}
	if err := trusted(o.c.Keys, o.root); err != nil {
		return fmt.Errorf("--pub %w", err)
	}
	if o.uuidFile != "" {
		if err := trusted(o.uuidFile, o.root); err != nil {
			return fmt.Errorf("--node-uuid-file %w", err)
		}
		b, err := manifest.ReadRegular(o.uuidFile, 256)
		if err != nil {
			return fmt.Errorf("--node-uuid-file %s: %w", o.uuidFile, err)
		}
		o.c.NodeUUID = strings.TrimSpace(string(b))
	}
	if o.bootIDFile != "" {
		var st unix.Statfs_t
		if err := unix.Statfs(o.bootIDFile, &st); err != nil {
			return fmt.Errorf("--boot-id-file %s: %w", o.bootIDFile, err)
		}
		if st.Type != unix.PROC_SUPER_MAGIC {
			return fmt.Errorf("--boot-id-file %s: not on procfs: only the kernel's boot_id names this boot", o.bootIDFile)
		}
		b, err := os.ReadFile(o.bootIDFile)
		if err != nil {
			return fmt.Errorf("--boot-id-file %s: %w", o.bootIDFile, err)
		}
		o.c.BootID = strings.TrimSpace(string(b))
	}
	if o.c.BootID == "" && o.c.NodeUUID == "" {
		return errors.New("no node identity: --boot-id-file and --node-uuid-file both empty")
	}
	return nil
}

// trusted: path is on the image's root filesystem (the device of root) or on a
// read-only mount.
func trusted(path, root string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if st.Flags&unix.ST_RDONLY != 0 {
		return nil
	}
	var p, r unix.Stat_t
	if err := unix.Stat(path, &p); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := unix.Stat(root, &r); err != nil {
		return fmt.Errorf("%s: image root %s: %w", path, root, err)
	}
	if p.Dev != r.Dev {
		return fmt.Errorf("%s: on a writable mount, not the image's root filesystem %s: whoever else mounts it can forge the trust root "+
			"(build the keys into the hook's image, or mount them read-only)", path, root)
	}
	return nil
}
