//go:build qemu

package qemutest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/hypervisor/libvirttest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/topology"
)

// guestFromManifest is the hypervisor's half of scenario 1: verify the manifest the
// guest wrote with the TPM's public key (tpmPub, PEM, as passage tpm-pubkey prints it),
// render the guest from it with
// `passage render MANIFEST` (the command, built for this host), boot the
// guest-topology check on that rendering (emulated stand-ins in place of vfio-pci, the
// same plan), and hold the distances the guest's own kernel shows against the
// manifest's expected guest matrix, cell for cell.
func guestFromManifest(t *testing.T, run *Run, tpmPub string) {
	t.Helper()
	dir := t.TempDir()
	env := filepath.Join(dir, "manifest.dsse.json")
	if err := os.WriteFile(env, run.Files["manifest.dsse.json"], 0o644); err != nil {
		t.Fatal(err)
	}
	passage := filepath.Join(dir, "passage")
	if out, err := exec.Command("go", "build", "-o", passage, "../cmd/passage").CombinedOutput(); err != nil {
		t.Fatalf("build passage: %v\n%s", err, out)
	}
	var stdout, stderr bytes.Buffer
	render := exec.Command(passage, "render", "--tpm-pub", tpmPub, "--format", "qemu", env)
	render.Stdout, render.Stderr = &stdout, &stderr
	if err := render.Run(); err != nil {
		t.Fatalf("passage render MANIFEST: %v\n%s", err, stderr.String())
	}

	// The same verified payload, read as the command reads it: the plan it rendered.
	v, err := manifest.LoadVerifier(tpmPub)
	if err != nil {
		t.Fatal(err)
	}
	ver, err := manifest.Verify(run.Files["manifest.dsse.json"], v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := ver.Manifest
	src, err := hypervisor.Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	g, _, err := hypervisor.Plan(hypervisor.Input{Sources: src})
	if err != nil {
		t.Fatal(err)
	}
	// render's first line gives the guest the address width the units' BARs (signed in
	// the manifest) need, then the plan's devices.
	if got := fmt.Sprintf("-cpu host,phys-bits=%d \\\n", g.MMIO().Width) + g.QEMUText(nil); got != stdout.String() {
		t.Fatalf("passage render printed\n%s\nthe manifest's plan is\n%s", stdout.String(), got)
	}
	t.Logf("passage render --format qemu MANIFEST:\n%s", stdout.String())
	domainsFromManifest(t, passage, env, tpmPub, m)

	got := bootGuestCheck(t, g, "from-manifest")
	exp := m.GuestPlan
	if exp == nil {
		t.Fatal("the manifest has no guest plan")
	}
	if strings.Join(got.Host.Names, " ") != strings.Join(exp.MatrixLabels, " ") {
		t.Fatalf("guest matrix names %v, manifest %v", got.Host.Names, exp.MatrixLabels)
	}
	// The manifest's matrix names NVLink between GPUs where the profile has it: NVLink is
	// not PCIe, and the stand-ins have none.
	pcie := g.Matrix(0)
	for i, a := range exp.MatrixLabels {
		for j, b := range exp.MatrixLabels {
			want := exp.ExpectedGuest[i][j]
			if strings.HasPrefix(want, "NV") {
				want = pcie.Cells[i][j]
			}
			if c := got.Host.Cells[i][j]; c != want {
				t.Errorf("guest %s-%s = %q, manifest predicts %q", a, b, c, want)
			}
		}
	}
	var addrs []string
	for _, a := range pcie.Addrs {
		addrs = append(addrs, a.String())
	}
	if strings.Join(got.Host.Addrs, " ") != strings.Join(addrs, " ") {
		t.Errorf("guest matrix addresses %v, rendered %v", got.Host.Addrs, addrs)
	}
	t.Logf("guest matrix as the guest measured it, equal to the manifest's:\n%s", textOf(got.Host))
}

// bootGuestCheck boots the image with the plan's devices as emulated stand-ins, runs
// `passage plan --json` inside with the qemu-guest profile and returns what it measured.
func bootGuestCheck(t *testing.T, g *topology.Guest, name string) measuredPlan {
	t.Helper()
	_, got := measureGuest(t, guestBoot{Name: name, Devices: g.QEMUArgs(topology.EmulatedDevice)})
	if len(got.Units) != len(g.Units) {
		t.Fatalf("guest plan: %d units, want %d", len(got.Units), len(g.Units))
	}
	return got
}

// domainsFromManifest renders the libvirt domain of every unit (--unit all) from the
// manifest of a real boot, flat and with --numa, for kvm and for qemu, and has libvirt
// judge each: virt-xml-validate against libvirt's schema, then virsh define in a
// libvirtd of the test's own, which keeps every hostdev. The boot's units have numa_node
// -1 (the scenario's VM defines no NUMA node), the case a hand-made domain got wrong.
func domainsFromManifest(t *testing.T, passage, env, tpmPub string, m *manifest.Manifest) {
	t.Helper()
	var nodes []string
	for _, u := range m.Units {
		nodes = append(nodes, fmt.Sprintf("%s numa_node %d", u.ID, u.NUMANode))
	}
	dir := t.TempDir()
	uri := libvirttest.Start(t)
	host := kvmHost(t)
	for _, numa := range []bool{false, true} {
		for _, typ := range []string{"kvm", "qemu"} {
			name := "passage-scenario1-" + typ
			args := []string{"render", env, "--tpm-pub", tpmPub, "--format", "libvirt", "--unit", "all",
				"--domain-type", typ, "--vcpus", "2", "--memory", "1024"}
			if numa {
				name += "-numa"
				args = append(args, "--numa")
			}
			args = append(args, "--name", name)
			out, err := exec.Command(passage, args...).Output()
			if err != nil {
				t.Fatalf("passage %s: %v", strings.Join(args, " "), err)
			}
			f := filepath.Join(dir, name+".xml")
			if err := os.WriteFile(f, out, 0o644); err != nil {
				t.Fatal(err)
			}
			if v, err := exec.Command("virt-xml-validate", f, "domain").CombinedOutput(); err != nil || !strings.Contains(string(v), "validates") {
				t.Errorf("%s: virt-xml-validate: %v\n%s\n%s", name, err, v, out)
				continue
			}
			host.Define(t, uri, f)
			dumped := libvirttest.Virsh(t, uri, "dumpxml", name)
			libvirttest.Virsh(t, uri, "undefine", name)
			if got, want := strings.Count(dumped, "<hostdev "), strings.Count(string(out), "<hostdev "); got != want || want == 0 {
				t.Errorf("%s: libvirt keeps %d hostdevs of %d rendered", name, got, want)
			}
			t.Logf("%s (%s): virt-xml-validate and virsh define accept it", name, strings.Join(nodes, ", "))
		}
	}
}
