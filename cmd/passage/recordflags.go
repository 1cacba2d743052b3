package main

import (
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/recycle"
)

// recordFlags say how recycle and unbind sign the manifest generations they write: the
// key, the manifest's directory, the counters.
type recordFlags struct {
	key, dir, genFile, tpm, nonce string
}

func (f *recordFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.key, "signing-key", "/etc/passage/key", "the ed25519 private key `FILE` that signs the new generations (and verifies the previous one), read under --root: /etc/passage/key is <root>/etc/passage/key")
	deprecatedAlias(fs, "key", "signing-key")
	fs.StringVar(&f.dir, "dir", initramfs.RunDir, "directory of the manifest to replace, under --root")
	fs.StringVar(&f.genFile, "generation-file", "", "file generation counter, when the node has no TPM (without a TPM counter or this, nothing is signed)")
	fs.StringVar(&f.tpm, "tpm", "auto", "on, off or auto: sign with and count generations in the TPM")
	fs.StringVar(&f.nonce, "nonce", "", "the verifier's nonce `HEX` (passage attest nonce; 1 to 64 bytes): each generation's attestation is quoted over it, for a verifier that accepts only nonces it issued (verify --attest --nonces); without it, over the generation's payload digest")
}

// apply fills o's signers, verifier, measurer and counters, all read under root
// (recycle.OpenRecorder). done releases the TPM; code is the exit status when they
// cannot be had (after saying why).
func (f *recordFlags) apply(cmd, root string, o *recycle.Options, stderr io.Writer) (done func(), code int) {
	done = func() {}
	var nonce []byte
	if f.nonce != "" {
		var err error
		if nonce, err = hex.DecodeString(f.nonce); err != nil || len(nonce) == 0 || len(nonce) > 64 {
			fmt.Fprintf(stderr, "passage %s: --nonce %q: want 1 to 64 bytes of hex\n", cmd, f.nonce)
			return done, 2
		}
		if f.tpm == "off" {
			fmt.Fprintf(stderr, "passage %s: --nonce with --tpm off: only the TPM quotes over a nonce\n", cmd)
			return done, 2
		}
	}
	rec, err := recycle.OpenRecorder(root, recycle.Keys{SigningKey: f.key, Dir: f.dir, GenerationFile: f.genFile, TPM: f.tpm})
	switch {
	case errors.Is(err, recycle.ErrTPM):
		fmt.Fprintf(stderr, "passage %s: --tpm on: %v\n", cmd, err)
		return done, 1
	case err != nil:
		fmt.Fprintf(stderr, "passage %s: %v\n", cmd, err)
		return done, 2
	}
	done = rec.Close
	rec.Fill(o)
	switch {
	case rec.TPM != nil:
		// Each generation is attested as the boot attests its manifest: over the
		// verifier's nonce when the operator brought one, else over its payload digest
		// (offline: the attestation says which).
		o.Attest = func(dir string, signed *manifest.Signed) error {
			return rec.AttestHeld(dir, signed.Payload, nonce) // within the generation's write
		}
	case nonce != nil:
		fmt.Fprintf(stderr, "passage %s: --nonce: no TPM to quote with: %v\n", cmd, rec.TPMErr)
		return done, 1
	}
	return done, 0
}

// unattested reports why a generation the command signed has no attestation although
// the TPM was to make one (recycle's Result.Unattested, recycle.Withdraw's) and returns
// the exit status it calls for: 1 when the operator brought a verifier's nonce (the
// verifier waits for an attestation over it, and without one the command did not do
// what was asked), else 0. Recycle and unbind both come here, so neither can exit 0
// on a --nonce it did not answer.
func (f *recordFlags) unattested(cmd string, why error, stderr io.Writer) int {
	if why == nil {
		return 0
	}
	fmt.Fprintf(stderr, "passage %s: %v\n", cmd, why)
	if f.nonce != "" {
		return 1
	}
	return 0
}
