package main

import (
	"crypto/ecdsa"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"

	"github.com/passage-boot/passage/manifest"
)

// verifyFlags are the hypervisor's expectations of a manifest, shared by verify and
// render --manifest: one key, the lowest generation it still accepts, the boot.
type verifyFlags struct {
	pub, tpmPub, minGen, bootID string
}

func (f *verifyFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.pub, "pub", "", "public key file of the node's ed25519 key (passage keygen)")
	// -key is what image/demo.sh was written against; same as --pub.
	fs.StringVar(&f.pub, "key", "", "same as --pub")
	fs.StringVar(&f.tpmPub, "tpm-pub", "", "public key file of the node's TPM key (passage tpm-pubkey)")
	fs.StringVar(&f.minGen, "min-generation", "0", "refuse manifests with a lower generation (replay)")
	fs.StringVar(&f.bootID, "boot-id", "", "refuse manifests of another boot")
}

// options checks the flags and returns the key file and what Verify is to hold a
// manifest to; code is the exit status when they are unusable (after saying why).
func (f *verifyFlags) options(cmd string, stderr io.Writer) (keyFile string, opts manifest.VerifyOptions, code int) {
	if (f.pub == "") == (f.tpmPub == "") {
		fmt.Fprintf(stderr, "passage %s: give exactly one of --pub and --tpm-pub\n", cmd)
		return "", opts, 2
	}
	min, err := strconv.ParseUint(f.minGen, 10, 64)
	if err != nil {
		fmt.Fprintf(stderr, "passage %s: --min-generation %q: not a generation number\n", cmd, f.minGen)
		return "", opts, 2
	}
	return f.pub + f.tpmPub, manifest.VerifyOptions{MinGeneration: min, BootID: f.bootID}, 0
}

// verify reads and verifies the envelope at path. It returns the accepted manifest, or
// the exit status after printing why on stderr: 1 when the manifest is refused (the
// reason follows REFUSED), 2 for a usage error or a file that cannot be read.
func (f *verifyFlags) verify(cmd, path string, stderr io.Writer) (*manifest.Verified, int) {
	keyFile, opts, code := f.options(cmd, stderr)
	if code != 0 {
		return nil, code
	}
	v, err := manifest.LoadVerifier(keyFile)
	if err != nil {
		fmt.Fprintf(stderr, "passage %s: %v\n", cmd, err)
		return nil, 2
	}
	if _, isEC := v.Public().(*ecdsa.PublicKey); f.tpmPub != "" && !isEC {
		fmt.Fprintf(stderr, "passage %s: --tpm-pub %s: not a TPM (ECDSA P-256) key\n", cmd, keyFile)
		return nil, 2
	}
	env, err := manifest.ReadEnvelope(path)
	if err != nil {
		var ve *manifest.VerifyError
		if errors.As(err, &ve) {
			// Too large to be an envelope: refused before it is read whole.
			fmt.Fprintf(stderr, "passage %s: %s: REFUSED: %v\n", cmd, path, err)
			return nil, 1
		}
		fmt.Fprintf(stderr, "passage %s: %v\n", cmd, err)
		return nil, 2
	}
	got, err := manifest.Verify(env, v, opts)
	if err != nil {
		var ve *manifest.VerifyError
		if errors.As(err, &ve) {
			fmt.Fprintf(stderr, "passage %s: %s: REFUSED: %v\n", cmd, path, err)
			return nil, 1
		}
		fmt.Fprintf(stderr, "passage %s: %s: %v\n", cmd, path, err)
		return nil, 2
	}
	return got, 0
}
