//go:build qemu

package qemutest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestMain prints, after the suite, each boot's boot-to-manifest time and the suite's
// wall time: the figures the note records.
func TestMain(m *testing.M) {
	start := time.Now()
	code := m.Run()
	if ts := Timings(); len(ts) > 0 {
		fmt.Println("QEMU boots (boot-to-manifest = kernel start to PASSAGE-T manifest-written, guest clock):")
		for _, t := range ts {
			fmt.Println("  " + t.String())
		}
		fmt.Printf("QEMU suite: %d boots in %v wall time\n", len(ts), time.Since(start).Round(time.Second))
	}
	os.Exit(code)
}

// buildDir is the image of the suite's kernel (PASSAGE_KERNEL, 6.12 when unset) under
// the build directory the Makefile passes as PASSAGE_BUILD.
func buildDir(t testing.TB) string {
	t.Helper()
	k := os.Getenv("PASSAGE_KERNEL")
	if k == "" {
		k = DefaultKernel
	}
	return kernelBuild(t, k)
}

// kernelBuild is the image of kernel line k (`make initramfs KERNEL=k`): a scenario that
// must hold on another kernel than the suite's boots it. A missing image fails the test:
// `make qemu-test` builds every kernel the suite names.
func kernelBuild(t testing.TB, k string) string {
	t.Helper()
	b := os.Getenv("PASSAGE_BUILD")
	if b == "" {
		t.Fatal("PASSAGE_BUILD is not set: run `make qemu-test` (it builds the kernels and initramfs images first)")
	}
	dir := filepath.Join(b, "linux-"+k)
	if _, err := os.Stat(filepath.Join(dir, "initramfs.cpio.gz")); err != nil {
		t.Fatalf("no image for kernel %s: %v (make initramfs KERNEL=%s)", k, err, k)
	}
	return dir
}

// fakeUinit builds the protocol test double as a static binary, overlaid as /bbin/uinit
// (u-root's init tries /bbin/uinit before /bin/uinit).
func fakeUinit(t *testing.T) OverlayFile { return uinitOverlay(t, "fakeuinit") }

// preflightUinit builds internal/preflight, overlaid as /bbin/uinit: plan and apply
// --dry-run on the guest's /sys, then the real passage boot.
func preflightUinit(t *testing.T) OverlayFile { return uinitOverlay(t, "preflight") }

func uinitOverlay(t *testing.T, name string) OverlayFile {
	t.Helper()
	bin := filepath.Join(t.TempDir(), name)
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin, "./internal/"+name)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", name, err, out)
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	return OverlayFile{Name: "bbin/uinit", Data: data, Mode: 0o755}
}

type fakeFunction struct {
	BDF, Vendor, Device, Class, Driver, IOMMUGroup, PortType, ACSCap, ACSCtl string
	Parents                                                                  []string
	ATS, ATSEnabled                                                          bool
	Resource                                                                 string // sysfs resource
}

func bootFake(t *testing.T, topo Topology, extra ...string) (*Run, []fakeFunction) {
	t.Helper()
	run, err := Boot(context.Background(), Options{
		Build:    buildDir(t),
		Overlay:  []OverlayFile{fakeUinit(t)},
		Name:     t.Name(),
		Topology: topo,
		Append:   extra,
		WorkDir:  filepath.Join(t.TempDir(), "work"),
	})
	if run != nil {
		t.Logf("console: %s; wall %v, to PASSAGE-DONE %v\n%s", run.Console, run.Wall, run.WallDone, run.Timeline())
	}
	if err != nil {
		t.Fatal(err)
	}
	if run.Done != "ok" {
		t.Fatalf("PASSAGE-DONE %q, want ok; kmod-error: %s", run.Done, run.Files["kmod-error"])
	}
	var fns []fakeFunction
	if err := json.Unmarshal(run.Files["pci.json"], &fns); err != nil {
		t.Fatalf("pci.json: %v", err)
	}
	t.Logf("%s topology, as the guest sees it:\n%s", topo.Name(), run.Files["pci.txt"])
	return run, fns
}

// TestHarnessFakeUinit checks the harness end to end with the protocol test double:
// the overlay runs, file blocks decode, markers arrive, the TPM is there, and
// initramfs/kmod loads the vfio stack and the NIC/NVMe drivers on Debian's real kernel
// from the modules the image carries.
func TestHarnessFakeUinit(t *testing.T) {
	run, fns := bootFake(t, Topology{})
	for _, ev := range []string{"uinit-start", "manifest-written", "handoff"} {
		if _, ok := run.Markers[ev]; !ok {
			t.Errorf("no PASSAGE-T %s marker", ev)
		}
	}
	if run.Markers["uinit-start"] <= 0 || run.Markers["handoff"] < run.Markers["uinit-start"] {
		t.Errorf("markers out of order: %v", run.Markers)
	}
	if string(run.Files["tpm"]) != "/dev/tpm0\n" {
		t.Errorf("no /dev/tpm0 in the guest")
	}
	// QEMU's user network (restrict=on) serves DHCP: 10.0.2.15 is its first lease.
	if !strings.Contains(string(run.Files["dhcp.txt"]), "lease 10.0.2.15") {
		t.Errorf("dhcp: %s", run.Files["dhcp.txt"])
	}
	if !strings.Contains(string(run.Files["cmdline"]), "intel_iommu=on") {
		t.Errorf("cmdline %q", run.Files["cmdline"])
	}
	var km struct {
		Modules []struct {
			Name, Err     string
			AlreadyLoaded bool
			Sysfs         bool
		}
	}
	if err := json.Unmarshal(run.Files["kmod.json"], &km); err != nil {
		t.Fatal(err)
	}
	loaded := map[string]bool{}
	for _, m := range km.Modules {
		if m.Err != "" || !m.Sysfs {
			t.Errorf("module %s: err %q, in /sys/module: %v", m.Name, m.Err, m.Sysfs)
		}
		loaded[m.Name] = true
	}
	for _, n := range []string{"vfio", "vfio_iommu_type1", "irqbypass", "vfio_pci_core", "vfio_pci", "nvme_core", "nvme", "virtio_net", "e1000e"} {
		if !loaded[n] {
			t.Errorf("module %s not loaded", n)
		}
	}
	// The default topology: 2 units each with a GPU stand-in, two ATS-capable NIC PFs
	// and an NVMe, plus the e1000e management NIC on its driver.
	count := map[string]int{}
	for _, f := range fns {
		id := f.Vendor + ":" + f.Device
		count[id]++
		switch id {
		case "1af4:1041":
			if !f.ATS || f.Driver != "virtio-pci" {
				t.Errorf("NIC stand-in %s: ATS %v driver %q", f.BDF, f.ATS, f.Driver)
			}
		case "8086:10d3":
			if f.Driver != "e1000e" {
				t.Errorf("management NIC %s: driver %q", f.BDF, f.Driver)
			}
		case "1b36:000c":
			if f.ACSCap == "" {
				t.Errorf("pcie-root-port %s: no ACS capability", f.BDF)
			}
		}
	}
	want := map[string]int{"1af4:1041": 4, "1af4:1050": 2, "1b36:0010": 2, "8086:10d3": 1, "104c:8232": 6}
	for id, n := range want {
		if count[id] != n {
			t.Errorf("%d functions %s, want %d", count[id], id, n)
		}
	}
}

// TestTopologyVariants boots each variant once with the test double and checks the
// property the scenario relies on, as the guest's own config space shows it.
func TestTopologyVariants(t *testing.T) {
	_, fns := bootFake(t, Topology{ATSOff: true, SharedGroup: true, NoACSPort: true})
	var noATS, e1000 []fakeFunction
	for _, f := range fns {
		switch f.Vendor + ":" + f.Device {
		case "1af4:1041":
			if !f.ATS {
				noATS = append(noATS, f)
			}
		case "8086:100e":
			e1000 = append(e1000, f)
		case "104c:8233":
			if f.ACSCap != "" {
				t.Errorf("xio3130-downstream %s has ACS %s", f.BDF, f.ACSCap)
			}
		}
	}
	if len(noATS) != 1 {
		t.Errorf("%d NIC stand-ins without ATS, want 1", len(noATS))
	}
	if len(e1000) != 2 || e1000[0].IOMMUGroup == "" || e1000[0].IOMMUGroup != e1000[1].IOMMUGroup {
		t.Errorf("e1000s behind the pcie-pci-bridge: %+v, want 2 in one IOMMU group", e1000)
	}
}

// TestImageGoDefaults: the busybox in the image runs with the GODEBUG defaults a go build
// of passage has (its go.mod's: none), not with those of GOPATH mode, in which gobusybox
// builds it (go 1.20's: panicnil=1, tlsrsakex=1, tls3des=1, x509negativeserial=1, ...).
// image/initramfs.sh replaces runtime.godebugDefault with -X. The build information
// still records GOPATH mode's defaults (with -trimpath it records no -ldflags), so the
// test holds the image to a GOPATH-mode build of a small program: without the -X its
// binary carries the defaults string once more (runtime.godebugDefault) than with it,
// and recovers go 1.20's nil from panic(nil); the image's busybox carries the string as
// often as the build with the -X.
func TestImageGoDefaults(t *testing.T) {
	dir := t.TempDir()
	core := filepath.Join(os.Getenv("PASSAGE_BUILD"), "uroot.cpio")
	f, err := os.Open(core)
	if err != nil {
		t.Fatalf("%v (run make qemu-test)", err)
	}
	defer f.Close()
	cmd := exec.Command("cpio", "-i", "--quiet", "--make-directories", "bbin/bb")
	cmd.Dir, cmd.Stdin = dir, f
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i bbin/bb < %s: %v: %s", core, err, out)
	}
	if want, err := exec.Command("go", "list", "-f", "{{.DefaultGODEBUG}}", "../cmd/passage").Output(); err != nil || strings.TrimSpace(string(want)) != "" {
		t.Fatalf("go list -f {{.DefaultGODEBUG}} ./cmd/passage: %q, %v: initramfs.sh sets what it says; this test expects none", want, err)
	}
	defaults := func(bin string) (string, int) {
		t.Helper()
		out, err := exec.Command("go", "version", "-m", bin).Output()
		if err != nil {
			t.Fatal(err)
		}
		_, v, _ := strings.Cut(string(out), "DefaultGODEBUG=")
		v, _, _ = strings.Cut(v, "\n")
		if !strings.Contains(v, "panicnil=1") {
			t.Fatalf("%s: build information records DefaultGODEBUG=%q, not GOPATH mode's", bin, v)
		}
		b, err := os.ReadFile(bin)
		if err != nil {
			t.Fatal(err)
		}
		return v, bytes.Count(b, []byte(v))
	}
	bbDefaults, bbCount := defaults(filepath.Join(dir, "bbin", "bb"))

	src := filepath.Join(dir, "gopath", "src", "panicnil")
	if err := os.MkdirAll(src, 0o755); err != nil {
		t.Fatal(err)
	}
	prog := "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tdefer func() { fmt.Printf(\"%T\", recover()) }()\n\tpanic(nil)\n}\n"
	if err := os.WriteFile(filepath.Join(src, "main.go"), []byte(prog), 0o644); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	for _, c := range []struct{ ldflags, recovers string }{{"-s -w", "<nil>"}, {"-s -w -X=runtime.godebugDefault=", "*runtime.PanicNilError"}} {
		bin := filepath.Join(dir, "panicnil"+strconv.Itoa(len(c.ldflags)))
		build := exec.Command("go", "build", "-trimpath", "-ldflags="+c.ldflags, "-o", bin, ".")
		build.Dir = src
		build.Env = append(os.Environ(), "GO111MODULE=off", "GOPATH="+filepath.Join(dir, "gopath"), "GOFLAGS=")
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("GOPATH-mode build: %v: %s", err, out)
		}
		out, err := exec.Command(bin).Output()
		if err != nil || string(out) != c.recovers {
			t.Errorf("GOPATH-mode build with -ldflags=%q recovers %q (%v), want %q", c.ldflags, out, err, c.recovers)
		}
		v, n := defaults(bin)
		if v != bbDefaults {
			t.Fatalf("GOPATH-mode defaults %q, the image's busybox %q", v, bbDefaults)
		}
		counts[c.ldflags] = n
	}
	without, with := counts["-s -w"], counts["-s -w -X=runtime.godebugDefault="]
	if without != with+1 {
		t.Fatalf("GOPATH-mode builds carry the defaults string %d times without the -X, %d with it: the test's premise is wrong", without, with)
	}
	if bbCount != with {
		t.Errorf("the image's busybox carries GOPATH mode's defaults %d times, a build with runtime.godebugDefault replaced %d, without %d: it runs with go 1.20's defaults", bbCount, with, without)
	}
}
