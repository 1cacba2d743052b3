package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/passage-boot/passage/buildinfo"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/metrics"
)

// TestVersionIsTheBootsBuild: the build passage version prints is the one a boot writes
// on the console's first line, in log.jsonl's first line, in the signed manifest, in
// passage_build_info, and what verify prints.
func TestVersionIsTheBootsBuild(t *testing.T) {
	code, out, errs := runCmd(t, run, "version", "--json")
	if code != 0 {
		t.Fatalf("version --json: %d %s", code, errs)
	}
	var want buildinfo.Info
	if err := json.Unmarshal([]byte(out), &want); err != nil {
		t.Fatalf("version --json %q: %v", out, err)
	}
	if want.GoVersion == "" || want.Version == "" {
		t.Fatalf("version --json %q names no module or Go version", out)
	}
	code, text, _ := runCmd(t, run, "version")
	code2, text2, _ := runCmd(t, run, "--version")
	if code != 0 || code2 != 0 || text != text2 || text != want.String()+"\n" {
		t.Errorf("version %q (%d), --version %q (%d), want %q", text, code, text2, code2, want.String())
	}

	root := bootTree(t, "console=ttyS0 passage.profile=b300 passage.key=/etc/passage/passage.key passage.tpm=off passage.handoff=poweroff passage.erase=off")
	var con, errb bytes.Buffer
	cmdBoot([]string{"--root", root, "--dry-run", "--no-handoff"}, &con, &errb)
	// A dry run signs nothing: the signed manifest and its metrics come from the same
	// tree's boot through a simulated kernel.
	runBootStages(t, root, "b300", nil)
	if first, _, _ := strings.Cut(con.String(), "\n"); first != want.String() {
		t.Errorf("console's first line %q, want %q", first, want.String())
	}

	runDir := filepath.Join(root, "run/passage")
	f, err := os.Open(filepath.Join(runDir, "log.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var rec buildRecord
	if !sc.Scan() {
		t.Fatal("log.jsonl is empty")
	}
	if err := json.Unmarshal(sc.Bytes(), &rec); err != nil || rec.Type != "build" || rec.Info != want {
		t.Errorf("log.jsonl's first line %s (%v), want the build %+v", sc.Bytes(), err, want)
	}

	env, err := os.ReadFile(filepath.Join(runDir, "manifest.dsse.json"))
	if err != nil {
		t.Fatal(err)
	}
	v, err := manifest.LoadVerifier(filepath.Join(root, "etc/passage/passage.pub"))
	if err != nil {
		t.Fatal(err)
	}
	ver, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ver.Manifest.SchemaVersion != manifest.SchemaVersion || ver.Manifest.Build == nil || *ver.Manifest.Build != want {
		t.Errorf("manifest schema %d build %+v, want %+v", ver.Manifest.SchemaVersion, ver.Manifest.Build, want)
	}

	prom, err := os.ReadFile(filepath.Join(runDir, metrics.TextfileName))
	if err != nil {
		t.Fatal(err)
	}
	line := fmt.Sprintf("passage_build_info{version=%q,revision=%q,goversion=%q} 1", want.VersionString(), want.Rev(), want.GoString())
	if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(line) + `$`).Match(prom) {
		t.Errorf("%s lacks %s:\n%s", metrics.TextfileName, line, prom)
	}

	code, vout, verrs := runCmd(t, run, "verify", "--pub", filepath.Join(root, "etc/passage/passage.pub"), filepath.Join(runDir, "manifest.dsse.json"))
	if code != 0 || !strings.Contains(vout, "  build       "+want.String()+"\n") {
		t.Errorf("verify: %d %s\n%s", code, verrs, vout)
	}
}
