package recycle

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path/filepath"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/stages/boot"
)

// Keys say where a running node keeps what signs, counts and attests the manifest
// generations it writes after the boot: passage recycle's and unbind's flags, the DRA
// plugin's turnaround. Paths are read beneath the node's root.
type Keys struct {
	SigningKey     string // the ed25519 private key file (/etc/passage/key)
	Dir            string // the manifest's directory (/run/passage)
	GenerationFile string // a file counter, for a node without a TPM; "": none
	TPM            string // "on", "off" or "auto" ("" is auto)
}

// ErrTPM is returned by OpenRecorder when Keys.TPM is "on" and the TPM cannot be opened.
var ErrTPM = errors.New("tpm")

// Recorder is what records a node's generations: the signers (the TPM key first, when
// there is one, then the key file), the verifier of the previous manifest, the measurer
// into PCR 13 and the counters. Close releases the TPM.
type Recorder struct {
	Dir      string // Keys.Dir beneath the root
	Signers  []manifest.Signer
	Verifier manifest.Verifier
	Measurer manifest.Measurer
	Counters []manifest.Counter
	// TPM is the TPM key that quotes and answers an enrolment; nil without a TPM.
	TPM *tpmkey.TPM
	// TPMErr is why there is no TPM (Keys.TPM auto), nil when there is one or none was
	// asked for.
	TPMErr error
	root   string
	closer io.Closer
}

// OpenRecorder reads the signing key and opens the TPM (unless Keys.TPM is "off") under
// root. A missing key file is no error when the TPM opens: it then signs alone. An error names what could not be had; errors.Is(err, ErrTPM) when it is the TPM
// that Keys.TPM "on" demands.
func OpenRecorder(root string, k Keys) (*Recorder, error) {
	// Both beneath the root: a link in the tree leads nowhere outside it.
	dir, err := boot.Beneath(root, k.Dir)
	if err != nil {
		return nil, fmt.Errorf("dir: %w", err)
	}
	r := &Recorder{Dir: dir, root: root}
	// A node that signs with its TPM may have no key file (the boot signs with what it
	// has): its absence is an error only when there is no TPM to sign instead.
	data, err := boot.ReadBeneath(root, k.SigningKey, manifest.MaxKeyFileSize)
	noKey := errors.Is(err, fs.ErrNotExist) && k.TPM != "off"
	if err != nil && !noKey {
		return nil, fmt.Errorf("signing key %s: %w", filepath.Join(root, k.SigningKey), err)
	}
	if !noKey {
		s, err := manifest.ParseSigner(k.SigningKey, data)
		if err != nil {
			return nil, err
		}
		r.Signers = append(r.Signers, s)
		if v, err := manifest.NewVerifier(s.Public()); err == nil {
			r.Verifier = v
		}
	}
	if k.TPM != "off" {
		ts, meas, err := tpmkey.ForBoot(root)
		switch {
		case err == nil:
			if c, ok := ts.(io.Closer); ok {
				r.closer = c
			}
			r.Signers = append([]manifest.Signer{ts}, r.Signers...)
			r.Measurer = meas
			r.TPM, _ = ts.(*tpmkey.TPM)
			if c, ok := ts.(manifest.Counter); ok {
				r.Counters = append(r.Counters, c)
			}
			if r.Verifier == nil && r.TPM != nil {
				// The previous generation is checked with the key that signed it.
				if v, err := manifest.NewVerifier(r.TPM.Public()); err == nil {
					r.Verifier = v
				}
			}
		case noKey:
			return nil, fmt.Errorf("signing key %s: no such file, and no TPM to sign with instead: %v", filepath.Join(root, k.SigningKey), err)
		case k.TPM == "on":
			return nil, fmt.Errorf("%w: %v", ErrTPM, err)
		default:
			r.TPMErr = err
		}
	}
	if k.GenerationFile != "" {
		r.Counters = append(r.Counters, manifest.FileCounter{Path: k.GenerationFile})
	}
	return r, nil
}

// Fill sets o's directory, signers, verifier, measurer and counters.
func (r *Recorder) Fill(o *Options) {
	o.Dir, o.Signers, o.Verifier, o.Measurer, o.Counters = r.Dir, r.Signers, r.Verifier, r.Measurer, r.Counters
}

// Attest writes the attestation of the manifest whose payload is payload (the newest
// in Dir, just measured) as the boot does (stages/boot.WriteAttestation): quoted over
// nonce, or over the payload digest when nonce is empty. It holds the node's generation
// lock (manifest.LockGenerations) while it reads the event log and quotes PCR 13, so no
// other process's generation lands between the two; a caller that holds it already (an
// Options.Attest, inside a generation's write) calls AttestHeld.
func (r *Recorder) Attest(dir string, payload, nonce []byte) error {
	if r.TPM == nil {
		return fmt.Errorf("no TPM to quote with (%v)", r.TPMErr)
	}
	lock, err := manifest.LockGenerations(context.Background(), dir, "attest", 0)
	if err != nil {
		return err
	}
	defer lock.Unlock()
	return r.AttestHeld(dir, payload, nonce)
}

// AttestHeld is Attest for a caller holding the generation lock of dir.
func (r *Recorder) AttestHeld(dir string, payload, nonce []byte) error {
	if r.TPM == nil {
		return fmt.Errorf("no TPM to quote with (%v)", r.TPMErr)
	}
	return boot.WriteAttestation(r.root, r.TPM, dir, payload, nonce)
}

// Close releases the TPM.
func (r *Recorder) Close() {
	if r.closer != nil {
		r.closer.Close()
	}
}
