package main

import (
	"flag"
	"fmt"
	"io"
	"path/filepath"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// cmdTPMPubkey prints the public part of the TPM-resident signing key as a PEM "PUBLIC
// KEY", the file `passage verify --tpm-pub` reads. The key is derived from the owner
// seed and a fixed template, so this prints the same key on every boot of the node.
func cmdTPMPubkey(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("tpm-pubkey", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dev := fs.String("tpm", tpmkey.DefaultDevice, "TPM character device")
	out := fs.String("o", "", "write the PEM to this file instead of stdout")
	var en enrolFlags
	en.register(fs)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage tpm-pubkey [--tpm DEVICE] [-o FILE [--enrol [--root DIR] [--enrol-hostname]]]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "passage tpm-pubkey: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if en.enrol && *out == "" {
		fmt.Fprintln(stderr, "passage tpm-pubkey: --enrol writes beside the key file: give -o FILE")
		return 2
	}
	k, err := tpmkey.Open(*dev)
	if err != nil {
		fmt.Fprintf(stderr, "passage tpm-pubkey: %v\n", err)
		return 2
	}
	defer k.Close()
	pemBytes, err := k.PublicKeyPEM()
	if err != nil {
		fmt.Fprintf(stderr, "passage tpm-pubkey: %v\n", err)
		return 2
	}
	if *out == "" {
		stdout.Write(pemBytes)
		return 0
	}
	if err := manifest.WriteAtomic(filepath.Dir(*out), filepath.Base(*out), pemBytes); err != nil {
		fmt.Fprintf(stderr, "passage tpm-pubkey: %v\n", err)
		return 2
	}
	id, _ := k.KeyID()
	fmt.Fprintf(stdout, "public key %s\nkey id     %s\n", *out, id)
	return en.write("tpm-pubkey", *out, id, stdout, stderr)
}
