package main

import (
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
	fs.StringVar(&f.pub, "pub", "", "public key `FILE` of the node's ed25519 key (passage keygen), or a directory of a fleet's")
	// --key means a private key elsewhere (recycle's, once); here it was --pub.
	deprecatedAlias(fs, "key", "pub")
	fs.StringVar(&f.tpmPub, "tpm-pub", "", "public key `FILE` of the node's TPM key (passage tpm-pubkey)")
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

// verify reads and verifies the envelope at path with the keyring the flags name (a key
// file, or a directory of a fleet's keys), through verifyFile as verify's many-file form
// does: one verification for verify, render and metrics. It returns the accepted
// manifest and its signer (the key's ID, file and enrolled node), or the exit status
// after printing why on stderr: 1 when the manifest is
// refused (the reason follows REFUSED), 2 for a usage error or a file that cannot be read.
func (f *verifyFlags) verify(cmd, path string, stderr io.Writer) (*manifest.Verified, string, int) {
	keyFile, opts, code := f.options(cmd, stderr)
	if code != 0 {
		return nil, "", code
	}
	kr, err := loadKeyring(keyFile, f.tpmPub != "")
	if err != nil {
		fmt.Fprintf(stderr, "passage %s: %v\n", cmd, err)
		return nil, "", 2
	}
	kr.sayIgnored(stderr, cmd, keyFile)
	o := verifyFile(path, kr, opts)
	switch {
	case o.failed != nil:
		fmt.Fprintf(stderr, "passage %s: %s: %s\n", cmd, path, oneLine(o.failed))
		return nil, "", 2
	case o.refused != nil:
		fmt.Fprintf(stderr, "passage %s: %s: REFUSED: %s\n", cmd, path, oneLine(o.refused))
		return nil, "", 1
	}
	return o.verified, o.key.signer(), 0
}
