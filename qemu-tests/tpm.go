package qemutest

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/passage-boot/passage/manifest/tpmkey"
)

// cmdStoreVolatile is swtpm's control command CMD_STORE_VOLATILE (swtpm's
// include/swtpm/tpm_ioctl.h): write the TPM's volatile state (PCRs, loaded objects)
// to the state dir, where the next swtpm on that dir resumes from it.
const cmdStoreVolatile = 10

// storeVolatile asks the running swtpm to store its volatile state. The control socket
// takes one client at a time: QEMU must be gone.
func (s *swtpm) storeVolatile() error {
	c, err := net.DialTimeout("unix", s.sock, 5*time.Second)
	if err != nil {
		return fmt.Errorf("swtpm %s: store volatile state: %w", s.state, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	var req [4]byte
	binary.BigEndian.PutUint32(req[:], cmdStoreVolatile)
	if _, err := c.Write(req[:]); err != nil {
		return fmt.Errorf("swtpm %s: store volatile state: %w", s.state, err)
	}
	var res [4]byte
	if _, err := io.ReadFull(c, res[:]); err != nil {
		return fmt.Errorf("swtpm %s: store volatile state: %w", s.state, err)
	}
	if rc := binary.BigEndian.Uint32(res[:]); rc != 0 {
		return fmt.Errorf("swtpm %s: store volatile state: TPM result %#x", s.state, rc)
	}
	return nil
}

// OpenTPM starts swtpm again on a state dir a boot left (Options.KeepTPM keeps the
// PCRs in it) and opens it over swtpm's TPM command socket, as a verifier holding the
// node's TPM would: the signing key's public part, PCR 13 and the NV counter come from
// the TPM itself, not from anything the guest printed. Close the TPM, then call stop.
func OpenTPM(state string) (k *tpmkey.TPM, stop func(), err error) {
	dir, err := os.MkdirTemp("", "swtpm-")
	if err != nil {
		return nil, nil, err
	}
	sock := filepath.Join(dir, "tpm.sock")
	// not-need-init: no QEMU sends CMD_INIT; the volatile state (when stored) resumes the
	// TPM as the guest left it, already started.
	cmd := exec.Command("swtpm", "socket", "--tpm2", "--tpmstate", "dir="+state,
		"--server", "type=unixio,path="+sock, "--flags", "not-need-init")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, nil, fmt.Errorf("swtpm %s: %w", state, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop = func() {
		cmd.Process.Kill()
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
		}
		os.RemoveAll(dir)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-exited:
			os.RemoveAll(dir)
			return nil, nil, fmt.Errorf("swtpm %s: exited: %v: %s", state, err, stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			return nil, nil, fmt.Errorf("swtpm %s: no socket after 10 s", state)
		}
	}
	k, err = tpmkey.Open(sock)
	if err != nil {
		stop()
		return nil, nil, fmt.Errorf("swtpm %s: %w (was the boot run with KeepTPM?)", state, err)
	}
	return k, stop, nil
}
