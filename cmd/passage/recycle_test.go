package main

import (
	"context"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// TestRecycleNonceAttestation: recycle --nonce on a node with a TPM recycles unit 3
// (erased, reset, bound again: ready) and attests the generation it signs over the
// verifier's nonce. When that attestation cannot be made (here the firmware event log
// cannot be read: a directory where securityfs has the file), the verifier waiting for
// it gets nothing: recycle says why on stderr and exits 1, although the unit is ready.
// With the log readable the same recycle exits 0 with the attestation over the nonce.
func TestRecycleNonceAttestation(t *testing.T) {
	root, gen, k, _ := withdrawNode(t)
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	ctrls := map[pci.Address]*erasetest.Controller{}
	for _, d := range tree.Devices {
		dir := filepath.Join(root, pci.DevicesDir, d.Addr.String())
		if err := os.WriteFile(filepath.Join(dir, "reset_method"), []byte("flr\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "reset"), nil, 0o200); err != nil {
			t.Fatal(err)
		}
		if d.Class == pcitest.ClassNVMe {
			ctrls[d.Addr] = erasetest.New("S"+d.Addr.String(), erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16})
		}
	}
	env := recycleEnv{sysfs: k, open: func(_ context.Context, a pci.Address) (erase.Controller, string, error) {
		return ctrls[a], "nvme", nil
	}}
	sock := attesttest.StartSocket(t, attesttest.NewCA(t))
	os.MkdirAll(filepath.Join(root, "dev"), 0o755)
	if err := os.Symlink(sock, filepath.Join(root, tpmkey.DefaultDevice)); err != nil {
		t.Fatal(err)
	}
	fwlog := filepath.Join(root, attest.FirmwareLogPath)
	if err := os.MkdirAll(fwlog, 0o755); err != nil {
		t.Fatal(err)
	}
	nonce := "00112233445566778899aabbccddeeff"
	recycle := func() (int, string, string) {
		return runCmd(t, func(a []string, o, e io.Writer) int { return runRecycle(a, o, e, env) },
			"--root", root, "--unit", "gpu3", "--generation-file", gen, "--nonce", nonce)
	}
	att := filepath.Join(root, "run/passage/manifest.dsse.json"+attest.Suffix)

	code, out, errs := recycle()
	if code != 1 || !strings.Contains(out, "gpu3 ready") || !strings.Contains(errs, "attestation: firmware event log") {
		t.Fatalf("recycle --nonce, attestation failing: exit %d, want 1 with gpu3 ready and the attestation's failure named\nstdout %s\nstderr %s", code, out, errs)
	}
	if _, err := os.Stat(att); !os.IsNotExist(err) {
		t.Errorf("an attestation is beside the generation recycle could not attest: %v", err)
	}

	if err := os.Remove(fwlog); err != nil {
		t.Fatal(err)
	}
	code, out, errs = recycle()
	if code != 0 || !strings.Contains(out, "gpu3 ready") || errs != "" {
		t.Fatalf("recycle --nonce: exit %d\nstdout %s\nstderr %s", code, out, errs)
	}
	a, err := attest.ReadAttestation(att)
	if err != nil {
		t.Fatalf("recycle wrote no attestation: %v", err)
	}
	if a.NonceSource != attest.NonceControlPlane || hex.EncodeToString(a.Nonce) != nonce {
		t.Errorf("attestation over nonce %x (%s), want %s", a.Nonce, a.NonceSource, nonce)
	}
}
