package main

import (
	"flag"
	"fmt"
	"io"
	"path/filepath"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/stages/boot"
)

// recordFlags say how recycle and unbind sign the manifest generations they write: the
// key, the manifest's directory, the counters.
type recordFlags struct {
	key, dir, genFile, tpm string
}

func (f *recordFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.key, "signing-key", "/etc/passage/key", "the ed25519 private key `FILE` that signs the new generations (and verifies the previous one), read under --root: /etc/passage/key is <root>/etc/passage/key")
	deprecatedAlias(fs, "key", "signing-key")
	fs.StringVar(&f.dir, "dir", initramfs.RunDir, "directory of the manifest to replace, under --root")
	fs.StringVar(&f.genFile, "generation-file", "", "file generation counter, when the node has no TPM (without a TPM counter or this, nothing is signed)")
	fs.StringVar(&f.tpm, "tpm", "auto", "on, off or auto: sign with and count generations in the TPM")
}

// apply fills o's signers, verifier, measurer and counters, all read under root. done
// releases the TPM; code is the exit status when they cannot be had (after saying why).
func (f *recordFlags) apply(cmd, root string, o *recycle.Options, stderr io.Writer) (done func(), code int) {
	done = func() {}
	// Both beneath the root: a link in the tree leads nowhere outside it.
	dir, err := boot.Beneath(root, f.dir)
	if err != nil {
		fmt.Fprintf(stderr, "passage %s: --dir: %v\n", cmd, err)
		return done, 2
	}
	o.Dir = dir
	data, err := boot.ReadBeneath(root, f.key, manifest.MaxKeyFileSize)
	if err != nil {
		err = fmt.Errorf("--signing-key %s: %w", filepath.Join(root, f.key), err)
	}
	var s *manifest.Ed25519Signer
	if err == nil {
		s, err = manifest.ParseSigner(f.key, data)
	}
	if err != nil {
		fmt.Fprintf(stderr, "passage %s: %v\n", cmd, err)
		return done, 2
	}
	o.Signers = append(o.Signers, s)
	if v, err := manifest.NewVerifier(s.Public()); err == nil {
		o.Verifier = v
	}
	if f.tpm != "off" {
		ts, meas, err := tpmkey.ForBoot(root)
		switch {
		case err == nil:
			if c, ok := ts.(io.Closer); ok {
				done = func() { c.Close() }
			}
			o.Signers = append([]manifest.Signer{ts}, o.Signers...)
			o.Measurer = meas
			if k, ok := ts.(*tpmkey.TPM); ok {
				// Each generation is attested as the boot attests its manifest: over its
				// payload digest (offline; recycle has no control plane to ask).
				o.Attest = func(dir string, signed *manifest.Signed) error {
					return boot.WriteAttestation(root, k, dir, signed.Payload, nil)
				}
			}
			if c, ok := ts.(manifest.Counter); ok {
				o.Counters = append(o.Counters, c)
			}
		case f.tpm == "on":
			fmt.Fprintf(stderr, "passage %s: --tpm on: %v\n", cmd, err)
			return done, 1
		}
	}
	if f.genFile != "" {
		o.Counters = append(o.Counters, manifest.FileCounter{Path: f.genFile})
	}
	return done, 0
}
