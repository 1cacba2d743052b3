package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/xml"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/kube/internal/signedtest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

func runCmd(args ...string) (int, string, string) {
	var out, errs bytes.Buffer
	code := run(context.Background(), args, &out, &errs)
	return code, out.String(), errs.String()
}

// signed writes manifesttest's B300 (gpu3 failed) signed by a key enrolled for its node,
// and another node's manifest signed by that node's key in the same key directory.
func signed(t *testing.T) (keys, good, other string) {
	dir := t.TempDir()
	m := manifesttest.B300(4)
	m.Units[3].Status, m.Units[3].Reasons = manifest.StatusFailed, []string{"acs: mismatch"}
	for i := range m.Units[3].Functions {
		m.Units[3].Functions[i].DriverAfter = "nvidia"
	}
	keys = filepath.Join(dir, "keys")
	k := signedtest.NewKey(t, keys, "a", 1, m.Node.DMIUUID)
	good = k.Sign(t, m, filepath.Join(dir, "a.dsse.json"))
	b := manifesttest.B300(4)
	b.Node.DMIUUID = manifesttest.NodeUUID(3)
	kb := signedtest.NewKey(t, keys, "b", 2, b.Node.DMIUUID)
	other = kb.Sign(t, b, filepath.Join(dir, "b.dsse.json"))
	return keys, good, other
}

func TestSlicesCommand(t *testing.T) {
	keys, good, other := signed(t)
	code, out, errs := runCmd("slices", "--pub", keys, "--node-uuid", manifesttest.B300(0).Node.DMIUUID, good)
	if code != 0 {
		t.Fatalf("slices: exit %d: %s", code, errs)
	}
	for _, want := range []string{"kind: DeviceClass", "kind: ResourceClaimTemplate", "kind: ResourceSlice", "name: unit-gpu.gpu-nic.gpu-nic.gpu-nvme"} {
		if !strings.Contains(out, want) {
			t.Errorf("slices output lacks %q", want)
		}
	}
	if strings.Contains(out, "gpu3-") {
		t.Error("the failed unit gpu3 is in the slices")
	}
	// Another node's manifest, verified by its own enrolled key in the directory, is
	// refused for this node; nothing is printed.
	code, out, errs = runCmd("slices", "--pub", keys, "--node-uuid", manifesttest.B300(0).Node.DMIUUID, other)
	if code != 1 || out != "" || !strings.Contains(errs, "REFUSED") || !strings.Contains(errs, manifest.ErrWrongNode.Error()) {
		t.Fatalf("another node's manifest: exit %d, stdout %q, stderr %q", code, out, errs)
	}
	// A tampered envelope (the failed unit's status edited to ready, the signature
	// kept): refused, nothing printed.
	var env manifest.Envelope
	b, _ := os.ReadFile(good)
	if err := json.Unmarshal(b, &env); err != nil {
		t.Fatal(err)
	}
	payload, _ := base64.StdEncoding.DecodeString(env.Payload)
	edited := strings.Replace(string(payload), `"status":"failed"`, `"status":"ready"`, 1)
	env.Payload, env.PayloadDigest = base64.StdEncoding.EncodeToString([]byte(edited)), ""
	b, _ = json.Marshal(env)
	bad := filepath.Join(t.TempDir(), "bad.dsse.json")
	os.WriteFile(bad, b, 0o644)
	if code, out, errs := runCmd("slices", "--pub", keys, bad); code != 1 || out != "" || !strings.Contains(errs, manifest.ErrBadSignature.Error()) {
		t.Fatalf("tampered manifest: exit %d, stdout %d bytes, stderr %q", code, len(out), errs)
	}
}

func TestKubeVirtCommand(t *testing.T) {
	keys, good, _ := signed(t)
	code, out, errs := runCmd("kubevirt", "--pub", keys, "--unit", "gpu0", "--claim", "gpus", good)
	if code != 0 {
		t.Fatalf("kubevirt: exit %d: %s", code, errs)
	}
	var doc struct {
		Spec resources.VMIClaims `json:"spec"`
	}
	if err := yaml.UnmarshalStrict([]byte(out), &doc); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	s := doc.Spec
	if len(s.ResourceClaims) != 1 || s.ResourceClaims[0].Name != "gpus" || s.ResourceClaims[0].ResourceClaimTemplateName != "unit-gpu.gpu-nic.gpu-nic.gpu-nvme" {
		t.Fatalf("resourceClaims %+v", s.ResourceClaims)
	}
	var reqs []string
	for _, h := range s.Domain.Devices.HostDevices {
		if h.ClaimName != "gpus" {
			t.Errorf("host device %+v", h)
		}
		reqs = append(reqs, h.RequestName)
	}
	if strings.Join(reqs, " ") != "gpu gpu-nic-0 gpu-nic-1 gpu-nvme" {
		t.Fatalf("hostDevices requests %v", reqs)
	}
	if code, out, errs := runCmd("kubevirt", "--pub", keys, "--unit", "gpu3", good); code != 1 || out != "" || !strings.Contains(errs, "unit gpu3 is failed") {
		t.Fatalf("failed unit: exit %d, stdout %q, stderr %q", code, out, errs)
	}
}

func TestNCCLCommand(t *testing.T) {
	keys, good, _ := signed(t)
	code, out, errs := runCmd("nccl-xml", "--pub", keys, "--unit", "gpu0", good)
	if code != 0 {
		t.Fatalf("nccl-xml: exit %d: %s", code, errs)
	}
	var sys struct {
		CPUs []struct {
			PCIs []struct {
				PCIs []struct {
					Class string `xml:"class,attr"`
				} `xml:"pci"`
			} `xml:"pci"`
		} `xml:"cpu"`
	}
	if err := xml.Unmarshal([]byte(out), &sys); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// One switch holding the GPU and its two NIC PFs (NCCL has no use for the NVMe).
	if len(sys.CPUs) != 1 || len(sys.CPUs[0].PCIs) != 1 || len(sys.CPUs[0].PCIs[0].PCIs) != 3 {
		t.Fatalf("topology %+v\n%s", sys, out)
	}
}

// TestDeployDecodesStrictly: every object of deploy/daemonset.yaml decodes strictly
// (unknown and duplicate fields refused) into client-go's types, and the DaemonSet runs
// the plugin command with flags it has.
func TestDeployDecodesStrictly(t *testing.T) {
	b, err := os.ReadFile("../../deploy/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dec := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme.Scheme, scheme.Scheme, kjson.SerializerOptions{Yaml: true, Strict: true})
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	kinds := []string{}
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		obj, gvk, err := dec.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("%v\n%s", err, doc)
		}
		kinds = append(kinds, gvk.Kind)
		if ds, ok := obj.(*appsv1.DaemonSet); ok {
			args := ds.Spec.Template.Spec.Containers[0].Args
			fs := flag.NewFlagSet("plugin", flag.ContinueOnError)
			// The flags cmdPlugin registers, parsed from the DaemonSet's args.
			var src sourceFlags
			src.register(fs)
			var turn turnFlags
			turn.register(fs)
			var fm fabricFlags
			fm.register(fs)
			var kl kubeletFlags
			kl.register(fs)
			fs.String("node-name", "", "")
			for _, f := range []string{"manifest", "root", "cdi-dir", "kubeconfig", "registry-dir", "plugin-dir", "hook-dir"} {
				fs.String(f, "", "")
			}
			if args[0] != "plugin" || fs.Parse(args[1:]) != nil {
				t.Fatalf("DaemonSet args %v", args)
			}
		}
	}
	if strings.Join(kinds, " ") != "Namespace ServiceAccount ClusterRole ClusterRoleBinding DaemonSet" {
		t.Fatalf("kinds %v", kinds)
	}
}

// TestFlagsReachEveryCommand sets --node-name, --degraded and --unit on each command's
// command line and looks for their effect: the slices of the named node, the degraded
// unit offered (and its -or-degraded template) or refused, several units in one --unit
// or repeated, the plugin's Config. (The flags were registered on a copy of the options
// taken before the parse, and ignored.)
func TestFlagsReachEveryCommand(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	r := noderig.New(t, manifesttest.NodeUUID(9), "b300-host", 3, keys)
	r.M.Units[2].Status, r.M.Units[2].Reasons = manifest.StatusDegraded, []string{"erase: auto: nvme not erased"}
	r.Sign(t)
	base := []string{"--pub", keys, "--node-uuid", manifesttest.NodeUUID(9)}
	cmd := func(name string, args ...string) []string {
		return append(append([]string{name}, base...), append(args, r.Path)...)
	}

	code, out, errs := runCmd(cmd("slices", "--node-name", "worker-7")...)
	// The slices are worker-7's; their pool keeps the manifest's hostname (the name the
	// control plane's taint rule selects).
	if code != 0 || !strings.Contains(out, "nodeName: worker-7") || strings.Contains(out, "nodeName: b300-host") || !strings.Contains(out, "    name: b300-host\n") {
		t.Fatalf("slices --node-name: exit %d %s\n%s", code, errs, out)
	}
	if code, out, _ := runCmd(cmd("slices")...); code != 0 || !strings.Contains(out, "nodeName: b300-host") || strings.Contains(out, "gpu2-") || strings.Contains(out, "-or-degraded") {
		t.Fatalf("slices: exit %d\n%s", code, out)
	}
	code, out, errs = runCmd(cmd("slices", "--degraded")...)
	if code != 0 || !strings.Contains(out, "name: gpu2-") || !strings.Contains(out, "name: unit-gpu.gpu-nic.gpu-nic.gpu-nvme-or-degraded") {
		t.Fatalf("slices --degraded: exit %d %s\n%s", code, errs, out)
	}

	for _, c := range []string{"kubevirt", "nccl-xml"} {
		if code, _, errs := runCmd(cmd(c, "--unit", "gpu2")...); code != 1 || !strings.Contains(errs, "unit gpu2 is degraded") {
			t.Errorf("%s --unit gpu2: exit %d %s", c, code, errs)
		}
		if code, _, errs := runCmd(cmd(c, "--unit", "gpu2", "--degraded")...); code != 0 {
			t.Errorf("%s --unit gpu2 --degraded: exit %d %s", c, code, errs)
		}
	}
	_, out, _ = runCmd(cmd("kubevirt", "--unit", "gpu2", "--degraded")...)
	if !strings.Contains(out, "resourceClaimTemplateName: unit-gpu.gpu-nic.gpu-nic.gpu-nvme-or-degraded") {
		t.Errorf("kubevirt --degraded claims from\n%s", out)
	}

	// --unit: comma-separated or repeated, the same units.
	_, comma, _ := runCmd(cmd("kubevirt", "--unit", "gpu0,gpu1")...)
	code, repeated, errs := runCmd(cmd("kubevirt", "--unit", "gpu0", "--unit", "gpu1")...)
	if code != 0 || comma != repeated || !strings.Contains(comma, "name: unit-0") || !strings.Contains(comma, "name: unit-1") {
		t.Fatalf("kubevirt with two units: exit %d %s\n%s\n%s", code, errs, comma, repeated)
	}
	_, one, _ := runCmd(cmd("nccl-xml", "--unit", "gpu0")...)
	code, two, errs := runCmd(cmd("nccl-xml", "--unit", "gpu0,gpu1")...)
	if code != 0 || strings.Count(two, `class="0x030200"`) != 2*strings.Count(one, `class="0x030200"`) || strings.Count(one, `class="0x030200"`) == 0 {
		t.Fatalf("nccl-xml of two units: exit %d %s\n%s", code, errs, two)
	}
	for _, bad := range [][]string{{"--unit", "gpu0,"}, {"--unit", "gpu0", "--unit", "gpu0"}, {}} {
		if code, _, _ := runCmd(cmd("nccl-xml", bad...)...); code != 2 {
			t.Errorf("nccl-xml %v: exit %d, want 2", bad, code)
		}
	}

	// The plugin: the Config its flags parse into publishes worker-7's slices with gpu2.
	fs := flag.NewFlagSet("passage-dra plugin", flag.ContinueOnError)
	o := &options{}
	o.register(fs)
	var stderr bytes.Buffer
	hookDir := filepath.Join(t.TempDir(), "hook")
	prom := filepath.Join(t.TempDir(), "passage-dra.prom")
	cfg, _, code := pluginConfig(fs, []string{"--pub", keys, "--manifest", r.Path, "--root", r.Root,
		"--plugin-dir", t.TempDir(), "--cdi-dir", t.TempDir(), "--node-name", "worker-7", "--degraded", "--hook-dir", hookDir,
		"--metrics-file", prom}, o, &stderr)
	if code != 0 {
		t.Fatalf("plugin flags: exit %d %s", code, stderr.String())
	}
	d, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	objs := d.Objects()
	if objs.Node != "worker-7" || len(objs.Devices) != 32 || len(objs.DegradedTemplates) != 1 {
		t.Fatalf("plugin --node-name worker-7 --degraded: node %s, %d devices, %d degraded templates", objs.Node, len(objs.Devices), len(objs.DegradedTemplates))
	}
	// --hook-dir: the verified envelope exported for passage-hook, byte for byte.
	if got, err := os.ReadFile(filepath.Join(hookDir, plugin.HookManifest)); err != nil || !bytes.Equal(got, mustRead(t, r.Path)) {
		t.Errorf("plugin --hook-dir %s: the manifest not exported (%v)", hookDir, err)
	}
	// --metrics-file: the export counter, none failed.
	if got, err := os.ReadFile(prom); err != nil || !bytes.Contains(got, []byte("\npassage_dra_hook_export_failures_total 0\n")) {
		t.Errorf("plugin --metrics-file %s: %q %v, want the export failures counted (0)", prom, got, err)
	}
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
