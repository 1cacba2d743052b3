package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/passage-boot/passage/entropy"
	"github.com/passage-boot/passage/manifest"
)

// cmdKeygen writes an ed25519 pair for signing manifests: passage.key (PKCS #8 PEM,
// 0600; the node's passage.key=) and passage.pub (PKIX PEM; the hypervisor's --pub).
func cmdKeygen(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("keygen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("o", ".", "directory to write "+manifest.PrivateKeyFile+" and "+manifest.PublicKeyFile+" into")
	wait := fs.Duration("wait", time.Minute, "how long to wait for the kernel's random pool (a freshly booted machine may not have it yet)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage keygen [-o DIR] [-wait DUR]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "passage keygen: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), *wait)
	defer cancel()
	priv, pub, err := manifest.GenerateKeyContext(ctx, *dir, entropy.Kernel{}, func(s string) { fmt.Fprintf(stderr, "passage %s\n", s) })
	if err != nil {
		fmt.Fprintf(stderr, "passage %v\n", err)
		return 2
	}
	v, err := manifest.LoadVerifier(pub)
	if err != nil {
		fmt.Fprintf(stderr, "passage keygen: %v\n", err)
		return 2
	}
	id, _ := v.KeyID()
	fmt.Fprintf(stdout, "private key %s\npublic key  %s\nkey id      %s\n", priv, pub, id)
	return 0
}
