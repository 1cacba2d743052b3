// Package checkout finds files of this source tree from a program or a test running in
// it, whether or not it was built with -trimpath (which the Makefile uses, so that the
// build cache does not depend on where the clone is, and which leaves runtime.Caller a
// module path rather than a file's).
package checkout

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
)

// Module is the root module's path.
const Module = "github.com/passage-boot/passage"

// Root is the checkout's root directory: this file's, two levels up, when the build
// kept source paths; otherwise the nearest directory at or above the working directory
// whose go.mod declares Module.
func Root() (string, error) {
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..")), nil
	}
	return fromWorkingDir()
}

// fromWorkingDir is the nearest directory at or above the working directory whose
// go.mod declares Module.
func fromWorkingDir() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("checkout: %w", err)
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if declares(filepath.Join(dir, "go.mod")) {
			return dir, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("checkout: no go.mod of %s at or above %s", Module, wd)
		}
	}
}

// Path is rel (slash-separated, from the checkout's root) in the checkout.
func Path(rel string) (string, error) {
	root, err := Root()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, filepath.FromSlash(rel)), nil
}

// declares reports whether the go.mod at path declares Module.
func declares(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if m, ok := strings.CutPrefix(strings.TrimSpace(s.Text()), "module "); ok {
			return strings.Trim(strings.TrimSpace(m), `"`) == Module
		}
	}
	return false
}
