package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// TestVerifyPrintsErase: verify's summary shows each unit's erase record: the NVMe, its
// method and verified blocks, each reset.
func TestVerifyPrintsErase(t *testing.T) {
	dir := t.TempDir()
	priv, pub, err := manifest.GenerateKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	s, err := manifest.LoadSigner(priv)
	if err != nil {
		t.Fatal(err)
	}
	m := &manifest.Manifest{SchemaVersion: manifest.SchemaVersion, Build: manifest.ThisBuild(), BootID: "b", GenerationSource: manifest.GenerationNone, Time: time.Unix(1e9, 0),
		Units: []manifest.Unit{{ID: "gpu0", Status: manifest.StatusFailed, Reasons: []string{"erase (require): data remains"},
			Erase: &manifest.UnitErase{Policy: "require", ResetClears: manifest.ResetClears,
				NVMe: []manifest.NVMeErase{{BDF: "0000:0a:00.0", Controller: "nvme0", Model: "QEMU NVMe Ctrl", Serial: "unit0nvme",
					Method: "format-user-data-erase", VerifiedLBAs: 64, Namespaces: []manifest.NVMeNamespace{{NSID: 1, Blocks: 65536, BlockSize: 512, VerifiedLBAs: 64}}}},
				Resets: []manifest.Reset{{BDF: "0000:09:00.0", Methods: "flr pm bus", Result: "done"}}}}}}
	if _, err := manifest.WriteSigned(context.Background(), m, dir, "m.json", nil, s); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"verify", "--pub", pub, filepath.Join(dir, "m.json")}, &out, &errOut); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	for _, want := range []string{"erase (require)", "0000:0a:00.0 nvme0 QEMU NVMe Ctrl serial unit0nvme", "format-user-data-erase, 64 LBAs verified",
		"ns 1: 65536 blocks of 512 bytes, 64 verified", "reset 0000:09:00.0 (flr pm bus): done"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
}
