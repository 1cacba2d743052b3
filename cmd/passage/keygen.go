package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/passage-boot/passage/entropy"
	"github.com/passage-boot/passage/manifest"
)

// cmdKeygen writes an ed25519 pair for signing manifests: passage.key (PKCS #8 PEM,
// 0600; the node's passage.key=) and passage.pub (PKIX PEM; the hypervisor's --pub);
// with --enrol also passage.enrol.json, the key's enrolment for this node.
func cmdKeygen(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("keygen", stderr)
	dir := fs.String("o", ".", "`DIR` to write "+manifest.PrivateKeyFile+" and "+manifest.PublicKeyFile+" into, created (mode 0700) when missing")
	wait := fs.Duration("wait", time.Minute, "how long to wait for the kernel's random pool (a freshly booted machine may not have it yet)")
	var en enrolFlags
	en.register(fs)
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
	return en.write("keygen", pub, id, stdout, stderr)
}

// enrolFlags are keygen's and tpm-pubkey's --enrol: record, beside the public key, the
// node it is enrolled for (manifest.Enrolment), read from the node's DMI under --root.
type enrolFlags struct {
	enrol, hostname bool
	root            string
}

func (f *enrolFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&f.enrol, "enrol", false, "also write KEY.enrol.json beside the public key: the key enrolled for this node (DMI UUID and serial), for a hypervisor's key directory")
	fs.StringVar(&f.root, "root", "/", "with --enrol: read the node's identity under `DIR`")
	fs.BoolVar(&f.hostname, "enrol-hostname", false, "with --enrol: hold the hostname too (a manifest with another is refused)")
}

// write writes the enrolment of key id (public key file pub) when --enrol is given.
func (f *enrolFlags) write(cmd, pub, id string, stdout, stderr io.Writer) int {
	if !f.enrol {
		return 0
	}
	node, err := manifest.ReadNode(f.root)
	if err == nil {
		var e *manifest.Enrolment
		if e, err = manifest.NewEnrolment(id, node, f.hostname); err == nil {
			var path string
			if path, err = manifest.WriteEnrolment(pub, e); err == nil {
				fmt.Fprintf(stdout, "enrolment   %s (%s)\n", path, e)
				return 0
			}
		}
	}
	fmt.Fprintf(stderr, "passage %s: --enrol: %v\n", cmd, err)
	return 2
}
