package main

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// flagToken is a flag as the README and the synopses write it: -o, --pub.
var flagToken = regexp.MustCompile("(?:^|[\\s\\[(|`])(--?[a-z][a-z0-9-]*)")

// readmeFlags maps each command of the README's command table to the flags its row's
// first cell names.
func readmeFlags(t *testing.T) map[string][]string {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "| `") {
			continue
		}
		cell, _, _ := strings.Cut(strings.TrimPrefix(l, "| "), " | ")
		// One cell may name several commands: `keygen [-o DIR]`, `tpm-pubkey ...`.
		for _, part := range strings.Split(cell, "`, `") {
			part = strings.Trim(part, "`")
			name, rest, _ := strings.Cut(part, " ")
			if _, ok := commands()[name]; !ok {
				continue
			}
			out[name] = append(out[name], flagsIn(rest)...)
		}
	}
	return out
}

func flagsIn(s string) []string {
	var fl []string
	for _, m := range flagToken.FindAllStringSubmatch(s, -1) {
		fl = append(fl, strings.TrimLeft(m[1], "-"))
	}
	return fl
}

// TestHelp: every command's -h and help CMD exit 0 with the same text on stdout: its
// synopsis, its one line, and its flags; each flag the synopsis or the README's command
// table names is one the command has.
func TestHelp(t *testing.T) {
	documented := readmeFlags(t)
	var names []string
	for n := range commands() {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		c := commands()[name]
		t.Run(name, func(t *testing.T) {
			code, h, errs := runCmd(t, run, name, "-h")
			if code != 0 || errs != "" {
				t.Fatalf("%s -h: exit %d, stderr %q", name, code, errs)
			}
			code, h2, errs := runCmd(t, run, "help", name)
			if code != 0 || errs != "" || h2 != h {
				t.Errorf("help %s: exit %d, stderr %q, same as -h: %v", name, code, errs, h2 == h)
			}
			if _, _, errs := runCmd(t, run, name, "--help"); errs != "" {
				t.Errorf("%s --help: stderr %q", name, errs)
			}
			if !strings.HasPrefix(h, "usage: passage "+name+" ") {
				t.Errorf("help does not start with the synopsis:\n%s", h)
			}
			if !strings.Contains(h, "\n"+strings.ToUpper(c.summary[:1])+c.summary[1:]+".\n") {
				t.Errorf("help lacks the one-line description %q:\n%s", c.summary, h)
			}
			if !strings.Contains(h, "\nflags:\n") {
				t.Errorf("help has no flags section:\n%s", h)
			}
			_, flagList, _ := strings.Cut(h, "\nflags:\n")
			want := append(flagsIn(c.synopsis), documented[name]...)
			if name != "boot" && len(documented[name]) == 0 && name != "version" {
				t.Errorf("the README's command table names no flag of %s", name)
			}
			for _, fl := range want {
				if !regexp.MustCompile(`(?m)^  -` + regexp.QuoteMeta(fl) + `( |$)`).MatchString(flagList) {
					t.Errorf("--%s (synopsis or README) is not among %s's flags:\n%s", fl, name, flagList)
				}
			}
		})
	}
	if _, ok := documented["plan"]; !ok {
		t.Error("the README's command table was not read")
	}
	if code, _, errs := runCmd(t, run, "help", "bogus"); code != 2 || errs == "" {
		t.Errorf("help bogus: exit %d stderr %q", code, errs)
	}
	if code, out, _ := runCmd(t, run, "help"); code != 0 || !strings.Contains(out, "  version ") {
		t.Errorf("help: exit %d\n%s", code, out)
	}
}

// TestDeprecatedFlagNames: each old spelling still does what it did, and says once that
// it goes.
func TestDeprecatedFlagNames(t *testing.T) {
	dir := t.TempDir()
	mdir, kdir, err := manifesttest.Fleet(dir, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	env := filepath.Join(mdir, "node-0000.dsse.json")
	pub := filepath.Join(kdir, "node-key-0000.pub")
	saved := filepath.Join(dir, "plan.json")
	for _, tc := range []struct {
		args     []string
		old, now string
	}{
		{[]string{"verify", "--key", pub, env}, "--key", "--pub"},
		{[]string{"metrics", "--manifest", env, "--pub", pub}, "--manifest", "the MANIFEST argument"},
		{[]string{"metrics", "--key", pub, env}, "--key", "--pub"},
		{[]string{"render", "--manifest", env, "--key", pub, "--unit", "0"}, "--manifest", "the MANIFEST argument"},
		{[]string{"plan", "--snapshot", filepath.Join("..", "..", "examples", "b300.tar.gz"), "--out", saved}, "--out", "-o"},
	} {
		code, out, errs := runCmd(t, run, tc.args...)
		line := "passage " + tc.args[0] + ": " + tc.old + " is deprecated, use " + tc.now + "\n"
		if code != 0 || out == "" || strings.Count(errs, line) != 1 {
			t.Errorf("%v: exit %d, stderr %q, want once %q", tc.args, code, errs, line)
		}
	}
	if f, err := os.Open(saved); err != nil {
		t.Errorf("plan --out did not save the decision: %v", err)
	} else {
		if _, err := decision.ReadSaved(f); err != nil {
			t.Errorf("plan --out: %v", err)
		}
		f.Close()
	}
	// recycle --key and tpm-pubkey --tpm reach what --signing-key and --tpm-device name.
	code, _, errs := runCmd(t, run, "recycle", "--root", dir, "--unit", "0", "--key", "/none.key")
	if code != 2 || !strings.Contains(errs, "--key is deprecated, use --signing-key") || !strings.Contains(errs, filepath.Join(dir, "none.key")) {
		t.Errorf("recycle --key: exit %d stderr %q", code, errs)
	}
	code, _, errs = runCmd(t, run, "tpm-pubkey", "--tpm", filepath.Join(dir, "no-tpm"))
	if code != 2 || !strings.Contains(errs, "--tpm is deprecated, use --tpm-device") || !strings.Contains(errs, "no-tpm") {
		t.Errorf("tpm-pubkey --tpm: exit %d stderr %q", code, errs)
	}
}

func TestKeygenCreatesDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "keys", "node7")
	code, out, errs := runCmd(t, run, "keygen", "-o", dir)
	if code != 0 {
		t.Fatalf("keygen -o %s: exit %d: %s", dir, code, errs)
	}
	fi, err := os.Stat(dir)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("%s: %v, mode %v, want 0700", dir, err, fi.Mode().Perm())
	}
	if !strings.Contains(out, filepath.Join(dir, manifest.PublicKeyFile)) {
		t.Errorf("keygen output %q", out)
	}
}

// TestKeyDirIgnoresOtherFiles: a node's key directory as keygen --enrol leaves it
// (private key and enrolment beside the public one) and a README verify; what is not a
// public key is named once, an enrolment is not named at all.
func TestKeyDirIgnoresOtherFiles(t *testing.T) {
	dir := t.TempDir()
	mdir, kdir, err := manifesttest.Fleet(dir, 3, 3)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(kdir, "README"), []byte("the fleet's keys\n"), 0o644)
	_, pub, err := manifest.GenerateKey(kdir)
	if err != nil {
		t.Fatal(err)
	}
	// A public key is never ignored: without its enrolment the directory is refused.
	code, _, errs := runCmd(t, run, "verify", "--pub", kdir, mdir)
	if code != 2 || !strings.Contains(errs, manifest.PublicKeyFile+": not enrolled for a node") {
		t.Errorf("unenrolled key: exit %d, stderr %q", code, errs)
	}
	v, err := manifest.LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	id, _ := v.KeyID()
	e, err := manifest.NewEnrolment(id, manifest.Node{DMIUUID: manifesttest.NodeUUID(99)}, false)
	if err == nil {
		_, err = manifest.WriteEnrolment(pub, e)
	}
	if err != nil {
		t.Fatal(err)
	}
	code, out, errs := runCmd(t, run, "verify", "--pub", kdir, mdir)
	want := "passage verify: " + kdir + ": ignored, not public keys: README, " + manifest.PrivateKeyFile + "\n"
	if code != 0 || errs != want || !strings.Contains(out, "3 manifests: 3 verified") {
		t.Errorf("exit %d, stderr %q (want %q)\n%s", code, errs, want, out)
	}
	code, out, errs = runCmd(t, run, "verify", "--pub", kdir, filepath.Join(mdir, "node-0001.dsse.json"))
	if code != 0 || errs != want || !strings.Contains(out, ": OK, signed by") {
		t.Errorf("one manifest: exit %d, stderr %q\n%s", code, errs, out)
	}
}

// TestFleetSummaryNodes: the summary says on how many nodes the failed units are only
// when there are failed units.
func TestFleetSummaryNodes(t *testing.T) {
	for n, want := range map[int]string{0: "", 1: " (on 1 node)", 3: " (on 3 nodes)"} {
		if got := onNodes(n); got != want {
			t.Errorf("onNodes(%d) = %q, want %q", n, got, want)
		}
	}
}
