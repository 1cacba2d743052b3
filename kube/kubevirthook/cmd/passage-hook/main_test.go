package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"kubevirt.io/kubevirt/pkg/hooks"
	hooksinfo "kubevirt.io/kubevirt/pkg/hooks/info"
	hooksv1alpha3 "kubevirt.io/kubevirt/pkg/hooks/v1alpha3"
	"sigs.k8s.io/yaml"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
)

// TestDeployAnnotation: the VMI annotation in deploy/kubevirt-hook.yaml decodes strictly
// into KubeVirt's own hook sidecar list, mounts the PVC the file defines, and its
// arguments are this command's flags.
func TestDeployAnnotation(t *testing.T) {
	b, err := os.ReadFile("../../../deploy/kubevirt-hook.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var pvc, pvPath, pvName, pvClaim, pvcVolume string
	var list hooks.HookSidecarList
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var o struct {
			Kind     string
			Metadata struct {
				Name        string
				Annotations map[string]string
			}
			Spec struct {
				HostPath   struct{ Path string }
				ClaimRef   struct{ Namespace, Name string } `json:"claimRef"`
				VolumeName string                           `json:"volumeName"`
			}
		}
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatal(err)
		}
		switch o.Kind {
		case "PersistentVolume":
			pvPath, pvName, pvClaim = o.Spec.HostPath.Path, o.Metadata.Name, o.Spec.ClaimRef.Namespace+"/"+o.Spec.ClaimRef.Name
		case "PersistentVolumeClaim":
			pvc, pvcVolume = o.Metadata.Name, o.Spec.VolumeName
		case "VirtualMachineInstance":
			d := json.NewDecoder(strings.NewReader(o.Metadata.Annotations[hooks.HookSidecarListAnnotationName]))
			d.DisallowUnknownFields()
			if err := d.Decode(&list); err != nil {
				t.Fatalf("%s: %v", hooks.HookSidecarListAnnotationName, err)
			}
		}
	}
	if len(list) != 1 || list[0].PVC == nil || list[0].PVC.Name != pvc || pvc == "" {
		t.Fatalf("sidecars %+v, PVC %q", list, pvc)
	}
	// virt-controller names the annotation's Nth sidecar container hook-sidecar-N and
	// says so in its CONTAINER_NAME (KubeVirt v1.9.0 template.go, sidecarContainerName):
	// the hook is the annotation's only entry.
	t.Setenv(hooks.ContainerNameEnvVar, "hook-sidecar-0")
	o, err := parse(list[0].Args, io.Discard)
	if err != nil {
		t.Fatalf("args %q: %v", list[0].Args, err)
	}
	// The manifest passage-dra plugin --hook-dir writes (kube/dra/plugin's HookManifest;
	// TestHookDirFromPlugin verifies it), on the PV over the DaemonSet's hook dir; the
	// trust root not on that read-write PVC but in the image (the default --pub), and
	// the node identity the kernel's boot ID, not a file on it.
	if want := list[0].PVC.VolumePath + "/manifest.dsse.json"; o.c.Manifest != want {
		t.Errorf("--manifest %s: want the plugin's export %s", o.c.Manifest, want)
	}
	if o.c.Keys != "/etc/passage/keys" || strings.HasPrefix(o.c.Keys, list[0].PVC.VolumePath) {
		t.Errorf("--pub %s: want the image's /etc/passage/keys, not the PVC", o.c.Keys)
	}
	if o.uuidFile != "" || o.bootIDFile != "/proc/sys/kernel/random/boot_id" {
		t.Errorf("--node-uuid-file %q, --boot-id-file %q: want the kernel's boot ID alone", o.uuidFile, o.bootIDFile)
	}
	// KubeVirt mounts the PVC read-write in the compute container too when the entry
	// names a sharedComputePath (template.go): QEMU needs nothing from it.
	if list[0].PVC.SharedComputePath != "" {
		t.Errorf("sharedComputePath %s: the compute container would mount the node's directory read-write", list[0].PVC.SharedComputePath)
	}
	// A PV binds one claim: the PV is pinned to the PVC the VMI names, in its namespace.
	if pvcVolume != pvName || pvClaim != "tenant/"+pvc {
		t.Errorf("PV %s claimRef %s, PVC %s volumeName %s: not one pair", pvName, pvClaim, pvc, pvcVolume)
	}
	if dir := pluginHookDir(t); dir != pvPath || dir == "" {
		t.Errorf("the PV reads %q, the plugin writes its hook dir to %q", pvPath, dir)
	}
	// The sidecar's /var/run/kubevirt-hooks is the compute container's
	// /var/run/kubevirt-hooks/hook-sidecar-N (KubeVirt v1.9.0 template.go,
	// sidecarVolumeMount's SubPath), which virt-launcher reads one level deep: the socket
	// goes at the top, the NCCL files in a directory (a plain file would be dialled).
	if filepath.Dir(o.socket) != hooks.HookSocketsSharedDirectory {
		t.Errorf("socket %s: virt-launcher finds it only directly in the sidecar's %s", o.socket, hooks.HookSocketsSharedDirectory)
	}
	rel, err := filepath.Rel(hooks.HookSocketsSharedDirectory, o.ncclDir)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		t.Fatalf("nccl dir %s: not a directory below %s", o.ncclDir, hooks.HookSocketsSharedDirectory)
	}
	if want := filepath.Join(hooks.HookSocketsSharedDirectory, "hook-sidecar-0", rel); o.ncclDiskDir != want {
		t.Errorf("nccl disk dir %s: the first sidecar's %s is the compute container's %s", o.ncclDiskDir, o.ncclDir, want)
	}
	var stderr bytes.Buffer
	if _, err := parse([]string{"--bogus"}, &stderr); err == nil {
		t.Error("an unknown flag was accepted")
	}
}

// TestNCCLDiskDir: unless --nccl-disk-dir names it, the guest's NCCL disk is --nccl-dir
// as the compute container sees it, under the sidecar's own CONTAINER_NAME, so a VMI may
// list the hook in any place of its annotation; without a container name, or with an
// --nccl-dir the compute container cannot see, the hook refuses to start (exit 2)
// rather than point QEMU at a path that is not there.
func TestNCCLDiskDir(t *testing.T) {
	for _, c := range []struct {
		name, container string
		args            []string
		want            string // "" with err set: refused
		err             string
	}{
		{"second sidecar", "hook-sidecar-1", nil, "/var/run/kubevirt-hooks/hook-sidecar-1/passage", ""},
		{"deeper dir", "hook-sidecar-4", []string{"--nccl-dir", "/var/run/kubevirt-hooks/a/b"}, "/var/run/kubevirt-hooks/hook-sidecar-4/a/b", ""},
		{"named", "hook-sidecar-1", []string{"--nccl-disk-dir", "/compute/x"}, "/compute/x", ""},
		{"named outside KubeVirt", "", []string{"--nccl-disk-dir", "/compute/x"}, "/compute/x", ""},
		{"no disk", "hook-sidecar-1", []string{"--nccl-disk-dir="}, "", ""},
		{"no NCCL files", "", []string{"--nccl-dir="}, "", ""},
		{"no container name", "", nil, "", "CONTAINER_NAME is not set"},
		{"container name with a slash", "../hook-sidecar-0", nil, "", `CONTAINER_NAME="../hook-sidecar-0" is not a container name`},
		{"container name dot-dot", "..", nil, "", "is not a container name"},
		{"nccl dir outside the shared dir", "hook-sidecar-0", []string{"--nccl-dir", "/run/nccl"}, "", "--nccl-dir /run/nccl is not below /var/run/kubevirt-hooks"},
		{"nccl dir the shared dir itself", "hook-sidecar-0", []string{"--nccl-dir", "/var/run/kubevirt-hooks"}, "", "is not below"},
		{"nccl dir climbing out", "hook-sidecar-0", []string{"--nccl-dir", "/var/run/kubevirt-hooks/../x"}, "", "is not below"},
		{"relative nccl dir", "hook-sidecar-0", []string{"--nccl-dir", "passage"}, "", "is not below"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(hooks.ContainerNameEnvVar, c.container)
			var stderr bytes.Buffer
			o, err := parse(c.args, &stderr)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) || !strings.Contains(stderr.String(), c.err) {
					t.Fatalf("err %v, stderr %q: want refused with %q", err, stderr.String(), c.err)
				}
				// run refuses it before it reads anything or opens the socket.
				if rc := run(context.Background(), c.args, io.Discard); rc != 2 {
					t.Errorf("run: exit %d, want 2", rc)
				}
				return
			}
			if err != nil {
				t.Fatalf("%v (%s)", err, stderr.String())
			}
			if o.ncclDiskDir != c.want {
				t.Errorf("nccl disk dir %q, want %q", o.ncclDiskDir, c.want)
			}
		})
	}
}

// pluginHookDir is the node directory the DaemonSet's plugin exports to: the hostPath
// of the volume mounted where its --hook-dir points.
func pluginHookDir(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../../deploy/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var o struct {
			Kind string
			Spec struct {
				Template struct {
					Spec struct {
						Containers []struct {
							Args         []string
							VolumeMounts []struct{ Name, MountPath string } `json:"volumeMounts"`
						}
						Volumes []struct {
							Name     string
							HostPath struct{ Path string } `json:"hostPath"`
						}
					}
				}
			}
		}
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatal(err)
		}
		if o.Kind != "DaemonSet" {
			continue
		}
		ps := o.Spec.Template.Spec
		for _, c := range ps.Containers {
			for _, a := range c.Args {
				dir, ok := strings.CutPrefix(a, "--hook-dir=")
				if !ok {
					continue
				}
				for _, m := range c.VolumeMounts {
					if m.MountPath != dir {
						continue
					}
					for _, v := range ps.Volumes {
						if v.Name == m.Name {
							return v.HostPath.Path
						}
					}
				}
				t.Fatalf("--hook-dir=%s is on no hostPath volume of the DaemonSet", dir)
			}
		}
	}
	t.Fatal("the DaemonSet's plugin has no --hook-dir")
	return ""
}

// TestFlags: passage-hook serves what its flags name. Over the plugin's export and the
// key and UUID beside it (../../testdata/hookdir: --manifest, --pub, --node-uuid-file) and on --socket, it
// answers Info and lays out unit 0 of a domain holding that unit's hostdevs, writing the
// NCCL file and image into --nccl-dir and pointing the guest's disk at --nccl-disk-dir;
// a missing --node-uuid-file exits 1 naming it, an unknown flag 2.
func TestFlags(t *testing.T) {
	const dir = "../../testdata/hookdir"
	env, err := manifest.ReadEnvelope(filepath.Join(dir, "manifest.dsse.json"))
	if err != nil {
		t.Fatal(err)
	}
	var e manifest.Envelope
	if err := json.Unmarshal(env, &e); err != nil {
		t.Fatal(err)
	}
	payload, err := base64.StdEncoding.DecodeString(e.Payload)
	if err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Unmarshal(payload)
	if err != nil {
		t.Fatal(err)
	}
	var hostdevs strings.Builder
	for i, f := range m.Units[0].Functions {
		a, err := pci.ParseAddress(f.BDF)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&hostdevs, `<hostdev mode="subsystem" type="pci" managed="no"><source><address domain="0x%04x" bus="0x%02x" slot="0x%02x" function="0x%x"/></source><alias name="ua-dra-hostdevice-f%d"/></hostdev>`,
			a.Domain, a.Bus, a.Device, a.Function, i)
	}
	// host-passthrough: the guest takes the node's width, 52 bits per --cpuinfo below.
	dom := `<domain type="kvm"><name>tenant_vm</name><memory unit="KiB">1048576</memory><os><type arch="x86_64" machine="q35">hvm</type></os><cpu mode="host-passthrough"/>` +
		`<devices><controller type="pci" index="0" model="pcie-root"/>` + hostdevs.String() + `</devices></domain>`

	tmp := t.TempDir()
	sock, ncclDir := filepath.Join(tmp, "passage.sock"), filepath.Join(tmp, "nccl")
	cpuinfo := filepath.Join(tmp, "cpuinfo")
	if err := os.WriteFile(cpuinfo, []byte("processor\t: 0\naddress sizes\t: 52 bits physical, 57 bits virtual\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	var errb bytes.Buffer
	go func() {
		// The export's manifest is of another boot: the node UUID alone holds it to the
		// node, the export's directory standing for the image's filesystem.
		done <- run(ctx, []string{"--manifest", filepath.Join(dir, "manifest.dsse.json"), "--pub", filepath.Join(dir, "node.pub"),
			"--node-uuid-file", filepath.Join(dir, "product_uuid"), "--boot-id-file=", "--image-root", dir, "--socket", sock, "--nccl-dir", ncclDir,
			"--nccl-disk-dir", "/compute/hook-sidecar-3/passage", "--cpuinfo", cpuinfo}, &errb)
	}()
	defer func() {
		cancel()
		if rc := <-done; rc != 0 {
			t.Errorf("run: exit %d: %s", rc, errb.String())
		}
	}()
	var c *grpc.ClientConn
	for i := 0; ; i++ {
		if _, err := os.Stat(sock); err == nil {
			if c, err = grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
				t.Fatal(err)
			}
			break
		}
		if i == 200 {
			t.Fatalf("no socket at --socket %s after 4 s: %s", sock, errb.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer c.Close()
	rctx, rcancel := context.WithTimeout(context.Background(), time.Minute)
	defer rcancel()
	info, err := hooksinfo.NewInfoClient(c).Info(rctx, &hooksinfo.InfoParams{})
	if err != nil || info.GetName() == "" {
		t.Fatalf("Info: %v %v", info, err)
	}
	vmi, _ := json.Marshal(map[string]any{"metadata": map[string]string{"name": "vm", "namespace": "tenant"}})
	r, err := hooksv1alpha3.NewCallbacksClient(c).OnDefineDomain(rctx, &hooksv1alpha3.OnDefineDomainParams{DomainXML: []byte(dom), Vmi: vmi})
	if err != nil {
		t.Fatalf("OnDefineDomain: %v", err)
	}
	out := string(r.GetDomainXML())
	if !strings.Contains(out, "pcie-switch-upstream-port") || !strings.Contains(out, "/compute/hook-sidecar-3/passage/tenant_vm.nccl-topo.img") {
		t.Errorf("the domain has no unit switch, or no disk under --nccl-disk-dir:\n%s", out)
	}
	for _, f := range []string{"tenant_vm.nccl-topo.xml", "tenant_vm.nccl-topo.img"} {
		if _, err := os.Stat(filepath.Join(ncclDir, f)); err != nil {
			t.Errorf("--nccl-dir: %v", err)
		}
	}

	var e2 bytes.Buffer
	if rc := run(context.Background(), []string{"--pub", filepath.Join(dir, "node.pub"), "--image-root", dir, "--node-uuid-file", filepath.Join(tmp, "none")}, &e2); rc != 1 || !strings.Contains(e2.String(), filepath.Join(tmp, "none")) {
		t.Errorf("a missing --node-uuid-file: exit %d, %q", rc, e2.String())
	}
	// --cpuinfo is the file read, not the machine's /proc/cpuinfo: one without a width
	// stops the start, naming it.
	noWidth := filepath.Join(tmp, "cpuinfo-no-width")
	if err := os.WriteFile(noWidth, []byte("processor\t: 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var e3 bytes.Buffer
	// Bounded: a hook that ignored the flag would serve until its context ends.
	ctx3, cancel3 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel3()
	if rc := run(ctx3, []string{"--pub", filepath.Join(dir, "node.pub"), "--image-root", dir, "--node-uuid-file", filepath.Join(dir, "product_uuid"),
		"--boot-id-file=", "--cpuinfo", noWidth, "--socket", filepath.Join(tmp, "no-width.sock"), "--nccl-dir="}, &e3); rc != 1 || !strings.Contains(e3.String(), "--cpuinfo: "+noWidth+": no address sizes line") {
		t.Errorf("--cpuinfo %s: exit %d, %q", noWidth, rc, e3.String())
	}
	if rc := run(context.Background(), []string{"--bogus"}, io.Discard); rc != 2 {
		t.Errorf("--bogus: exit %d, want 2", rc)
	}
}

// TestTrustRoot: passage-hook refuses to start (exit 1, naming the flag and why) when its
// keys or node UUID lie on a writable mount other than its image's filesystem (what a
// KubeVirt sidecar PVC is), or its boot ID is not the kernel's; keys and UUID on the
// image's filesystem and the kernel's boot ID serve.
func TestTrustRoot(t *testing.T) {
	const dir = "../../testdata/hookdir"
	// /dev/shm: a writable tmpfs, never the root filesystem.
	shm, err := os.MkdirTemp("/dev/shm", "passage-hook-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	for _, n := range []string{"node.pub", "node.enrol.json", "product_uuid"} {
		b, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(shm, n), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	notProc := filepath.Join(t.TempDir(), "boot_id")
	if err := os.WriteFile(notProc, []byte("6f1c2a4e-8d3b-4c7a-9e15-2b7d0f4a9c31\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	base := []string{"--manifest", filepath.Join(dir, "manifest.dsse.json"), "--image-root", dir}
	for _, c := range []struct {
		name string
		args []string
		want []string // "": serves
	}{
		{"keys on a writable mount", []string{"--pub", filepath.Join(shm, "node.pub")}, []string{"--pub " + shm, "writable mount"}},
		{"key directory on a writable mount", []string{"--pub", shm}, []string{"--pub " + shm, "writable mount"}},
		{"node uuid on a writable mount", []string{"--pub", filepath.Join(dir, "node.pub"), "--node-uuid-file", filepath.Join(shm, "product_uuid")},
			[]string{"--node-uuid-file " + shm, "writable mount"}},
		{"boot id not the kernel's", []string{"--pub", filepath.Join(dir, "node.pub"), "--boot-id-file", notProc}, []string{"--boot-id-file " + notProc, "not on procfs"}},
		{"no node identity", []string{"--pub", filepath.Join(dir, "node.pub"), "--boot-id-file="}, []string{"no node identity"}},
		{"keys in the image, the kernel's boot id", []string{"--pub", filepath.Join(dir, "node.pub")}, nil},
		// The same keys with --image-root on another filesystem: no longer the image's.
		{"image root elsewhere", []string{"--pub", filepath.Join(dir, "node.pub"), "--image-root", shm}, []string{"--pub " + dir, "not the image's root filesystem " + shm}},
	} {
		t.Run(c.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "passage.sock")
			args := append(append(append([]string{}, base...), c.args...), "--socket", sock, "--nccl-dir=")
			var stderr bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			rc := run(ctx, args, &stderr)
			if c.want == nil {
				// It served until ctx ended.
				if rc != 0 {
					t.Fatalf("exit %d: %s", rc, stderr.String())
				}
				return
			}
			if rc != 1 {
				t.Fatalf("exit %d, want 1: %s", rc, stderr.String())
			}
			for _, w := range c.want {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("stderr %q does not say %q", stderr.String(), w)
				}
			}
		})
	}
}
