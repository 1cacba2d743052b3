package main

import (
	"bytes"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"

	"github.com/passage-boot/passage/manifest"
)

// keyring is the verifying keys of a fleet: one public key file (every manifest must be
// signed by it), or a directory of them (each manifest by the key whose ID its envelope
// names: each node signs with its own key). In a directory every key is enrolled for a
// node (manifest.Enrolment, KEY.enrol.json beside KEY.pub) and a manifest is accepted
// only with its own node's key; beside a key file named alone, an enrolment is checked
// when there is one.
type keyring struct {
	byID map[string]*ringKey
	one  *ringKey
	// ignored are the directory's files that are not (TPM, with tpm) public keys: the
	// node's private key beside its public one, a README. A public key there is not
	// ignored: without its enrolment the directory is refused.
	ignored []string
}

// ringKey is one key of the ring: its file and the node it is enrolled for.
type ringKey struct {
	v     manifest.Verifier
	id    string
	file  string
	enrol *manifest.Enrolment // nil: not enrolled
}

// signer names the key for every output: its ID, its file and its node.
func (k *ringKey) signer() string {
	s := k.id + " (" + filepath.Base(k.file)
	if k.enrol != nil {
		s += ", enrolled for " + k.enrol.String()
	}
	return s + ")"
}

// notKeyError is the error of a file that holds no (TPM, with tpm) public key, which a
// key directory ignores. A file it cannot read within the bounds, a damaged key and a
// key without its enrolment are errors: the directory is refused.
type notKeyError struct{ err error }

func (e notKeyError) Error() string { return e.err.Error() }
func (e notKeyError) Unwrap() error { return e.err }

// loadKeyring reads path: a key file, or every regular file in a directory that is a
// public key (the *.enrol.json files are the keys' enrolments; the others are ignored,
// and named in kr.ignored). With tpm, each key must be a TPM (ECDSA P-256) key.
func loadKeyring(path string, tpm bool) (*keyring, error) {
	load := func(p string, dir bool) (*ringKey, error) {
		v, err := manifest.LoadVerifier(p)
		if errors.Is(err, manifest.ErrNoPublicKey) {
			return nil, notKeyError{err}
		}
		if err != nil {
			return nil, err
		}
		if _, isEC := v.Public().(*ecdsa.PublicKey); tpm && !isEC {
			return nil, notKeyError{fmt.Errorf("--tpm-pub %s: not a TPM (ECDSA P-256) key", p)}
		}
		k := &ringKey{v: v, file: p}
		if k.id, err = v.KeyID(); err != nil {
			return nil, fmt.Errorf("public key %s: %w", p, err)
		}
		ep := manifest.EnrolmentPath(p)
		if _, err := os.Lstat(ep); err != nil {
			if dir || !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("public key %s: not enrolled for a node: %w", p, err)
			}
			return k, nil
		}
		if k.enrol, err = manifest.LoadEnrolment(ep, v); err != nil {
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
		return &keyring{one: k}, nil
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("public keys %s: %w", path, err)
	}
	kr := &keyring{byID: map[string]*ringKey{}}
	for _, e := range ents {
		if !e.Type().IsRegular() || strings.HasSuffix(e.Name(), manifest.EnrolmentSuffix) {
			continue
		}
		k, err := load(filepath.Join(path, e.Name()), true)
		if errors.As(err, new(notKeyError)) {
			kr.ignored = append(kr.ignored, e.Name())
			continue
		}
		if err != nil {
			return nil, err
		}
		if other, dup := kr.byID[k.id]; dup {
			return nil, fmt.Errorf("public keys %s: key %s is both %s and %s", path, k.id, filepath.Base(other.file), e.Name())
		}
		kr.byID[k.id] = k
	}
	if len(kr.byID) == 0 {
		if len(kr.ignored) > 0 {
			return nil, fmt.Errorf("public keys %s: no public key among %s", path, strings.Join(kr.ignored, ", "))
		}
		return nil, fmt.Errorf("public keys %s: no key files", path)
	}
	return kr, nil
}

// sayIgnored names, once, the files of a key directory that are not public keys.
func (kr *keyring) sayIgnored(w io.Writer, cmd, path string) {
	if len(kr.ignored) > 0 {
		fmt.Fprintf(w, "passage %s: %s: ignored, not public keys: %s\n", cmd, path, strings.Join(kr.ignored, ", "))
	}
}

// key picks the key for an envelope: the one key, or the first of the envelope's
// signatures' key IDs the ring holds. None: the envelope is refused as signed by a key
// the fleet does not know.
func (kr *keyring) key(env []byte) (*ringKey, error) {
	if kr.one != nil {
		return kr.one, nil
	}
	var e manifest.Envelope
	if err := json.Unmarshal(env, &e); err != nil {
		return nil, &manifest.VerifyError{Kind: manifest.ErrMalformed, Detail: err.Error()}
	}
	var ids []string
	for _, s := range e.Signatures {
		if k, ok := kr.byID[s.KeyID]; ok {
			return k, nil
		}
		ids = append(ids, s.KeyID)
	}
	return nil, &manifest.VerifyError{Kind: manifest.ErrWrongKey, Detail: fmt.Sprintf("signed by %s, none of them in the key directory", strings.Join(ids, ", "))}
}

// verifyOutcome is one file's result.
type verifyOutcome struct {
	path     string
	verified *manifest.Verified
	key      *ringKey // the key that verified it
	refused  error    // the manifest is not acceptable (exit 1)
	failed   error    // the file could not be read (exit 2)
}

// verifyFile reads and verifies one envelope: the signature with its key, then that the
// manifest's node is the one the key is enrolled for.
func verifyFile(path string, kr *keyring, opts manifest.VerifyOptions) verifyOutcome {
	o := verifyOutcome{path: path}
	var ve *manifest.VerifyError
	env, err := manifest.ReadEnvelope(path)
	if err != nil {
		if errors.As(err, &ve) {
			o.refused = err
		} else {
			o.failed = err
		}
		return o
	}
	k, err := kr.key(env)
	if err == nil {
		o.verified, err = manifest.Verify(env, k.v, opts)
	}
	if err == nil && k.enrol != nil {
		err = k.enrol.Check(o.verified.Manifest)
	}
	if err != nil {
		o.verified = nil
		if errors.As(err, &ve) {
			o.refused = err
		} else {
			o.failed = err
		}
		return o
	}
	o.key = k
	return o
}

// manifestFiles expands the arguments: a file is itself; a directory is every *.dsse.json
// below it, in name order.
func manifestFiles(args []string) ([]string, error) {
	var out []string
	for _, a := range args {
		fi, err := os.Stat(a)
		if err != nil {
			return nil, err
		}
		if !fi.IsDir() {
			out = append(out, a)
			continue
		}
		var found []string
		err = filepath.WalkDir(a, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.Type().IsRegular() && strings.HasSuffix(d.Name(), ".dsse.json") {
				found = append(found, p)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		if len(found) == 0 {
			return nil, fmt.Errorf("%s: no *.dsse.json manifests in it", a)
		}
		sort.Strings(found)
		out = append(out, found...)
	}
	return out, nil
}

// manyPaths says whether verify was given a fleet's manifests (several, or a directory)
// rather than one file.
func manyPaths(paths []string) bool {
	if len(paths) != 1 {
		return len(paths) > 1
	}
	fi, err := os.Stat(paths[0])
	return err == nil && fi.IsDir()
}

// verifyMany verifies the files in parallel (one worker per CPU), prints one line per
// manifest in argument order and a summary. Exit 0 when every manifest verified, 1 when
// one was refused, 2 when one could not be read (or bad usage).
func verifyMany(args []string, keyPath string, tpm bool, opts manifest.VerifyOptions, stdout, stderr io.Writer) int {
	paths, err := manifestFiles(args)
	if err != nil {
		fmt.Fprintf(stderr, "passage verify: %v\n", err)
		return 2
	}
	kr, err := loadKeyring(keyPath, tpm)
	if err != nil {
		fmt.Fprintf(stderr, "passage verify: %v\n", err)
		return 2
	}
	kr.sayIgnored(stderr, "verify", keyPath)
	out := make([]verifyOutcome, len(paths))
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(paths)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				out[i] = verifyFile(paths[i], kr, opts)
			}
		}()
	}
	for i := range paths {
		next <- i
	}
	close(next)
	wg.Wait()

	var b bytes.Buffer
	ok, refused, unreadable := 0, 0, 0
	units := map[string]int{}
	nodesWithFailed := 0
	for _, o := range out {
		switch {
		case o.failed != nil:
			unreadable++
			fmt.Fprintf(&b, "ERROR    %s: %s\n", o.path, oneLine(o.failed))
		case o.refused != nil:
			refused++
			fmt.Fprintf(&b, "REFUSED  %s: %s\n", o.path, oneLine(o.refused))
		default:
			ok++
			m := o.verified.Manifest
			c := map[string]int{}
			for _, u := range m.Units {
				c[u.Status]++
				units[u.Status]++
			}
			if c[manifest.StatusFailed] > 0 {
				nodesWithFailed++
			}
			fmt.Fprintf(&b, "OK       %s: %s gen %d (%s) boot %s signed by %s units %d ready %d degraded %d failed%s build %s\n",
				o.path, pr(orDash(m.Node.Hostname)), m.Generation, pr(string(m.GenerationSource)), pr(orDash(m.BootID)), pr(filepath.Base(o.key.file)),
				c[manifest.StatusReady], c[manifest.StatusDegraded], c[manifest.StatusFailed], failedUnits(m), pr(buildWords(m)))
		}
	}
	fmt.Fprintf(&b, "%d manifests: %d verified, %d refused, %d unreadable; units %d ready, %d degraded, %d failed%s\n",
		len(out), ok, refused, unreadable, units[manifest.StatusReady], units[manifest.StatusDegraded], units[manifest.StatusFailed], onNodes(nodesWithFailed))
	stdout.Write(b.Bytes())
	switch {
	case unreadable > 0:
		return 2
	case refused > 0:
		return 1
	}
	return 0
}

// onNodes says on how many nodes the failed units are, when there are any.
func onNodes(n int) string {
	switch n {
	case 0:
		return ""
	case 1:
		return " (on 1 node)"
	}
	return fmt.Sprintf(" (on %d nodes)", n)
}

// buildWords is the build that signed m on a fleet line: version and revision.
func buildWords(m *manifest.Manifest) string {
	if m.Build == nil {
		return "unknown"
	}
	return m.Build.VersionString() + " " + m.Build.Rev()
}

// failedUnits names the units that are not ready, for the node's line.
func failedUnits(m *manifest.Manifest) string {
	var s []string
	for _, u := range m.Units {
		if u.Status != manifest.StatusReady {
			s = append(s, pr(u.ID)+"="+pr(u.Status))
		}
	}
	if len(s) == 0 {
		return ""
	}
	return ": " + strings.Join(s, " ")
}

// oneLine is an error for one line of output: its lines joined, and nothing in it a
// terminal would act on (manifest.Printable).
func oneLine(err error) string { return pr(strings.ReplaceAll(err.Error(), "\n", "; ")) }

// pr is manifest.Printable: every string a payload or a file name brings is printed
// through it.
func pr(s string) string { return manifest.Printable(s) }
