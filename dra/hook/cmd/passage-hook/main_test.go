package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kubevirt.io/kubevirt/pkg/hooks"
	"sigs.k8s.io/yaml"
)

// TestDeployAnnotation: the VMI annotation in deploy/kubevirt-hook.yaml decodes strictly
// into KubeVirt's own hook sidecar list, mounts the PVC the file defines, and its
// arguments are this command's flags.
func TestDeployAnnotation(t *testing.T) {
	b, err := os.ReadFile("../../../deploy/kubevirt-hook.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var pvc, pvPath string
	var list hooks.HookSidecarList
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var o struct {
			Kind     string
			Metadata struct {
				Name        string
				Annotations map[string]string
			}
			Spec struct {
				HostPath struct{ Path string }
			}
		}
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatal(err)
		}
		switch o.Kind {
		case "PersistentVolume":
			pvPath = o.Spec.HostPath.Path
		case "PersistentVolumeClaim":
			pvc = o.Metadata.Name
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
	o, err := parse(list[0].Args, io.Discard)
	if err != nil {
		t.Fatalf("args %q: %v", list[0].Args, err)
	}
	// The files passage-dra plugin --hook-dir writes (dra/plugin's HookManifest,
	// HookKey, HookNodeUUID; TestHookDirFromPlugin verifies from them), on the PV over
	// the DaemonSet's hook dir.
	for p, name := range map[string]string{o.c.Manifest: "manifest.dsse.json", o.c.Keys: "node.pub", o.uuidFile: "product_uuid"} {
		if p != list[0].PVC.VolumePath+"/"+name {
			t.Errorf("%s: want the plugin's %s on the PVC's mount %s", p, name, list[0].PVC.VolumePath)
		}
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
