package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// boundsKey writes an ed25519 pair for the bounds tests: the signer and the .pub path.
func boundsKey(t *testing.T) (*manifest.Ed25519Signer, string) {
	t.Helper()
	dir := t.TempDir()
	priv, pub, err := manifest.GenerateKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	s, err := manifest.LoadSigner(priv)
	if err != nil {
		t.Fatal(err)
	}
	return s, pub
}

// An envelope padded with empty-keyid signatures before its one good signature is
// refused for the count, not checked signature by signature and accepted.
func TestVerifyBoundsSignatureCount(t *testing.T) {
	s, pub := boundsKey(t)
	signed, err := manifest.Sign(context.Background(), manifesttest.B300(1), s)
	if err != nil {
		t.Fatal(err)
	}
	var env map[string]any
	if err := json.Unmarshal(signed.Envelope, &env); err != nil {
		t.Fatal(err)
	}
	sigs := env["signatures"].([]any)
	padded := make([]any, 0, 2001)
	for range 2000 {
		padded = append(padded, map[string]string{"keyid": "", "sig": ""})
	}
	env["signatures"] = append(padded, sigs...)
	b, _ := json.Marshal(env)
	path := filepath.Join(t.TempDir(), "padded.dsse.json")
	os.WriteFile(path, b, 0o644)
	code, out, errs := runCmd(t, cmdVerify, "--pub", pub, path)
	if code != 1 || out != "" || !strings.Contains(errs, "REFUSED: manifest: malformed envelope: envelope has 2001 signatures, over the limit of 8") {
		t.Errorf("exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
}

// A FIFO named as a manifest or a key is refused at once (no writer ever comes), and a
// key directory's file is read only up to its bound, however large it says it is.
func TestVerifyBoundsFiles(t *testing.T) {
	_, pub := boundsKey(t)
	dir := t.TempDir()
	fifo := filepath.Join(dir, "manifest.dsse.json")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	keys := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(keys, "fifo.pub"), 0o644); err != nil {
		t.Fatal(err)
	}
	type res struct {
		code      int
		out, errs string
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--pub", pub, fifo}, "not a regular file"},
		{[]string{"--pub", filepath.Join(keys, "fifo.pub"), pub}, "not a regular file"},
	} {
		done := make(chan res, 1)
		go func() {
			c, o, e := runCmd(t, cmdVerify, tc.args...)
			done <- res{c, o, e}
		}()
		select {
		case r := <-done:
			if r.code != 2 || !strings.Contains(r.errs, tc.want) {
				t.Errorf("verify %v: exit %d, stderr %q, want 2 and %q", tc.args, r.code, r.errs, tc.want)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("verify %v blocked on a FIFO", tc.args)
		}
	}

	// A sparse 2 GiB file in a key directory: refused by its size, not read.
	sparse := t.TempDir()
	f, err := os.Create(filepath.Join(sparse, "big.pub"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(2 << 30); err != nil {
		t.Fatal(err)
	}
	f.Close()
	code, _, errs := runCmd(t, cmdVerify, "--pub", sparse, pub)
	if code != 2 || !strings.Contains(errs, "big.pub: 2147483648 bytes, over the 65536-byte limit") {
		t.Errorf("sparse key file: exit %d, stderr %q", code, errs)
	}
}

// Strings from a signed payload cannot forge a line of the fleet report or reach the
// terminal as escape sequences: they are printed escaped.
func TestVerifyOutputEscapesPayloadStrings(t *testing.T) {
	s, pub := boundsKey(t)
	dir := t.TempDir()
	m := manifesttest.B300(1)
	forgedLine := "OK       /fleet/nodeX.dsse.json: nodeX gen 99 (tpm-nv) boot b units 8 ready 0 degraded 0 failed"
	m.Node.Hostname = "evil\n" + forgedLine
	m.Units[0].Status = manifest.StatusFailed
	m.Units[0].Reasons = []string{"\x1b]0;owned\x07\x1b[2J reason \u202e"}
	m.Errors = []string{"\x1b[31mred"}
	m.Units[0].Functions[3].DriverAfter = "nvme"
	evil := signedFile(t, filepath.Join(dir, "evil.dsse.json"), m, s)
	plain := signedFile(t, filepath.Join(dir, "plain.dsse.json"), manifesttest.B300(1), s)

	code, out, errs := runCmd(t, cmdVerify, "--pub", pub, evil, plain)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if code != 0 || len(lines) != 3 || !strings.HasPrefix(lines[0], "OK       "+evil+`: evil\nOK       /fleet/nodeX.dsse.json`) {
		t.Errorf("fleet: exit %d %s, %d lines:\n%s", code, errs, len(lines), out)
	}
	for _, l := range lines {
		if strings.HasPrefix(l, "OK       /fleet/") {
			t.Errorf("forged line printed: %q", l)
		}
	}
	for _, args := range [][]string{{"--pub", pub, evil}, {"--pub", pub, "--by-unit", evil}} {
		code, out, errs = runCmd(t, cmdVerify, args...)
		if code != 0 || strings.ContainsAny(out, "\x1b\x07\u202e") || !strings.Contains(out, `\x1b]0;owned\x07\x1b[2J reason \u202e`) {
			t.Errorf("verify %v: exit %d %s\n%q", args, code, errs, out)
		}
	}
}
