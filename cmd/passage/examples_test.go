package main

import (
	"bufio"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

var updateExamples = flag.Bool("update-examples", false, "rewrite examples/*.tar.gz from pcitest's reference trees")

// examples are the snapshots in the repository's examples/ and the reference trees they
// were taken from.
var examples = []struct {
	file string
	spec func() pcitest.Spec
}{
	{"b300.tar.gz", pcitest.B300},
	{"b200.tar.gz", pcitest.B200},
}

// TestExamplesAreTheReferenceTrees checks that each snapshot in examples/ reads back as the
// tree pcitest builds today (go test -run TestExamplesAreTheReferenceTrees
// -update-examples ./cmd/passage/ rewrites them when the reference changes).
func TestExamplesAreTheReferenceTrees(t *testing.T) {
	for _, ex := range examples {
		t.Run(ex.file, func(t *testing.T) {
			n := pcitest.New(t, ex.spec())
			path := filepath.Join("..", "..", "examples", ex.file)
			if *updateExamples {
				if _, err := writeSnapshotFile(path, n.Root); err != nil {
					t.Fatal(err)
				}
			}
			code, live, errs := runCmd(t, cmdInspect, "--root", n.Root, "--json")
			if code != 0 {
				t.Fatalf("inspect --root: %d %s", code, errs)
			}
			code, snap, errs := runCmd(t, cmdInspect, "--snapshot", path, "--json")
			if code != 0 {
				t.Fatalf("inspect --snapshot %s: %d %s", path, code, errs)
			}
			if live != snap {
				t.Errorf("%s is not the reference tree any more: rewrite it with -update-examples", path)
			}
			tree, err := pci.ReadSnapshot(path)
			if err != nil {
				t.Fatal(err)
			}
			if len(tree.Devices) != len(n.Names) {
				t.Errorf("%s: %d functions, the reference has %d", path, len(tree.Devices), len(n.Names))
			}
		})
	}
}

// TestReadmeTryIt runs every passage command of the README's "Try it" section from the
// repository root, as a reader who pastes them would.
func TestReadmeTryIt(t *testing.T) {
	t.Chdir(filepath.Join("..", ".."))
	cmds := tryItCommands(t, "README.md")
	seen := map[string]bool{}
	for _, line := range cmds {
		args := strings.Fields(line)[1:]
		seen[args[0]] = true
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			code, out, errs := runCmd(t, run, args...)
			if code != 0 {
				t.Fatalf("exit %d: %s", code, errs)
			}
			if strings.TrimSpace(out) == "" {
				t.Fatalf("no output; stderr %s", errs)
			}
		})
	}
	for _, c := range []string{"plan", "render", "inspect"} {
		if !seen[c] {
			t.Errorf("the README's Try it section does not run passage %s", c)
		}
	}
	for _, ex := range examples {
		found := false
		for _, line := range cmds {
			found = found || strings.Contains(line, "examples/"+ex.file)
		}
		if !found {
			t.Errorf("the README's Try it section never reads examples/%s", ex.file)
		}
	}
}

// tryItCommands are the lines starting "passage " in the first code block after the
// "## Try it" heading.
func tryItCommands(t *testing.T, readme string) []string {
	t.Helper()
	f, err := os.Open(readme)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cmds []string
	section, block := false, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "## "):
			if section && len(cmds) > 0 {
				return cmds
			}
			section = strings.HasPrefix(l, "## Try it")
		case section && strings.HasPrefix(l, "```"):
			if block {
				return cmds
			}
			block = true
		case section && block && strings.HasPrefix(l, "passage "):
			cmds = append(cmds, l)
		}
	}
	if len(cmds) == 0 {
		t.Fatalf("%s: no passage commands under a \"## Try it\" heading", readme)
	}
	return cmds
}
