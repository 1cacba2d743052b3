package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/passage-boot/passage/entropy"
	"github.com/passage-boot/passage/manifest"
)

// cmdKeygen writes an ed25519 pair for signing manifests: passage.key (PKCS #8 PEM,
// 0600; the node's passage.key=) and passage.pub (PKIX PEM; the hypervisor's --pub).
func cmdKeygen(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("keygen", stderr)
	dir := fs.String("o", ".", "`DIR` to write "+manifest.PrivateKeyFile+" and "+manifest.PublicKeyFile+" into, created (mode 0700) when missing")
	wait := fs.Duration("wait", time.Minute, "how long to wait for the kernel's random pool (a freshly booted machine may not have it yet)")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	// The private key's directory is no one else's business: 0700, as ssh-keygen makes ~/.ssh.
	if err := os.MkdirAll(*dir, 0o700); err != nil {
		fmt.Fprintf(stderr, "passage keygen: %v\n", err)
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
