package main

import (
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
	fs := newFlags("tpm-pubkey", stderr)
	dev := fs.String("tpm-device", tpmkey.DefaultDevice, "the TPM character `DEVICE`")
	// --tpm is a choice (on, off, auto) in recycle; here it was the device.
	deprecatedAlias(fs, "tpm", "tpm-device")
	out := fs.String("o", "", "write the PEM to `FILE` instead of stdout")
	var en enrolFlags
	en.register(fs)
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
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
