//go:build qemu

package qemutest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/attest/verifiertest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// tenantMarker is what the last tenant left on its NVMe: written over the whole
// backing image on the host before the boot.
var tenantMarker = []byte("PASSAGE-TENANT-A-MARKER-0123456789abcdef-")

// markedImage writes a raw image of sizeMiB whose every byte belongs to the marker
// pattern (the pattern repeated, cut at the end).
func markedImage(t testing.TB, path string, sizeMiB int, pattern []byte) {
	t.Helper()
	b := bytes.Repeat(pattern, (sizeMiB<<20)/len(pattern)+1)[:sizeMiB<<20]
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestEraseAtBoot: each unit's NVMe is backed by an image the test fills with a tenant's
// marker; a host-kept virtio disk holds another pattern. Booted with
// passage.erase=require, passage erases each NVMe through the guest kernel's nvme driver
// (QEMU's hw/nvme implements no Sanitize, SANICAP 0, so Format NVM with user data erase
// is the method it ends on), reads sampled LBAs back, resets every passthrough function
// and binds the units to vfio-pci. After power-off no byte of the marker is left
// anywhere in either NVMe image, the host-kept disk holds every byte it held, and the
// signed manifest records each erase. A host-kept NVMe on the root complex keeps every
// byte too.
func TestEraseAtBoot(t *testing.T) {
	dir := t.TempDir()
	var images []string
	for i := 0; i < 2; i++ {
		p := filepath.Join(dir, "unit"+string(rune('0'+i))+"-nvme.img")
		markedImage(t, p, 32, tenantMarker)
		images = append(images, p)
	}
	// Two host-kept disks: an NVMe on the root complex (the nvme driver the erase stage
	// loads binds it too) and a virtio disk.
	host := filepath.Join(dir, "host.img")
	markedImage(t, host, 8, []byte("HOST-KEPT-DISK-DO-NOT-TOUCH-"))
	hostNVMe := filepath.Join(dir, "host-nvme.img")
	markedImage(t, hostNVMe, 8, []byte("HOST-KEPT-NVME-DO-NOT-TOUCH-"))
	sums := map[string][32]byte{}
	for _, p := range []string{host, hostNVMe} {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		sums[p] = sha256.Sum256(b)
	}

	run, m := bootPassage(t, Options{Topology: Topology{NVMeImages: images}, NVMe: []string{hostNVMe}, Disk: host,
		Append: []string{"passage.erase=require", "passage.net=off"}})
	if run.Done != "ok" {
		t.Errorf("PASSAGE-DONE %q, want ok", run.Done)
	}

	for i, img := range images {
		b, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		// Any 16-byte piece of the marker counts, wherever it sits.
		for off := 0; off+16 <= len(tenantMarker); off += 8 {
			if j := bytes.Index(b, tenantMarker[off:off+16]); j >= 0 {
				t.Errorf("unit %d NVMe image: marker piece %q still at byte %d", i, tenantMarker[off:off+16], j)
				break
			}
		}
	}
	// The host NVMe was in reach: the nvme driver held it, and still wrote nothing.
	hostDrv := "(not in the readback)"
	for _, f := range readbackOf(t, run).Functions {
		if f.BDF == "0000:00:11.0" {
			hostDrv = f.Driver
		}
	}
	if hostDrv != "nvme" {
		t.Errorf("host NVMe 0000:00:11.0 on %q, want nvme", hostDrv)
	}
	for p, sum := range sums {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if sha256.Sum256(b) != sum {
			t.Errorf("host-kept disk %s changed: it must keep every byte", filepath.Base(p))
		}
	}

	if len(m.Units) != 2 {
		t.Fatalf("manifest has %d units, want 2", len(m.Units))
	}
	for _, u := range m.Units {
		if u.Status != manifest.StatusReady {
			t.Errorf("%s: %s %v, want ready", u.ID, u.Status, u.Reasons)
		}
		e := u.Erase
		if e == nil {
			t.Errorf("%s: no erase record", u.ID)
			continue
		}
		if e.Policy != "require" || len(e.NVMe) != 1 || e.ResetClears == "" {
			t.Errorf("%s: erase record %+v", u.ID, e)
			continue
		}
		n := e.NVMe[0]
		t.Logf("%s: %s %s (%s, serial %s, fw %s, SANICAP %s, FNA %s): %s in %v, %d LBAs verified; attempts %q",
			u.ID, n.BDF, n.Controller, n.Model, n.Serial, n.Firmware, n.SANICAP, n.FNA, n.Method, n.Duration, n.VerifiedLBAs, n.Attempts)
		if n.Error != "" || n.Method != "format-user-data-erase" || n.VerifiedLBAs == 0 || !strings.HasPrefix(n.Serial, "unit") {
			t.Errorf("%s: nvme record %+v", u.ID, n)
		}
		if len(n.Namespaces) != 1 || n.Namespaces[0].Blocks*uint64(n.Namespaces[0].BlockSize) != 32<<20 {
			t.Errorf("%s: namespaces %+v, want one of 32 MiB", u.ID, n.Namespaces)
		}
		if len(e.Resets) != len(u.Functions) {
			t.Errorf("%s: %d resets for %d functions", u.ID, len(e.Resets), len(u.Functions))
		}
		for _, r := range e.Resets {
			t.Logf("%s: reset %s (%s): %s", u.ID, r.BDF, r.Methods, r.Result)
			if r.Result != "done" {
				t.Errorf("%s: reset %s: %s", u.ID, r.BDF, r.Result)
			}
		}
		for _, f := range u.Functions {
			if f.DriverAfter != "vfio-pci" {
				t.Errorf("%s: %s on %q, want vfio-pci", u.ID, f.BDF, f.DriverAfter)
			}
		}
	}
	for _, s := range m.Stages {
		if s.Name == "erase" {
			t.Logf("erase stage: %s in %v", s.Status, s.Duration)
		}
	}
}

// TestRecycleRunningHost: on the running guest, after a boot that left the tenant's
// marker on unit 0's NVMe (passage.erase=off), `passage recycle --unit 0` is refused
// while a process holds unit 0's /dev/vfio/<group> open; once it is closed, recycle
// erases the NVMe (no marker anywhere in its image after power-off), resets the unit,
// binds it back to vfio-pci, and writes a manifest that verifies with a higher
// generation than the boot's. Unit 1, not asked for, keeps its marker. The node boots
// the signed image under Secure Boot with a TPM that has an EK certificate: recycle
// attests the generation it signs, and verify --attest (as an operator runs it, after
// enrolling the node) accepts the newest manifest with nobody quoting by hand.
func TestRecycleRunningHost(t *testing.T) {
	dir := t.TempDir()
	var images []string
	for i := 0; i < 2; i++ {
		p := filepath.Join(dir, "unit"+string(rune('0'+i))+"-nvme.img")
		markedImage(t, p, 16, tenantMarker)
		images = append(images, p)
	}
	ca := attesttest.NewCA(t)
	state := filepath.Join(dir, "tpm")
	attesttest.Manufacture(t, ca, state)
	work := filepath.Join(dir, "work")
	// Secure Boot locks the kernel down: the signed line carries the SKU's plan, which
	// the kernel programs (a unit whose ACS cannot be set is not ready).
	plan := planFor(t, Topology{})
	run, final := bootPassage(t, Options{Topology: Topology{NVMeImages: images}, Overlay: []OverlayFile{uinitOverlay(t, "recycler")},
		Append:  []string{"passage.erase=off", "passage.net=off", "passage.emit=off"},
		NetBoot: &NetBoot{}, TPMState: state, WorkDir: work, Timeout: 8 * time.Minute, Plan: plan})
	file := func(name string) string { return strings.TrimSpace(string(run.Files[name])) }
	for _, n := range []string{"recycle-held", "recycle"} {
		t.Logf("%s (exit %s):\n%s", n, file(n+".exit"), file(n+".out"))
	}
	if e := file("recycler-error.txt"); e != "" {
		t.Fatalf("guest: %s", e)
	}
	if file("recycle-held.exit") != "1" || !strings.Contains(file("recycle-held.out"), "is held open by pid") {
		t.Errorf("recycle while the group is open: exit %s, want 1 and the holder named", file("recycle-held.exit"))
	}
	for _, l := range strings.Split(file("drivers-held.txt"), "\n") {
		if !strings.HasSuffix(l, " vfio-pci") {
			t.Errorf("after the refused recycle: %s, want still vfio-pci", l)
		}
	}
	if file("recycle.exit") != "0" {
		t.Errorf("recycle after close: exit %s", file("recycle.exit"))
	}
	for _, l := range strings.Split(file("drivers-recycled.txt"), "\n") {
		if !strings.HasSuffix(l, " vfio-pci") {
			t.Errorf("after recycle: %s, want vfio-pci", l)
		}
	}

	bootEnv, ok := run.Files["boot-manifest.dsse.json"]
	if !ok {
		t.Fatal("no boot manifest from the guest")
	}
	bootM, err := manifest.Unmarshal(mustPayload(t, bootEnv))
	if err != nil {
		t.Fatal(err)
	}
	if final.Generation <= bootM.Generation || final.GenerationSource == manifest.GenerationNone {
		t.Errorf("recycle's generation %d (%s), boot's %d: want higher", final.Generation, final.GenerationSource, bootM.Generation)
	}
	var u0, u1 *manifest.Unit
	for i := range final.Units {
		switch final.Units[i].ID {
		case "gpu0":
			u0 = &final.Units[i]
		case "gpu1":
			u1 = &final.Units[i]
		}
	}
	if u0 == nil || u0.Status != manifest.StatusReady || u0.Erase == nil || len(u0.Erase.NVMe) != 1 || u0.Erase.NVMe[0].Method != "format-user-data-erase" {
		t.Errorf("gpu0 in the recycled manifest: %+v", u0)
	}
	if u1 == nil || u1.Erase != nil {
		t.Errorf("gpu1 in the recycled manifest: %+v, want carried from the boot", u1)
	}

	hasMarker := func(p string) bool {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return bytes.Contains(b, tenantMarker[:16]) || bytes.Contains(b, tenantMarker[20:36])
	}
	if hasMarker(images[0]) {
		t.Error("unit 0's NVMe image still holds the marker after recycle")
	}
	if !hasMarker(images[1]) {
		t.Error("unit 1's NVMe image lost its marker: recycle touched a unit it was not asked for")
	}

	// The verifier: enrol the node from the attestation beside the newest manifest (the
	// credential round against the TPM's state once QEMU is gone), then verify --attest.
	a, _ := attestationOf(t, run, nil)
	sock, stop := attesttest.Serve(t, state)
	tpm, err := tpmkey.Open(sock)
	if err != nil {
		t.Fatal(err)
	}
	rec, _ := verifiertest.Enrol(t, tpm.Transport(), ca, a)
	tpm.Close()
	stop()
	v := t.TempDir()
	write := func(name string, b []byte) string {
		t.Helper()
		p := filepath.Join(v, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	recJSON, _ := json.Marshal(rec)
	pemKey, err := rec.SigningKeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	apJSON, _ := json.Marshal(approvedFor(t, filepath.Join(work, "tftp", "passage.efi")))
	passage := filepath.Join(v, "passage")
	if out, err := exec.Command("go", "build", "-o", passage, "../cmd/passage").CombinedOutput(); err != nil {
		t.Fatalf("build passage: %v\n%s", err, out)
	}
	out, err := exec.Command(passage, "verify", "--tpm-pub", write("node.pub", pemKey),
		"--attest", write("manifest.dsse.json"+attest.Suffix, run.Files["manifest.dsse.json"+attest.Suffix]),
		"--node", write("node.json", recJSON), "--ek-ca", write("ek-ca.pem", ca.PEM(t)), "--approved", write("approved.json", apJSON),
		write("manifest.dsse.json", run.Files["manifest.dsse.json"])).CombinedOutput()
	t.Logf("passage verify --attest of generation %d:\n%s", final.Generation, out)
	if err != nil || !strings.Contains(string(out), "attested    EK certified") {
		t.Errorf("verify --attest of recycle's generation %d: %v", final.Generation, err)
	}
	if a.NonceSource != attest.NoncePayloadDigest {
		t.Errorf("recycle's attestation: nonce source %q", a.NonceSource)
	}
}

// mustPayload is the payload of an envelope the test verified elsewhere.
func mustPayload(t *testing.T, env []byte) []byte {
	t.Helper()
	var e struct {
		Payload []byte `json:"payload"`
	}
	if err := json.Unmarshal(env, &e); err != nil {
		t.Fatal(err)
	}
	return e.Payload
}

// BenchmarkBootErase is the time the erase stage adds to a boot: two units, each NVMe
// backed by a 32 MiB image full of a tenant's marker, booted with passage.erase=off and
// with passage.erase=require. It reports the guest's time from uinit start to the
// manifest written (the PCIe stages and the manifest) and the erase stage's own
// duration from the manifest. Run with -bench BootErase -benchtime 1x.
func BenchmarkBootErase(b *testing.B) {
	for _, policy := range []string{"off", "require"} {
		b.Run("erase="+policy, func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				dir := b.TempDir()
				var images []string
				for i := 0; i < 2; i++ {
					p := filepath.Join(dir, "unit"+string(rune('0'+i))+"-nvme.img")
					markedImage(b, p, 32, tenantMarker)
					images = append(images, p)
				}
				priv, pub, err := manifest.GenerateKey(dir)
				if err != nil {
					b.Fatal(err)
				}
				v, err := manifest.LoadVerifier(pub)
				if err != nil {
					b.Fatal(err)
				}
				build := buildDir(b)
				b.StartTimer()
				run, err := Boot(context.Background(), Options{Build: build, Key: priv, Name: b.Name(), WorkDir: filepath.Join(dir, "work"),
					Timeout: 4 * time.Minute, Topology: Topology{NVMeImages: images}, Append: []string{"passage.erase=" + policy, "passage.net=off"}})
				b.StopTimer()
				if err != nil {
					b.Fatal(err)
				}
				ver, err := manifest.Verify(run.Files["manifest.dsse.json"], v, manifest.VerifyOptions{})
				if err != nil {
					b.Fatal(err)
				}
				var stage time.Duration
				for _, s := range ver.Manifest.Stages {
					if s.Name == "erase" {
						stage = s.Duration
					}
				}
				b.ReportMetric(run.Markers["manifest-written"]-run.Markers["uinit-start"], "uinit-to-manifest-s")
				b.ReportMetric(stage.Seconds(), "erase-stage-s")
				b.StartTimer()
			}
		})
	}
}
