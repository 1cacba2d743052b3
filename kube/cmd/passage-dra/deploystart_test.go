package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/fabricmanager/fabrictest"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/recycle"
)

// deployDaemonSet is deploy/daemonset.yaml's DaemonSet, decoded strictly.
func deployDaemonSet(t *testing.T) *appsv1.DaemonSet {
	t.Helper()
	b, err := os.ReadFile("../../deploy/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dec := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme.Scheme, scheme.Scheme, kjson.SerializerOptions{Yaml: true, Strict: true})
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			t.Fatal("deploy/daemonset.yaml: no DaemonSet")
		}
		if err != nil {
			t.Fatal(err)
		}
		obj, _, err := dec.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("%v\n%s", err, doc)
		}
		if ds, ok := obj.(*appsv1.DaemonSet); ok {
			return ds
		}
	}
}

// podView lays out, under c, the filesystem the DaemonSet's container sees on a node
// whose root is host: each volumeMount's mountPath holds its volume, as the kubelet
// would mount it, and nothing else is there. A volume the kubelet would not mount (a
// hostPath of type Directory or File that is missing, a ConfigMap not optional and not
// made) fails the test: the pod would stay in ContainerCreating. ca is the ConfigMap
// passage-control-ca's ca.crt; nil: the ConfigMap is not made.
//
// Mounts beneath --root (/host) are copies of the host's directories (the plugin reads
// them beneath the root, where a link out of it is refused); the others are links to
// the host's directory, or to its copy beneath /host when that is mounted too, so that
// one host directory mounted twice is one directory, as two bind mounts are.
func podView(t *testing.T, ds *appsv1.DaemonSet, host, c string, ca []byte) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	vols := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		vols[v.Name] = v
	}
	mounts := spec.Containers[0].VolumeMounts
	underRoot := map[string]string{} // host path -> its copy beneath /host
	for pass := range 2 {
		for _, m := range mounts {
			v, ok := vols[m.Name]
			if !ok {
				t.Fatalf("volumeMount %s: no volume", m.Name)
			}
			inRoot := strings.HasPrefix(m.MountPath, "/host/")
			if (pass == 0) != inRoot {
				continue
			}
			dst := filepath.Join(c, m.MountPath)
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				t.Fatal(err)
			}
			switch {
			case v.HostPath != nil:
				src := filepath.Join(host, v.HostPath.Path)
				fi, err := os.Stat(src)
				typ := corev1.HostPathUnset
				if v.HostPath.Type != nil {
					typ = *v.HostPath.Type
				}
				switch {
				case err != nil && typ == corev1.HostPathDirectoryOrCreate:
					if err := os.MkdirAll(src, 0o755); err != nil {
						t.Fatal(err)
					}
				case err != nil:
					t.Fatalf("volume %s: hostPath %s (type %q) is not on the node: the pod would stay in ContainerCreating", m.Name, v.HostPath.Path, typ)
				case (typ == corev1.HostPathDirectory || typ == corev1.HostPathDirectoryOrCreate) && !fi.IsDir(),
					typ == corev1.HostPathFile && !fi.Mode().IsRegular():
					t.Fatalf("volume %s: hostPath %s is not a %s", m.Name, v.HostPath.Path, typ)
				}
				if inRoot {
					if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
						t.Fatalf("cp %s: %v %s", src, err, out)
					}
					underRoot[v.HostPath.Path] = dst
					continue
				}
				if cp, ok := underRoot[v.HostPath.Path]; ok {
					src = cp
				}
				if err := os.Symlink(src, dst); err != nil {
					t.Fatal(err)
				}
			case v.ConfigMap != nil:
				if err := os.MkdirAll(dst, 0o755); err != nil {
					t.Fatal(err)
				}
				if ca == nil {
					if v.ConfigMap.Optional == nil || !*v.ConfigMap.Optional {
						t.Fatalf("volume %s: ConfigMap %s not made and not optional: the pod would stay in ContainerCreating", m.Name, v.ConfigMap.Name)
					}
					continue
				}
				if err := os.WriteFile(filepath.Join(dst, "ca.crt"), ca, 0o644); err != nil {
					t.Fatal(err)
				}
			default:
				t.Fatalf("volume %s: neither hostPath nor ConfigMap", m.Name)
			}
		}
	}
}

// daemonSetArgs are the container's args on node, every absolute path among them (a
// flag's value) beneath c; the kubelet's directories, which the plugin takes by
// default, are given beneath c too.
func daemonSetArgs(ds *appsv1.DaemonSet, c, node string, extra ...string) []string {
	var out []string
	for _, a := range ds.Spec.Template.Spec.Containers[0].Args[1:] {
		a = strings.ReplaceAll(a, "$(NODE_NAME)", node)
		if k, v, ok := strings.Cut(a, "="); ok && strings.HasPrefix(v, "/") {
			a = k + "=" + filepath.Join(c, v)
		}
		out = append(out, a)
	}
	out = append(out, "--registry-dir="+filepath.Join(c, "/var/lib/kubelet/plugins_registry"),
		"--plugin-dir="+filepath.Join(c, "/var/lib/kubelet/plugins/passage-boot.github.io"))
	return append(out, extra...)
}

// TestDaemonSetStarts: the plugin starts with exactly what deploy/daemonset.yaml mounts,
// its optional volumes absent, on the nodes it runs on: the args parsed by the plugin's
// own flags (pluginConfig) and the plugin made (plugin.New: the manifest verified, the
// turnaround's key, TPM and CA opened) on a view of the node holding only the
// DaemonSet's mounts. A node that signs with its TPM (no /etc/passage/key) with a
// control plane; a node without a control plane (no passage.url, no ConfigMap); the
// turnaround turned off. A control plane without its CA ConfigMap is refused at start,
// naming it, not served with other roots.
//
// Fabric Manager through the DaemonSet's --fm-socket and --fm-lib (fmstub.c standing
// for FM and its libnvfm, placed where the FM dev package puts libnvfm.so.1 on the
// host): on a node whose manifest has Module IDs and the B300 layout, with FM listening
// on the socket the DaemonSet mounts, the devices carry their NVLink partitions after
// start and a reload; without the library the plugin starts and publishes none, the
// reason naming the library; on the nodes without Module IDs (every other case, the
// library there) the library is never loaded.
func TestDaemonSetStarts(t *testing.T) {
	ds := deployDaemonSet(t)
	if a := ds.Spec.Template.Spec.Containers[0].Args; len(a) == 0 || a[0] != "plugin" {
		t.Fatalf("DaemonSet args %v", a)
	}
	fw, err := os.ReadFile("../../../attest/testdata/ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name    string
		url     bool // passage.url= on the node's cmdline
		tpm     bool // a TPM signs (dev/tpmrm0); the key file is never there
		ca      bool // the ConfigMap passage-control-ca is made
		extra   []string
		turn    bool   // the turnaround runs
		refused string // exit 2 naming this
		modules bool   // the manifest has Module IDs and the B300 NVLink layout
		noLib   bool   // the host has no libnvfm.so.1
		nvlink  string // NVLinkOff holds this; "": the NVLink partitions are published
	}{
		// Subtest names go into swtpm's state path: no commas (its option separator).
		{name: "tpm-control-plane", url: true, tpm: true, ca: true, turn: true},
		{name: "no-control-plane", url: false, tpm: false, ca: false},
		{name: "tpm-no-control-plane", url: false, tpm: true, ca: false},
		{name: "turnaround-off", url: true, tpm: true, ca: false, extra: []string{"--turnaround=false"}},
		{name: "no-ca", url: true, tpm: true, ca: false, refused: "ConfigMap passage-control-ca"},
		{name: "fm-modules", modules: true},
		{name: "fm-modules-no-library", modules: true, noLib: true, nvlink: "fm: load "},
	} {
		t.Run(c.name, func(t *testing.T) {
			host := t.TempDir()
			r := noderig.New(t, manifesttest.NodeUUID(9), "b300-host", 3, filepath.Join(t.TempDir(), "keys"))
			fm := fabrictest.New(t)
			if c.modules {
				for i := range r.M.Units {
					r.M.Units[i].ModuleID, r.M.Units[i].ModuleSource = i+1, "test"
				}
				r.M.NVLink = &manifest.NVLink{Partitions: b300Sets, Source: "FM User Guide, HGX B200/B300"}
				r.Sign(t)
			}
			var ca []byte
			if c.tpm {
				caCert, _ := r.ForTurnaround(t, fw)
				ca = caCert.PEM(t) // a PEM certificate standing for the control plane's CA
			}
			// The node: the rig's kernel tree, the manifest where the boot leaves it, the
			// fleet's keys in /etc/passage/keys and no /etc/passage/key, the kubelet's
			// directories.
			if out, err := exec.Command("cp", "-a", r.Root+"/.", host).CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			os.Remove(filepath.Join(host, "etc/passage/key"))
			must(t, os.MkdirAll(filepath.Join(host, "etc/passage"), 0o755))
			if out, err := exec.Command("cp", "-a", r.Keys, filepath.Join(host, "etc/passage/keys")).CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			if !c.tpm {
				b, err := os.ReadFile(r.Path)
				if err != nil {
					t.Fatal(err)
				}
				must(t, os.MkdirAll(filepath.Join(host, "run/passage"), 0o755))
				must(t, os.WriteFile(filepath.Join(host, "run/passage", recycle.EnvelopeName), b, 0o644))
			}
			cmdline := "console=ttyS0\n"
			if c.url {
				cmdline = "console=ttyS0 passage.url=https://127.0.0.1:1/\n"
			}
			must(t, os.MkdirAll(filepath.Join(host, "proc"), 0o755))
			must(t, os.WriteFile(filepath.Join(host, "proc/cmdline"), []byte(cmdline), 0o644))
			for _, d := range []string{"var/lib/kubelet/plugins_registry", "var/lib/kubelet/plugins", "dev", hostLibDir} {
				must(t, os.MkdirAll(filepath.Join(host, d), 0o755))
			}
			if !c.noLib {
				b, err := os.ReadFile(fabrictest.Library(t))
				if err != nil {
					t.Fatal(err)
				}
				must(t, os.WriteFile(filepath.Join(host, hostLibDir, "libnvfm.so.1"), b, 0o755))
			}
			if !c.ca {
				ca = nil
			}

			view := t.TempDir()
			podView(t, ds, host, view, ca)
			lib := filepath.Join(view, "/host", hostLibDir, "libnvfm.so.1")
			fm.Update(t, func(s *fabrictest.State) {
				s.Listen = "unix:" + filepath.Join(view, "/host/run/nvidia-fabricmanager/socket")
			})
			if _, err := os.Lstat(filepath.Join(view, "host/etc/passage/key")); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the pod sees a key file (%v): the node has none", err)
			}
			fs := flag.NewFlagSet("passage-dra plugin", flag.ContinueOnError)
			o := &options{}
			o.register(fs)
			var stderr bytes.Buffer
			cfg, _, code := pluginConfig(fs, daemonSetArgs(ds, view, "worker-7", c.extra...), o, &stderr)
			if c.refused != "" {
				if code != 2 || !strings.Contains(stderr.String(), c.refused) {
					t.Fatalf("exit %d %s, want 2 naming %q", code, stderr.String(), c.refused)
				}
				return
			}
			if code != 0 {
				t.Fatalf("plugin flags: exit %d %s", code, stderr.String())
			}
			if (cfg.Turnaround != nil) != c.turn {
				t.Fatalf("turnaround %+v, want it on: %v", cfg.Turnaround, c.turn)
			}
			if cfg.Fabric == nil {
				t.Fatal("the DaemonSet's --fm- flags gave the plugin no Fabric")
			}
			t.Cleanup(func() { cfg.Fabric.Close() })
			d, err := plugin.New(cfg)
			if err != nil {
				t.Fatalf("plugin.New: %v", err)
			}
			if objs := d.Objects(); objs.Node != "worker-7" || len(objs.Devices) == 0 {
				t.Fatalf("node %s, %d devices", objs.Node, len(objs.Devices))
			}
			// The command's reload: FM first, then the manifest.
			d.ResumeFabric()
			if err := d.Reload(context.Background()); err != nil {
				t.Fatal(err)
			}
			nvlink := 0
			for _, dev := range d.Objects().Devices {
				if _, ok := dev.Attributes[resources.AttrNVLinkPartition(2)]; ok {
					nvlink++
				}
			}
			maps, err := os.ReadFile("/proc/self/maps")
			if err != nil {
				t.Fatal(err)
			}
			loaded := strings.Contains(string(maps), lib)
			off := d.NVLinkOff()
			switch {
			case !c.modules:
				if loaded || d.UsesFabric() || off != "" || nvlink != 0 || fm.Calls(t, "connect") != nil {
					t.Fatalf("no Module IDs: library loaded %v, FM in use %v, NVLinkOff %q, %d NVLink devices, FM's calls %v", loaded, d.UsesFabric(), off, nvlink, fm.Log(t))
				}
			case c.nvlink == "":
				if !loaded || off != "" || nvlink != len(d.Objects().Devices) {
					t.Fatalf("library loaded %v, NVLinkOff %q, %d of %d devices with an NVLink partition; FM's calls %v", loaded, off, nvlink, len(d.Objects().Devices), fm.Log(t))
				}
			default:
				if nvlink != 0 || !strings.Contains(off, c.nvlink+lib) {
					t.Fatalf("%d devices with an NVLink partition, NVLinkOff %q, want it naming %q", nvlink, off, c.nvlink+lib)
				}
			}
		})
	}
}

// hostLibDir is where the FM dev package puts libnvfm.so.1 on an amd64 Debian or
// Ubuntu host (NVIDIA/apt-packaging-fabric-manager: debian/rules' DEBLIBINSTDIR).
const hostLibDir = "usr/lib/x86_64-linux-gnu"

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
