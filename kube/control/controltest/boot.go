package controltest

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/google/go-tpm/tpm2/transport/linuxudstpm"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
)

// BootResult is what a `passage boot --root` of the node ended with.
type BootResult struct {
	// Publish is the publish stage's record in the boot's log.jsonl.
	Publish stages.ResultRecord
	// Console is what the boot printed, Exit its exit code (1 when a unit failed).
	Console string
	Exit    int
	// Attestation is the attestation the boot POSTed last (the one quoted over the
	// control plane's nonce), and Nonce its nonce.
	Attestation, Nonce []byte
	// Generation is the generation the boot's manifest carries (the TPM's NV counter).
	Generation uint64
}

// Boot runs the boot's own code on the node: the binary passage (built from
// cmd/passage) as `passage boot --root R --no-handoff`, R a synthetic B300 tree named
// after the node's hostname, with passage.net=off and passage.url=url (loopback), its
// TPM this node's swtpm powered on afresh (PCRs reset, then extended with the
// firmware's log, which R holds where the kernel keeps it). env is added to the boot's
// environment: SSL_CERT_FILE names the issuer of url's certificate, as an initramfs's
// CA bundle does. The boot's publish, its enrolment round included, is the boot's
// (netboot through stages/boot), none of this package's. The node is rebooted after
// (its next Publish is a new boot, after the TPM-counted generation).
func (n *Node) Boot(ctx context.Context, passage, url string, env []string) (*BootResult, error) {
	t := n.t
	t.Helper()
	root, err := n.bootRoot(url)
	if err != nil {
		return nil, err
	}
	n.PowerOff()
	defer n.Reboot(n.FirmwareLog)
	sock, stop := attesttest.Serve(t, n.state)
	defer stop()
	tp, err := linuxudstpm.Open(sock)
	if err != nil {
		return nil, err
	}
	err = ExtendLog(tp, n.FirmwareLog)
	tp.Close() // swtpm serves one connection at a time: the boot's is next
	if err != nil {
		return nil, err
	}
	dev := filepath.Join(root, "dev/tpmrm0")
	os.Remove(dev)
	if err := os.Symlink(sock, dev); err != nil {
		return nil, err
	}
	if err := os.RemoveAll(filepath.Join(root, "run")); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, passage, "boot", "--root", root, "--no-handoff")
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// A boot whose units failed exits 1 (the synthetic tree has no vfio-pci to bind to);
	// what it published is in log.jsonl all the same.
	err = cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		return nil, fmt.Errorf("passage boot --root: %v\n%s", err, out.String())
	}
	res := &BootResult{Console: out.String(), Exit: cmd.ProcessState.ExitCode()}
	f, err := os.Open(filepath.Join(root, "run/passage/log.jsonl"))
	if err != nil {
		return nil, err
	}
	recs, err := stages.ReadStages(f)
	f.Close()
	if err != nil {
		return nil, err
	}
	for _, r := range recs {
		if r.Name == "publish" {
			res.Publish = r
		}
	}
	if res.Publish.Name == "" {
		return nil, fmt.Errorf("passage boot --root: no publish stage in log.jsonl\n%s", res.Console)
	}
	run := filepath.Join(root, "run/passage", "manifest.dsse.json")
	if res.Attestation, err = manifest.ReadRegular(run+attest.Suffix, attest.MaxFile); err != nil {
		return nil, err
	}
	var a attest.Attestation
	if err := json.Unmarshal(res.Attestation, &a); err != nil {
		return nil, fmt.Errorf("the boot's attestation: %w", err)
	}
	res.Nonce = a.Nonce
	envb, err := manifest.ReadRegular(run, 1<<20)
	if err != nil {
		return nil, err
	}
	// What the boot POSTed: the attestation carrying its envelope.
	if res.Attestation, err = attest.WithEnvelope(res.Attestation, envb); err != nil {
		return nil, fmt.Errorf("the boot's attestation: %w", err)
	}
	var e manifest.Envelope
	if err := json.Unmarshal(envb, &e); err != nil {
		return nil, fmt.Errorf("the boot's envelope: %w", err)
	}
	payload, err := base64.StdEncoding.DecodeString(e.Payload)
	if err != nil {
		return nil, fmt.Errorf("the boot's envelope: %w", err)
	}
	m, err := manifest.Unmarshal(payload)
	if err != nil {
		return nil, fmt.Errorf("the boot's envelope: %w", err)
	}
	res.Generation = m.Generation
	n.Generation = max(n.Generation, m.Generation+1)
	return res, nil
}

// bootRoot makes the node's synthetic tree once (a B300's sysfs with real config
// space, /proc, an ed25519 key) and writes this boot's command line, boot id and
// firmware log.
func (n *Node) bootRoot(url string) (string, error) {
	if n.root == "" {
		root := pcitest.New(n.t, pcitest.B300()).Root
		files := map[string]string{
			"proc/uptime":               "7.250 12.00\n",
			"proc/sys/kernel/osrelease": "6.1.0-test-amd64\n",
			"proc/sys/kernel/hostname":  n.Hostname + "\n",
		}
		for p, c := range files {
			if err := writeFile(filepath.Join(root, p), []byte(c)); err != nil {
				return "", err
			}
		}
		for _, d := range []string{"lib/modules/6.1.0-test-amd64", "sys/class/net", "dev", "etc/passage"} {
			if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
				return "", err
			}
		}
		if _, _, err := manifest.GenerateKey(filepath.Join(root, "etc/passage")); err != nil {
			return "", err
		}
		n.root = root
	}
	cmdline := "console=ttyS0 passage.profile=b300 passage.key=/etc/passage/passage.key passage.tpm=on " +
		"passage.erase=off passage.host_modules= passage.net=off passage.url=" + url + "\n"
	if err := writeFile(filepath.Join(n.root, "proc/cmdline"), []byte(cmdline)); err != nil {
		return "", err
	}
	if err := writeFile(filepath.Join(n.root, "proc/sys/kernel/random/boot_id"), []byte(newBootID()+"\n")); err != nil {
		return "", err
	}
	if err := writeFile(filepath.Join(n.root, attest.FirmwareLogPath), n.FirmwareLog); err != nil {
		return "", err
	}
	return n.root, nil
}

func writeFile(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}
