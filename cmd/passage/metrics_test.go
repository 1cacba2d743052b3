package main

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

func TestMetricsCommand(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	// The manifest's gpu0 records two of the tree's ports: one as the tree holds it, one
	// as it held something else after the boot (it drifted since).
	same, moved := n.Addr("rp0").String(), n.Addr("cx-dsp-nic0").String()
	live := liveACS(tree)
	m := manifesttest.B300(4)
	m.Units[0].ACSChanges = []manifest.ACSChange{
		{Port: same, After: live[same], Result: "unchanged"},
		{Port: moved, After: "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+", Result: "applied"},
	}
	dir := t.TempDir()
	priv := ed25519.NewKeyFromSeed(make([]byte, ed25519.SeedSize))
	s, _ := manifest.NewEd25519Signer(priv)
	signed, err := manifest.Sign(context.Background(), m, s)
	if err != nil {
		t.Fatal(err)
	}
	envFile, pubFile := filepath.Join(dir, "manifest.dsse.json"), filepath.Join(dir, "node.pub")
	os.WriteFile(envFile, signed.Envelope, 0o644)
	pub, _ := manifest.MarshalPublicKey(priv.Public())
	os.WriteFile(pubFile, pub, 0o644)

	run := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		rc := cmdMetrics(args, &out, &errb)
		return rc, out.String(), errb.String()
	}
	rc, out, errs := run(envFile, "--pub", pubFile, "--root", n.Root)
	if rc != 0 || errs != "" {
		t.Fatalf("rc %d %s", rc, errs)
	}
	for _, want := range []string{
		`passage_acs_port_drifted{unit="gpu0",port="` + same + `"} 0`,
		`passage_acs_port_drifted{unit="gpu0",port="` + moved + `"} 1`,
		`passage_manifest_generation 4`,
		`passage_manifest_signed 1`,
	} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("metrics lack %s", want)
		}
	}
	// On another node none of the manifest's ports is there: refused, not all drifted.
	elsewhere := pcitest.New(t, pcitest.SRIOVNode(1, 1, 1))
	if rc, out, errs := run(envFile, "--pub", pubFile, "--root", elsewhere.Root); rc != 2 || out != "" || !strings.Contains(errs, "not that node") {
		t.Errorf("--root of another node: rc %d, %d bytes out, stderr %q", rc, len(out), errs)
	}
	if rc, out, _ := run(envFile, "--pub", pubFile); rc != 0 || strings.Contains(out, "drifted") {
		t.Errorf("without --root: rc %d, drift %v", rc, strings.Contains(out, "drifted"))
	}

	// Metrics come only from a manifest that verifies.
	other := filepath.Join(dir, "other.pub")
	opub, _ := manifest.MarshalPublicKey(ed25519.NewKeyFromSeed(bytes.Repeat([]byte{1}, ed25519.SeedSize)).Public())
	os.WriteFile(other, opub, 0o644)
	if rc, out, errs := run(envFile, "--pub", other); rc != 1 || out != "" || !strings.Contains(errs, "REFUSED") {
		t.Errorf("another key: rc %d stdout %d bytes stderr %q", rc, len(out), errs)
	}
	if rc, out, _ := run(envFile, "--pub", pubFile, "--min-generation", "5"); rc != 1 || out != "" {
		t.Errorf("replay: rc %d stdout %d bytes", rc, len(out))
	}
	for _, args := range [][]string{
		{filepath.Join(dir, "none"), "--pub", pubFile},
		{envFile},
		{envFile, "--pub", pubFile, "--root", filepath.Join(dir, "none")},
	} {
		if rc, out, _ := run(args...); rc != 2 || out != "" {
			t.Errorf("%v: rc %d stdout %d bytes", args, rc, len(out))
		}
	}
}
