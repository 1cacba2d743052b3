package manifest

import (
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Keyring is the verifying keys of a fleet: one public key file (every manifest must be
// signed by it), or a directory of them (each manifest by the key whose ID its envelope
// names: each node signs with its own key). In a directory every key is enrolled for a
// node (Enrolment, KEY.enrol.json beside KEY.pub) and a manifest is accepted only with
// its own node's key; beside a key file named alone, an enrolment is checked when there
// is one. It is the one verification path of every reader of manifests: passage verify,
// render and metrics, and the DRA driver (its own module) all verify through VerifyFile.
type Keyring struct {
	byID map[string]*RingKey
	one  *RingKey
	// Ignored are the directory's files that are not (TPM, with tpm) public keys: the
	// node's private key beside its public one, a README. A public key there is not
	// ignored: without its enrolment the directory is refused.
	Ignored []string
}

// RingKey is one key of the ring: its file and the node it is enrolled for.
type RingKey struct {
	Verifier *PublicKeyVerifier
	ID       string
	File     string
	Enrol    *Enrolment // nil: not enrolled
}

// Signer names the key for every output: its ID, its file and its node.
func (k *RingKey) Signer() string {
	s := k.ID + " (" + filepath.Base(k.File)
	if k.Enrol != nil {
		s += ", enrolled for " + k.Enrol.String()
	}
	return s + ")"
}

// notKeyError is the error of a file that holds no (TPM, with tpm) public key, which a
// key directory ignores. A file it cannot read within the bounds, a damaged key and a
// key without its enrolment are errors: the directory is refused.
type notKeyError struct{ err error }

func (e notKeyError) Error() string { return e.err.Error() }
func (e notKeyError) Unwrap() error { return e.err }

// LoadKeyring reads path: a key file, or every regular file in a directory that is a
// public key (the *.enrol.json files are the keys' enrolments; the others are ignored,
// and named in Ignored). With tpm, each key must be a TPM (ECDSA P-256) key.
func LoadKeyring(path string, tpm bool) (*Keyring, error) {
	load := func(p string, dir bool) (*RingKey, error) {
		v, err := LoadVerifier(p)
		if errors.Is(err, ErrNoPublicKey) {
			return nil, notKeyError{err}
		}
		if err != nil {
			return nil, err
		}
		if _, isEC := v.Public().(*ecdsa.PublicKey); tpm && !isEC {
			return nil, notKeyError{fmt.Errorf("--tpm-pub %s: not a TPM (ECDSA P-256) key", p)}
		}
		k := &RingKey{Verifier: v, File: p}
		if k.ID, err = v.KeyID(); err != nil {
			return nil, fmt.Errorf("public key %s: %w", p, err)
		}
		ep := EnrolmentPath(p)
		if _, err := os.Lstat(ep); err != nil {
			if dir || !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("public key %s: not enrolled for a node: %w", p, err)
			}
			return k, nil
		}
		if k.Enrol, err = LoadEnrolment(ep, v); err != nil {
			return nil, err
		}
		return k, nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("public key %s: %w", path, err)
	}
	if !fi.IsDir() {
		k, err := load(path, false)
		if err != nil {
			return nil, err
		}
		return &Keyring{one: k}, nil
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("public keys %s: %w", path, err)
	}
	kr := &Keyring{byID: map[string]*RingKey{}}
	for _, e := range ents {
		if !e.Type().IsRegular() || strings.HasSuffix(e.Name(), EnrolmentSuffix) {
			continue
		}
		k, err := load(filepath.Join(path, e.Name()), true)
		if errors.As(err, new(notKeyError)) {
			kr.Ignored = append(kr.Ignored, e.Name())
			continue
		}
		if err != nil {
			return nil, err
		}
		if other, dup := kr.byID[k.ID]; dup {
			return nil, fmt.Errorf("public keys %s: key %s is both %s and %s", path, k.ID, filepath.Base(other.File), e.Name())
		}
		kr.byID[k.ID] = k
	}
	if len(kr.byID) == 0 {
		if len(kr.Ignored) > 0 {
			return nil, fmt.Errorf("public keys %s: no public key among %s", path, strings.Join(kr.Ignored, ", "))
		}
		return nil, fmt.Errorf("public keys %s: no key files", path)
	}
	return kr, nil
}

// key picks the key for an envelope: the one key, or the first of the envelope's
// signatures' key IDs the ring holds. None: the envelope is refused as signed by a key
// the fleet does not know.
func (kr *Keyring) key(env []byte) (*RingKey, error) {
	if kr.one != nil {
		return kr.one, nil
	}
	var e Envelope
	if err := json.Unmarshal(env, &e); err != nil {
		return nil, &VerifyError{Kind: ErrMalformed, Detail: err.Error()}
	}
	var ids []string
	for _, s := range e.Signatures {
		if k, ok := kr.byID[s.KeyID]; ok {
			return k, nil
		}
		ids = append(ids, s.KeyID)
	}
	return nil, &VerifyError{Kind: ErrWrongKey, Detail: fmt.Sprintf("signed by %s, none of them in the key directory", strings.Join(ids, ", "))}
}

// VerifyFile reads and verifies one envelope: the signature with its key (Verify, which
// also runs Check), then that the manifest's node is the one the key is enrolled for. A
// manifest that is not acceptable is an error holding a *VerifyError (errors.As); any
// other error is a file that could not be read.
func (kr *Keyring) VerifyFile(path string, opts VerifyOptions) (*Verified, *RingKey, error) {
	env, err := ReadEnvelope(path)
	if err != nil {
		return nil, nil, err
	}
	return kr.Verify(env, opts)
}

// Verify is VerifyFile of envelope bytes already read: for a reader that passes on
// exactly the bytes it verified (passage-dra's export for the KubeVirt hook), where
// reading the file twice could verify one version and pass on another.
func (kr *Keyring) Verify(env []byte, opts VerifyOptions) (*Verified, *RingKey, error) {
	if len(env) > MaxEnvelopeSize {
		return nil, nil, verr(ErrMalformed, "envelope is %d bytes, over the %s limit", len(env), sizeLimit)
	}
	k, err := kr.key(env)
	if err != nil {
		return nil, nil, err
	}
	v, err := Verify(env, k.Verifier, opts)
	if err != nil {
		return nil, nil, err
	}
	if k.Enrol != nil {
		if err := k.Enrol.Check(v.Manifest); err != nil {
			return nil, nil, err
		}
	}
	return v, k, nil
}
