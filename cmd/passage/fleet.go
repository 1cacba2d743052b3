package main

import (
	"bytes"
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

// sayIgnored names, once, the files of a key directory that are not public keys.
func sayIgnored(kr *manifest.Keyring, w io.Writer, cmd, path string) {
	if len(kr.Ignored) > 0 {
		fmt.Fprintf(w, "passage %s: %s: ignored, not public keys: %s\n", cmd, path, strings.Join(kr.Ignored, ", "))
	}
}

// verifyOutcome is one file's result.
type verifyOutcome struct {
	path     string
	verified *manifest.Verified
	key      *manifest.RingKey // the key that verified it
	refused  error             // the manifest is not acceptable (exit 1)
	failed   error             // the file could not be read (exit 2)
}

// verifyFile verifies one envelope through the keyring (manifest.Keyring.VerifyFile: the
// signature with its key, then the node binding) and sorts the error: refused or
// unreadable.
func verifyFile(path string, kr *manifest.Keyring, opts manifest.VerifyOptions) verifyOutcome {
	o := verifyOutcome{path: path}
	v, k, err := kr.VerifyFile(path, opts)
	var ve *manifest.VerifyError
	switch {
	case err == nil:
		o.verified, o.key = v, k
	case errors.As(err, &ve):
		o.refused = err
	default:
		o.failed = err
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
	kr, err := manifest.LoadKeyring(keyPath, tpm)
	if err != nil {
		fmt.Fprintf(stderr, "passage verify: %v\n", err)
		return 2
	}
	sayIgnored(kr, stderr, "verify", keyPath)
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
				o.path, pr(orDash(m.Node.Hostname)), m.Generation, pr(string(m.GenerationSource)), pr(orDash(m.BootID)), pr(filepath.Base(o.key.File)),
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
