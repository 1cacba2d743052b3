package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/stages/boot"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

const testBootID = "0c6a3f0e-5b7d-4b1e-9d2a-3e4f5a6b7c8d"

// signedNode is a tree that booted: the boot's stages from scan to manifest ran on it
// (binding through a simulated kernel) and signed the manifest with a key of its own.
type signedNode struct {
	root, envelope, pub string
	m                   *manifest.Manifest
}

func bootSigned(t testing.TB, spec pcitest.Spec) signedNode {
	t.Helper()
	root := pcitest.New(t, spec).Root
	for name, body := range map[string]string{
		"proc/sys/kernel/random/boot_id": testBootID + "\n",
		// B300.md: two sockets, GPUs 0-3 on node 0 and 4-7 on node 1.
		"sys/devices/system/node/node0/cpulist": "0-63,128-191\n",
		"sys/devices/system/node/node1/cpulist": "64-127,192-255\n",
	} {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(root, "etc/passage"), 0o755); err != nil {
		t.Fatal(err)
	}
	priv, pub, err := manifest.GenerateKey(filepath.Join(root, "etc/passage"))
	if err != nil {
		t.Fatal(err)
	}
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Load(vfiobind.Modules...); err != nil {
		t.Fatal(err)
	}
	cfg := initramfs.Defaults()
	cfg.Profile, cfg.Net, cfg.TPM = "b300", initramfs.NetOff, initramfs.TPMOff
	cfg.Erase = "off" // the erase stage needs NVMe controllers a synthetic tree has not
	cfg.Key = strings.TrimPrefix(priv, root)
	// passage.out on a "disk" that is a directory of the tree: the generation counter
	// file lives there, so the manifest's generation is 1 from source file.
	cfg.Out = initramfs.Out{Device: "/dev/vdz", Path: "/passage"}
	mount := func(dev, dir string) (func() error, error) {
		return func() error { return nil }, os.MkdirAll(dir, 0o755)
	}
	b := &boot.Boot{Root: root, Config: cfg, Sysfs: k, Mount: mount, Now: func() time.Time { return time.Unix(1e9, 0) }}
	var run []stages.Stage
	for _, s := range b.Stages() {
		switch s.Name {
		case "scan", "decide", "acs", "vfio", "manifest":
			run = append(run, s)
		}
	}
	rn := &stages.Runner{Stages: run, Timeout: 10 * time.Second}
	if _, err := rn.Run(context.Background(), &stages.State{}); err != nil {
		t.Fatal(err)
	}
	if b.Signed == nil || b.Manifest == nil {
		t.Fatal("the boot signed no manifest")
	}
	return signedNode{root: root, envelope: filepath.Join(b.RunDir(), boot.EnvelopeName), pub: pub, m: b.Manifest}
}

// TestRenderFromManifest: a signed B300 manifest renders units 0,1, flat and with NUMA,
// in every format, to exactly the bytes the same tree renders to directly.
func TestRenderFromManifest(t *testing.T) {
	n := bootSigned(t, pcitest.B300())
	for _, u := range n.m.Units {
		if u.Status != manifest.StatusReady {
			t.Fatalf("reference boot: %s %s %v", u.ID, u.Status, u.Reasons)
		}
		if u.UpLink.Speed == "" || u.UpLink.Width == 0 {
			t.Errorf("%s: manifest carries no uplink: %+v", u.ID, u.UpLink)
		}
	}
	// The tree's renderings first; then the tree goes, and the manifest (moved out of it)
	// must render the same bytes: it reads nothing else.
	type rendering struct {
		args []string
		tree string
	}
	var all []rendering
	for _, layout := range [][]string{{"--unit", "0,1"}, {"--unit", "gpu0,gpu1", "--numa"}, {"--unit", "all", "--numa"}} {
		for _, format := range []string{"qemu", "libvirt", "libvirt-devices", "nccl-xml"} {
			args := append([]string{"--format", format}, layout...)
			code, fromTree, errs := runCmd(t, cmdRender, append([]string{"--root", n.root}, args...)...)
			if code != 0 || !strings.Contains(errs, "planning output") || len(fromTree) == 0 {
				t.Fatalf("render --root %v: exit %d, stderr %q", args, code, errs)
			}
			all = append(all, rendering{args, fromTree})
		}
	}
	away := t.TempDir()
	for _, f := range []*string{&n.envelope, &n.pub} {
		b, err := os.ReadFile(*f)
		if err != nil {
			t.Fatal(err)
		}
		*f = filepath.Join(away, filepath.Base(*f))
		if err := os.WriteFile(*f, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.RemoveAll(n.root); err != nil {
		t.Fatal(err)
	}
	for _, r := range all {
		code, fromManifest, errs := runCmd(t, cmdRender, append([]string{n.envelope, "--pub", n.pub}, r.args...)...)
		// The one line on stderr names the key that signed what is rendered.
		// For qemu and libvirt a second line names the MMIO the guest's BARs need.
		if code != 0 || !regexp.MustCompile(`^passage render: \S+: signed by SHA256:\S+ \(passage\.pub\)\n(passage render: the guest's 64-bit BARs need \d+ [KMGT]iB of MMIO: a \d+-bit physical address width \(rendered: \d+\)\n)?$`).MatchString(errs) {
			t.Fatalf("render --manifest %v: exit %d, stderr %q", r.args, code, errs)
		}
		if fromManifest != r.tree {
			t.Errorf("render %v: the manifest's rendering differs from the tree's\nmanifest:\n%s\ntree:\n%s", r.args, fromManifest, r.tree)
		}
		if r.args[1] != "qemu" && xml.Unmarshal([]byte(fromManifest), new(struct{})) != nil {
			t.Errorf("render %v: not XML:\n%s", r.args, fromManifest)
		}
	}
	// What the renderings hold, checked against the manifest rather than the renderer.
	_, dom, _ := runCmd(t, cmdRender, n.envelope, "--pub", n.pub, "--format", "libvirt", "--unit", "0,1", "--numa", "--vcpus", "4", "--memory", "8192")
	for _, u := range n.m.Units[:2] {
		for _, f := range u.Functions {
			var a struct{ d, b, s, f string }
			a.d, a.b, a.s, a.f = f.BDF[0:4], f.BDF[5:7], f.BDF[8:10], f.BDF[11:]
			want := "<address domain=\"0x" + a.d + "\" bus=\"0x" + a.b + "\" slot=\"0x" + a.s + "\" function=\"0x" + a.f + "\"></address>"
			if !strings.Contains(dom, want) {
				t.Errorf("domain lacks %s's host source %s", f.BDF, want)
			}
		}
	}
	for _, want := range []string{`<domain type="kvm">`, `<name>passage-gpu0-gpu1</name>`, `<memory unit="MiB">8192</memory>`,
		`<vcpu placement="static">4</vcpu>`, `managed="no"`, `model="pcie-expander-bus"`, `<cell id="0" cpus="0-3" memory="8192" unit="MiB">`,
		`<memnode cellid="0" mode="strict" nodeset="0">`} {
		if !strings.Contains(dom, want) {
			t.Errorf("domain lacks %s:\n%s", want, dom)
		}
	}
	// Across sockets: one cell per host node, its vCPUs pinned to that node's CPUs.
	code, dom2, errs := runCmd(t, cmdRender, n.envelope, "--pub", n.pub, "--format", "libvirt", "--unit", "0,4", "--numa", "--vcpus", "4", "--memory", "8192")
	for _, want := range []string{`<cell id="0" cpus="0-1" memory="4096" unit="MiB">`, `<cell id="1" cpus="2-3" memory="4096" unit="MiB">`,
		`<vcpupin vcpu="1" cpuset="0-63,128-191">`, `<vcpupin vcpu="2" cpuset="64-127,192-255">`, `<memnode cellid="1" mode="strict" nodeset="1">`} {
		if code != 0 || !strings.Contains(dom2, want) {
			t.Errorf("units 0,4 --numa: exit %d %s; domain lacks %s:\n%s", code, errs, want, dom2)
		}
	}
	if got := n.m.NUMACPUs; len(got) != 2 || got[1].Node != 1 || got[1].CPUs != "64-127,192-255" {
		t.Errorf("manifest numa_cpus %+v", got)
	}
	if c := strings.Count(dom, "<hostdev "); c != 2*len(n.m.Units[0].Functions) {
		t.Errorf("domain has %d hostdevs, want %d", c, 2*len(n.m.Units[0].Functions))
	}
	if strings.Contains(dom, `managed="yes"`) {
		t.Error("a hostdev is managed: libvirt would rebind what passage bound")
	}
}

// TestRenderRefusals: every reason to refuse exits 1, names the reason on stderr and
// prints nothing on stdout.
func TestRenderRefusals(t *testing.T) {
	n := bootSigned(t, pcitest.B300())
	other := bootSigned(t, pcitest.B300())
	degraded := bootSigned(t, b300With(func(s *pcitest.Spec) { s.Fn("nic0.0").ATS, s.Fn("nic0.1").ATS = nil, nil })())
	failed := bootSigned(t, b300With(func(s *pcitest.Spec) { s.Fn("gpu-dsp1").ACS = nil })())
	if degraded.m.Units[0].Status != manifest.StatusDegraded || failed.m.Units[1].Status != manifest.StatusFailed {
		t.Fatalf("variants: unit 0 %s, unit 1 %s; want degraded and failed", degraded.m.Units[0].Status, failed.m.Units[1].Status)
	}

	env, err := os.ReadFile(n.envelope)
	if err != nil {
		t.Fatal(err)
	}
	var e map[string]any
	if err := json.Unmarshal(env, &e); err != nil {
		t.Fatal(err)
	}
	sigs := e["signatures"].([]any)
	sig := sigs[0].(map[string]any)
	raw, _ := base64.StdEncoding.DecodeString(sig["sig"].(string))
	raw[0] ^= 0xff
	sig["sig"] = base64.StdEncoding.EncodeToString(raw)
	badSig, _ := json.Marshal(e)
	badSigFile := filepath.Join(t.TempDir(), "badsig.dsse.json")
	if err := os.WriteFile(badSigFile, badSig, 0o644); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"bad signature", []string{badSigFile, "--pub", n.pub}, "bad signature"},
		{"wrong key", []string{n.envelope, "--pub", other.pub}, "another key"},
		{"old generation", []string{n.envelope, "--pub", n.pub, "--min-generation", "2"}, "generation 1"},
		{"other boot", []string{n.envelope, "--pub", n.pub, "--boot-id", "11111111-2222-3333-4444-555555555555"}, "boot"},
		{"failed unit", []string{failed.envelope, "--pub", failed.pub, "--unit", "0,1"}, "gpu1 is failed"},
		{"failed unit, degraded allowed", []string{failed.envelope, "--pub", failed.pub, "--unit", "1", "--allow-degraded"}, "gpu1 is failed"},
		{"degraded without the flag", []string{degraded.envelope, "--pub", degraded.pub, "--unit", "0"}, "gpu0 is degraded"},
		{"failed unit from the tree", []string{"--root", failed.root, "--unit", "1"}, "gpu1 is failed"},
	} {
		for _, format := range []string{"qemu", "libvirt"} {
			code, out, errs := runCmd(t, cmdRender, append(c.args, "--format", format)...)
			if code != 1 || out != "" || !strings.Contains(errs, "REFUSED") || !strings.Contains(errs, c.want) {
				t.Errorf("%s (%s): exit %d, stdout %d bytes, stderr %q; want exit 1, no output, REFUSED ... %s", c.name, format, code, len(out), errs, c.want)
			}
		}
	}

	// The manifest's own generation and boot are accepted.
	if n.m.Generation != 1 || n.m.GenerationSource != manifest.GenerationFile {
		t.Fatalf("generation %d from %s, want 1 from the file counter", n.m.Generation, n.m.GenerationSource)
	}
	if code, _, errs := runCmd(t, cmdRender, n.envelope, "--pub", n.pub, "--min-generation", "1", "--boot-id", testBootID, "--unit", "0"); code != 0 {
		t.Errorf("the right boot: exit %d %s", code, errs)
	}
	// Degraded with the flag: rendered, and named.
	code, out, errs := runCmd(t, cmdRender, degraded.envelope, "--pub", degraded.pub, "--unit", "0,1", "--allow-degraded", "--format", "libvirt")
	if code != 0 || !strings.Contains(errs, "gpu0 is degraded") || !strings.Contains(out, "<description>gpu0 is degraded") || strings.Contains(errs, "gpu1") {
		t.Errorf("degraded with --allow-degraded: exit %d, stderr %q\n%s", code, errs, out)
	}
	code, out, errs = runCmd(t, cmdRender, degraded.envelope, "--pub", degraded.pub, "--unit", "0", "--allow-degraded", "--format", "qemu")
	if code != 0 || !strings.HasPrefix(out, "# passage: gpu0 is degraded: ") || strings.Count(out, "\n# ") != 0 {
		t.Errorf("degraded with --allow-degraded, qemu: exit %d, stderr %q\n%s", code, errs, out)
	}
	// --unit all renders what the verdicts admit: every unit but the failed one, which
	// it names.
	code, out, errs = runCmd(t, cmdRender, failed.envelope, "--pub", failed.pub, "--format", "libvirt-devices")
	if code != 0 || strings.Count(out, "<hostdev ") != 7*4 || !strings.Contains(errs, "leaves out gpu1 (failed)") {
		t.Errorf("--unit all with a failed unit: exit %d, %d hostdevs, want 28; stderr %q", code, strings.Count(out, "<hostdev "), errs)
	}

	// Usage: tree flags with --manifest, manifest flags without it.
	for _, args := range [][]string{
		{n.envelope, "--pub", n.pub, "--root", n.root},
		{"--root", n.root, "--pub", n.pub},
		{n.envelope},
		{n.envelope, "--pub", n.pub, "--format", "svg"},
	} {
		if code, out, _ := runCmd(t, cmdRender, args...); code != 2 || out != "" {
			t.Errorf("render %v: exit %d, stdout %q; want 2 and nothing", args, code, out)
		}
	}
}

// TestVerifyUnitsView: verify --by-unit --json prints, per unit, the manifest's verdict,
// NUMA node, host functions and guest placement; text names every unit; a manifest that
// does not verify prints nothing.
func TestVerifyUnitsView(t *testing.T) {
	n := bootSigned(t, b300With(func(s *pcitest.Spec) { s.Fn("gpu-dsp1").ACS = nil })())
	code, out, errs := runCmd(t, cmdVerify, "--pub", n.pub, "--by-unit", "--json", n.envelope)
	if code != 0 {
		t.Fatalf("verify --by-unit --json: exit %d %s", code, errs)
	}
	var doc struct {
		Format        string `json:"format"`
		Node          string `json:"node"`
		DMIUUID       string `json:"dmi_uuid"`
		BootID        string `json:"boot_id"`
		Generation    uint64 `json:"generation"`
		PayloadDigest string `json:"payload_digest"`
		KeyID         string `json:"key_id"`
		Units         []struct {
			ID        string   `json:"id"`
			Status    string   `json:"status"`
			Reasons   []string `json:"reasons"`
			NUMANode  *int     `json:"numa_node"`
			Functions []struct {
				BDF, Role, Driver string
				IOMMUGroup        *int `json:"iommu_group"`
			} `json:"functions"`
			Guest *struct {
				RootPort  string `json:"root_port"`
				Functions []struct{ Host, Guest, Role string }
			} `json:"guest"`
		} `json:"units"`
	}
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("units view: %v\n%s", err, out)
	}
	if doc.Format != "passage-units/1" || doc.BootID != testBootID || !strings.HasPrefix(doc.PayloadDigest, "sha256:") || doc.KeyID == "" || len(doc.Units) != len(n.m.Units) {
		t.Fatalf("units view: format %q boot %q, %d units", doc.Format, doc.BootID, len(doc.Units))
	}
	for i, u := range doc.Units {
		mu := n.m.Units[i]
		if u.ID != mu.ID || u.Status != mu.Status || strings.Join(u.Reasons, "|") != strings.Join(mu.Reasons, "|") || u.NUMANode == nil || *u.NUMANode != mu.NUMANode {
			t.Errorf("unit %d: %+v; manifest %s %s %v numa %d", i, u, mu.ID, mu.Status, mu.Reasons, mu.NUMANode)
		}
		if len(u.Functions) != len(mu.Functions) {
			t.Fatalf("%s: %d functions, manifest %d", u.ID, len(u.Functions), len(mu.Functions))
		}
		for k, f := range u.Functions {
			if f.BDF != mu.Functions[k].BDF || f.Role != mu.Functions[k].Role || f.IOMMUGroup == nil || f.Driver != mu.Functions[k].DriverAfter {
				t.Errorf("%s function %d: %+v", u.ID, k, f)
			}
		}
		// The failed unit is out of the guest plan; every other one is in, each host
		// function placed at a guest address of its own.
		if failed := mu.Status == manifest.StatusFailed; failed != (u.Guest == nil) {
			t.Errorf("%s (%s): guest %+v", u.ID, mu.Status, u.Guest)
		}
		if u.Guest != nil {
			if len(u.Guest.Functions) != len(mu.Functions) || u.Guest.Functions[0].Host != mu.Functions[0].BDF || u.Guest.Functions[0].Guest == "" {
				t.Errorf("%s: guest placement %+v", u.ID, u.Guest)
			}
		}
	}
	if doc.Units[1].Status != "failed" || len(doc.Units[1].Reasons) == 0 {
		t.Errorf("gpu1: %s %v, want failed with reasons", doc.Units[1].Status, doc.Units[1].Reasons)
	}

	code, text, _ := runCmd(t, cmdVerify, "--pub", n.pub, "--by-unit", n.envelope)
	for _, u := range n.m.Units {
		if code != 0 || !strings.Contains(text, u.ID+" ") {
			t.Errorf("verify --by-unit: exit %d, no line for %s:\n%s", code, u.ID, text)
		}
	}
	other := bootSigned(t, pcitest.B300())
	if code, out, errs := runCmd(t, cmdVerify, "--pub", other.pub, "--by-unit", "--json", n.envelope); code != 1 || out != "" || !strings.Contains(errs, "REFUSED") {
		t.Errorf("verify --by-unit with another key: exit %d, stdout %q, stderr %q", code, out, errs)
	}
}

// BenchmarkRender: the hypervisor's render (verify the envelope, read the payload,
// render) against planning's (scan the tree, decide, render), units 0,1 with NUMA, as
// a complete libvirt domain.
func BenchmarkRender(b *testing.B) {
	n := bootSigned(b, pcitest.B300())
	common := []string{"--unit", "0,1", "--numa", "--format", "libvirt"}
	for _, c := range []struct {
		name string
		args []string
	}{
		{"manifest", append([]string{n.envelope, "--pub", n.pub}, common...)},
		{"tree", append([]string{"--root", n.root}, common...)},
	} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				if code := cmdRender(c.args, io.Discard, io.Discard); code != 0 {
					b.Fatalf("render %v: exit %d", c.args, code)
				}
			}
		})
	}
}

// TestRenderSizesGuestForBARs: the manifest of the reference B300 signs each function's
// BARs; render sizes the guest from them. Eight units need 7 TiB + 640 GiB of 64-bit
// MMIO (each unit's switch 1 TiB apart, the last one's ports padded by OVMF), which
// OVMF's window (the top 1/8 of the space) holds from 46 bits: render sets that width,
// and refuses a narrower one given, naming both, before any guest exists.
func TestRenderSizesGuestForBARs(t *testing.T) {
	n := bootSigned(t, pcitest.B300())
	if b := n.m.Units[0].Functions[0].BARs; len(b) != 3 || b[1].Size != 512<<30 || !b[1].Is64 || !b[1].Prefetchable {
		t.Fatalf("gpu0's BARs in the signed manifest: %+v", b)
	}
	for _, tc := range []struct {
		args []string
		code int
		out  string // on stdout for 0, on stderr otherwise
	}{
		{[]string{"--format", "qemu", "--unit", "all"}, 0, "-cpu host,phys-bits=46 \\\n"},
		{[]string{"--format", "qemu", "--unit", "0"}, 0, "-cpu host,phys-bits=43 \\\n"},
		{[]string{"--format", "libvirt", "--unit", "all", "--phys-bits", "48"}, 0, "<maxphysaddr mode=\"emulate\" bits=\"48\"></maxphysaddr>"},
		{[]string{"--format", "qemu", "--unit", "all", "--phys-bits", "45"}, 1,
			"REFUSED: guest: 8 units need 7808 GiB of 64-bit MMIO, a 46-bit physical address width; the width given is 45 bits, whose OVMF window is 4 TiB: their BARs would not all be mapped\n"},
		{[]string{"--format", "libvirt", "--unit", "all", "--phys-bits", "40"}, 1, "a 46-bit physical address width; the width given is 40 bits"},
		{[]string{"--format", "qemu", "--unit", "all", "--phys-bits", "-1"}, 2, "--phys-bits -1"},
	} {
		code, out, errs := runCmd(t, cmdRender, append([]string{n.envelope, "--pub", n.pub}, tc.args...)...)
		where := out
		if tc.code != 0 {
			where = errs
		}
		if code != tc.code || !strings.Contains(where, tc.out) {
			t.Errorf("render %v: exit %d, want %d with %q\nstdout:\n%.400s\nstderr:\n%s", tc.args, code, tc.code, tc.out, out, errs)
		}
		if tc.code != 0 && out != "" {
			t.Errorf("render %v refused, yet wrote %d bytes", tc.args, len(out))
		}
	}
}
