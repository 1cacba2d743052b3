package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// A node after its boot for unbind: unit 3 on vfio-pci (simulated kernel), a signed
// generation 1 saying every unit ready, the key where unbind reads it, a /proc.
func withdrawNode(t *testing.T) (root, gen string, k *vfiotest.Kernel, v manifest.Verifier) {
	t.Helper()
	n := pcitest.New(t, pcitest.B300())
	root = n.Root
	for p, c := range map[string]string{"proc/sys/kernel/random/boot_id": "6f1c2a4e-8d3b-4c7a-9e15-2b7d0f4a9c31\n", "proc/cmdline": "console=ttyS0\n"} {
		os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(root, p), []byte(c), 0o644)
	}
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	tree, _ := pci.Scan(root)
	p, _ := topology.LoadProfile("b300")
	labels, _ := topology.Label(tree, p)
	if rep, err := vfiobind.Bind(context.Background(), k, tree, []*topology.Unit{labels.Unit(3)}, vfiobind.Options{Modules: k}); err != nil || !rep.Units[0].Bound() {
		t.Fatalf("bind unit 3: %v", err)
	}
	os.MkdirAll(filepath.Join(root, "etc/passage"), 0o755)
	priv, pub, err := manifest.GenerateKey(filepath.Join(root, "etc/passage"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(priv, filepath.Join(root, "etc/passage/key")); err != nil {
		t.Fatal(err)
	}
	s, _ := manifest.LoadSigner(filepath.Join(root, "etc/passage/key"))
	if v, err = manifest.LoadVerifier(pub); err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Build(root, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range labels.Units {
		m.Units = append(m.Units, manifest.Unit{ID: u.ID.String(), Status: manifest.StatusReady})
	}
	gen = filepath.Join(t.TempDir(), "generation")
	m.Generation, m.GenerationSource, _ = manifest.NextGeneration(manifest.FileCounter{Path: gen})
	dir := filepath.Join(root, "run/passage")
	os.MkdirAll(dir, 0o755)
	if _, err := manifest.WriteSigned(context.Background(), m, dir, "manifest.dsse.json", nil, s); err != nil {
		t.Fatal(err)
	}
	return root, gen, k, v
}

func latestManifest(t *testing.T, root string, v manifest.Verifier) *manifest.Manifest {
	t.Helper()
	env, err := manifest.ReadEnvelope(filepath.Join(root, "run/passage/manifest.dsse.json"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return got.Manifest
}

// unbind refuses while a VMM holds the unit's device cdev (iommufd) or group, and
// without a counter; otherwise it writes a generation saying the unit is failed before
// it releases anything.
func TestUnbindWithdrawsTheUnit(t *testing.T) {
	root, gen, k, v := withdrawNode(t)
	env := unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }}
	nvme := unitFunctionAddrs(t, root, 3)[3]
	os.MkdirAll(filepath.Join(root, "sys/bus/pci/devices", nvme.String(), "vfio-dev/vfio2"), 0o755)
	fd := filepath.Join(root, "proc/777/fd")
	os.MkdirAll(fd, 0o755)
	os.WriteFile(filepath.Join(root, "proc/777/comm"), []byte("qemu-system-x86\n"), 0o644)
	os.Symlink("/dev/iommu", filepath.Join(fd, "9"))
	os.Symlink("/dev/vfio/devices/vfio2", filepath.Join(fd, "10"))

	base := []string{"--root", root, "--unit", "gpu3", "--tpm", "off"}
	k.ResetWrites()
	code, out, errs := runCmdEnv(t, env, append(base, "--generation-file", gen)...)
	if code != 1 || out != "" || !strings.Contains(errs, "/dev/vfio/devices/vfio2 is held open by pid 777 (qemu-system-x86)") {
		t.Errorf("held cdev: exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
	os.RemoveAll(filepath.Join(root, "proc/777"))
	code, out, errs = runCmdEnv(t, env, base...)
	if code != 1 || out != "" || !strings.Contains(errs, "no generation counter") {
		t.Errorf("no counter: exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
	if w := k.Writes(); len(w) != 0 {
		t.Errorf("refused, yet %d sysfs writes", len(w))
	}
	if m := latestManifest(t, root, v); m.Generation != 1 {
		t.Errorf("refused, yet generation %d", m.Generation)
	}

	code, out, errs = runCmdEnv(t, env, append(base, "--generation-file", gen)...)
	if code != 0 || !strings.HasPrefix(out, "manifest generation 2 (file): gpu3=failed\n") {
		t.Fatalf("unbind: exit %d\nstdout %q\nstderr %q", code, out, errs)
	}
	m := latestManifest(t, root, v)
	for _, u := range m.Units {
		want := manifest.StatusReady
		if u.ID == "gpu3" {
			want = manifest.StatusFailed
		}
		if u.Status != want || (u.ID == "gpu3" && !strings.Contains(strings.Join(u.Reasons, ";"), "unbind: returned to host drivers")) {
			t.Errorf("generation %d: %s %s %q, want %s", m.Generation, u.ID, u.Status, u.Reasons, want)
		}
	}
}

func runCmdEnv(t *testing.T, env unbindEnv, args ...string) (int, string, string) {
	t.Helper()
	return runCmd(t, func(a []string, o, e io.Writer) int { return runUnbind(a, o, e, env) }, args...)
}
