// Package attesttest runs swtpm with an EK certificate from a private swtpm_localca for
// tests: the TPM of a genuine node, as far as a verifier can tell, and its vendor CA.
package attesttest

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2/transport"
	"github.com/google/go-tpm/tpm2/transport/linuxudstpm"
)

// CA is a private swtpm_localca state directory: the issuer of the EK certificates
// of the swtpm instances made with it, as a TPM vendor's CA is of a node's.
type CA struct {
	// Dir is the swtpm_localca state directory.
	Dir           string
	conf, options string
}

func NewCA(t testing.TB) *CA {
	t.Helper()
	dir := t.TempDir()
	ca := &CA{Dir: filepath.Join(dir, "state"), conf: filepath.Join(dir, "localca.conf"), options: filepath.Join(dir, "localca.options")}
	if err := os.Mkdir(ca.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	conf := "statedir = " + ca.Dir + "\n" +
		"signingkey = " + filepath.Join(ca.Dir, "signkey.pem") + "\n" +
		"issuercert = " + filepath.Join(ca.Dir, "issuercert.pem") + "\n" +
		"certserial = " + filepath.Join(ca.Dir, "certserial") + "\n"
	opts := "--platform-manufacturer passage\n--platform-version 2.1\n--platform-model QEMU\n"
	if err := os.WriteFile(ca.conf, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ca.options, []byte(opts), 0o600); err != nil {
		t.Fatal(err)
	}
	return ca
}

// PEM is what an operator trusting this CA holds: its root and the intermediate that
// signs EK certificates (swtpm_localca makes both on first use).
func (ca *CA) PEM(t testing.TB) []byte {
	t.Helper()
	var pemBytes []byte
	for _, f := range []string{"swtpm-localca-rootca-cert.pem", "issuercert.pem"} {
		b, err := os.ReadFile(filepath.Join(ca.Dir, f))
		if err != nil {
			t.Fatal(err)
		}
		pemBytes = append(pemBytes, b...)
	}
	return pemBytes
}

// Start manufactures a swtpm with an EK certificate from ca (swtpm_setup
// --create-ek-cert) and serves it on a Unix socket; the returned transport is closed and
// the swtpm stopped at the test's end.
func Start(t testing.TB, ca *CA) transport.TPMCloser {
	t.Helper()
	tpm, err := linuxudstpm.Open(StartSocket(t, ca))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tpm.Close() })
	return tpm
}

// StartSocket is Start returning swtpm's socket instead of a connection, for a program
// that opens the TPM itself (swtpm serves one connection at a time).
func StartSocket(t testing.TB, ca *CA) string {
	t.Helper()
	state := filepath.Join(t.TempDir(), "state")
	Manufacture(t, ca, state)
	sock, _ := Serve(t, state)
	return sock
}

// Manufacture makes state a TPM's state directory with an EK certificate from ca, as
// a TPM vendor's manufacturing does (swtpm_setup --create-ek-cert --lock-nvram): a
// QEMU boot (qemu-tests' Options.TPMState) then runs on it.
func Manufacture(t testing.TB, ca *CA, state string) {
	t.Helper()
	for _, tool := range []string{"swtpm", "swtpm_setup", "swtpm_localca"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not installed (image/deps.sh installs swtpm and swtpm-tools): %v", tool, err)
		}
	}
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	setupConf := filepath.Join(t.TempDir(), "setup.conf")
	conf := "create_certs_tool = " + mustLook(t, "swtpm_localca") + "\n" +
		"create_certs_tool_config = " + ca.conf + "\n" +
		"create_certs_tool_options = " + ca.options + "\n" +
		"active_pcr_banks = sha256\n"
	if err := os.WriteFile(setupConf, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("swtpm_setup", "--tpm2", "--tpmstate", state, "--create-ek-cert",
		"--create-platform-cert", "--lock-nvram", "--config", setupConf, "--overwrite").CombinedOutput()
	if err != nil {
		t.Fatalf("swtpm_setup: %v\n%s", err, out)
	}
}

// Serve runs swtpm on the state directory (started: TPM2_Startup(CLEAR) done) and
// returns its command socket; stop ends it (at the latest at the test's end), before
// anything else runs on the same state directory.
func Serve(t testing.TB, state string) (sock string, stop func()) {
	t.Helper()
	// A Unix socket path must fit in sun_path (108 bytes); a test's temp dir may not.
	dir, err := os.MkdirTemp("", "swtpm-")
	if err != nil {
		t.Fatal(err)
	}
	sock = filepath.Join(dir, "tpm.sock")
	cmd := exec.Command("swtpm", "socket", "--tpm2", "--tpmstate", "dir="+state,
		"--server", "type=unixio,path="+sock, "--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--flags", "not-need-init,startup-clear")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		t.Fatal(err)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cmd.Process.Kill()
			cmd.Wait()
			os.RemoveAll(dir)
		})
	}
	t.Cleanup(stop)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("swtpm did not listen on %s: %s", sock, stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return sock, stop
}

func mustLook(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
