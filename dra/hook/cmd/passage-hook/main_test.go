package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
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
	var pvc string
	var list hooks.HookSidecarList
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var o struct {
			Kind     string
			Metadata struct {
				Name        string
				Annotations map[string]string
			}
		}
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatal(err)
		}
		switch o.Kind {
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
	for _, p := range []string{o.c.Manifest, o.c.Keys, o.uuidFile} {
		if !strings.HasPrefix(p, list[0].PVC.VolumePath+"/") {
			t.Errorf("%s is not on the PVC's mount %s", p, list[0].PVC.VolumePath)
		}
	}
	if !strings.HasPrefix(o.socket, hooks.HookSocketsSharedDirectory+"/") || strings.Count(strings.TrimPrefix(o.socket, hooks.HookSocketsSharedDirectory+"/"), "/") != 1 {
		t.Errorf("socket %s: virt-launcher looks one directory below %s", o.socket, hooks.HookSocketsSharedDirectory)
	}
	var stderr bytes.Buffer
	if _, err := parse([]string{"--bogus"}, &stderr); err == nil {
		t.Error("an unknown flag was accepted")
	}
}
