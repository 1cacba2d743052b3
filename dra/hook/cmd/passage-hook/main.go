// Command passage-hook is passage's KubeVirt hook sidecar: it keeps each passage unit's
// GPU, NICs and NVMe behind one virtual PCIe switch in the guest (see dra/hook).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/passage-boot/passage/dra/hook"
)

func main() {
	fs := flag.NewFlagSet("passage-hook", flag.ContinueOnError)
	var c hook.Config
	fs.StringVar(&c.Manifest, "manifest", "/run/passage/manifest.dsse.json", "the node's manifest")
	fs.StringVar(&c.Keys, "pub", "/etc/passage/keys", "enrolled public key file or directory")
	fs.BoolVar(&c.TPM, "tpm-pub", false, "the keys are TPM keys")
	fs.Uint64Var(&c.MinGeneration, "min-generation", 0, "refuse manifests of a lower generation")
	uuidFile := fs.String("node-uuid-file", "/sys/class/dmi/id/product_uuid", "this node's DMI product UUID")
	socket := fs.String("socket", "/var/run/kubevirt-hooks/passage/passage.sock", "the hook socket (one directory below /var/run/kubevirt-hooks)")
	ncclDir := fs.String("nccl-dir", "/var/run/kubevirt-hooks/passage", "where each VMI's NCCL topology file is written (empty: not written)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	b, err := os.ReadFile(*uuidFile)
	if err != nil {
		fmt.Fprintf(os.Stderr, "passage-hook: node uuid: %v\n", err)
		os.Exit(1)
	}
	c.NodeUUID = strings.TrimSpace(string(b))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	s := &hook.Server{Config: c, NCCLDir: *ncclDir, Log: log.New(os.Stderr, "passage-hook: ", 0)}
	if err := hook.Serve(ctx, *socket, s); err != nil {
		fmt.Fprintf(os.Stderr, "passage-hook: %v\n", err)
		os.Exit(1)
	}
}
