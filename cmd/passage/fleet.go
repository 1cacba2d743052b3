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
// names: each node signs with its own key).
type keyring struct {
	byID map[string]manifest.Verifier
	one  manifest.Verifier
	// ignored are the directory's files that are not (TPM, with tpm) public keys: the
	// node's private key beside its public one, a README.
	ignored []string
}

// loadKeyring reads path: a key file, or every regular file in a directory that is a
// public key (the others are ignored, and named in kr.ignored). With tpm, each must be
// a TPM (ECDSA P-256) key.
func loadKeyring(path string, tpm bool) (*keyring, error) {
	load := func(p string) (manifest.Verifier, error) {
		v, err := manifest.LoadVerifier(p)
		if err != nil {
			return nil, err
		}
		if _, isEC := v.Public().(*ecdsa.PublicKey); tpm && !isEC {
			return nil, fmt.Errorf("--tpm-pub %s: not a TPM (ECDSA P-256) key", p)
		}
		return v, nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("public key %s: %w", path, err)
	}
	if !fi.IsDir() {
		v, err := load(path)
		if err != nil {
			return nil, err
		}
		return &keyring{one: v}, nil
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("public keys %s: %w", path, err)
	}
	kr := &keyring{byID: map[string]manifest.Verifier{}}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		v, err := load(filepath.Join(path, e.Name()))
		if err != nil {
			kr.ignored = append(kr.ignored, e.Name())
			continue
		}
		id, err := v.KeyID()
		if err != nil {
			return nil, fmt.Errorf("public key %s: %w", filepath.Join(path, e.Name()), err)
		}
		kr.byID[id] = v
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

// verifier picks the key for an envelope: the one key, or the first of the envelope's
// signatures' key IDs the ring holds. None: the envelope is refused as signed by a key
// the fleet does not know.
func (kr *keyring) verifier(env []byte) (manifest.Verifier, error) {
	if kr.one != nil {
		return kr.one, nil
	}
	var e manifest.Envelope
	if err := json.Unmarshal(env, &e); err != nil {
		return nil, &manifest.VerifyError{Kind: manifest.ErrMalformed, Detail: err.Error()}
	}
	var ids []string
	for _, s := range e.Signatures {
		if v, ok := kr.byID[s.KeyID]; ok {
			return v, nil
		}
		ids = append(ids, s.KeyID)
	}
	return nil, &manifest.VerifyError{Kind: manifest.ErrWrongKey, Detail: fmt.Sprintf("signed by %s, none of them in the key directory", strings.Join(ids, ", "))}
}

// verifyOutcome is one file's result.
type verifyOutcome struct {
	path     string
	verified *manifest.Verified
	refused  error // the manifest is not acceptable (exit 1)
	failed   error // the file could not be read (exit 2)
}

// verifyFile reads and verifies one envelope.
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
	v, err := kr.verifier(env)
	if err == nil {
		o.verified, err = manifest.Verify(env, v, opts)
	}
	if err != nil {
		if errors.As(err, &ve) {
			o.refused = err
		} else {
			o.failed = err
		}
	}
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
			fmt.Fprintf(&b, "OK       %s: %s gen %d (%s) boot %s units %d ready %d degraded %d failed%s build %s\n",
				o.path, orDash(m.Node.Hostname), m.Generation, m.GenerationSource, orDash(m.BootID),
				c[manifest.StatusReady], c[manifest.StatusDegraded], c[manifest.StatusFailed], failedUnits(m), buildWords(m))
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
			s = append(s, u.ID+"="+u.Status)
		}
	}
	if len(s) == 0 {
		return ""
	}
	return ": " + strings.Join(s, " ")
}

func oneLine(err error) string { return strings.ReplaceAll(err.Error(), "\n", "; ") }
