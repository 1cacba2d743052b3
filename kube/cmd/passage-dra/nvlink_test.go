package main

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/internal/signedtest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// TestNVLinkCommands: on a node with the HGX layout (gpu<i> on module i+1, gpu3
// failed), slices prints the NVLink templates beside the per-shape one; kubevirt claims
// units that are one partition with one claim from the partition's template (a host
// device per request), and others one by one; nccl-xml gives the GPUs of a partition
// their NVLinks and those of other sets none.
func TestNVLinkCommands(t *testing.T) {
	dir := t.TempDir()
	m := manifesttest.B300(4)
	m.NVLink = &manifest.NVLink{Source: "profile", Partitions: [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8},
		{1, 2}, {3, 4}, {5, 6}, {7, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}}
	for i := range m.Units {
		m.Units[i].ModuleID, m.Units[i].ModuleSource = i+1, "test wiring"
	}
	m.Units[3].Status, m.Units[3].Reasons = manifest.StatusFailed, []string{"acs: mismatch"}
	k := signedtest.NewKey(t, filepath.Join(dir, "keys"), "a", 1, m.Node.DMIUUID)
	path := k.Sign(t, m, filepath.Join(dir, "a.dsse.json"))
	keys := filepath.Dir(k.Pub)
	shape := resources.Shape{"gpu", "gpu-nic", "gpu-nic", "gpu-nvme"}

	code, out, errs := runCmd("slices", "--pub", keys, path)
	if code != 0 {
		t.Fatalf("slices: exit %d: %s", code, errs)
	}
	for _, want := range []string{"name: " + shape.TemplateName() + "\n", "name: " + shape.NVLinkTemplateName(2) + "\n",
		"name: " + shape.NVLinkTemplateName(4) + "\n", "name: " + shape.NVLinkTemplateName(8) + "\n",
		"matchAttribute: passage-boot.github.io/nvlinkPartition4"} {
		if !strings.Contains(out, want) {
			t.Errorf("slices output lacks %q", want)
		}
	}
	// gpu0's devices: module 1, first of the pair 1.2.
	if !regexp.MustCompile(`moduleID:\s+int: 1\s+nvlinkPartition2:\s+string: "1.2"\s+nvlinkPartition2Index:\s+int: 0\s`).MatchString(out) {
		t.Errorf("slices output lacks gpu0's NVLink attributes")
	}

	kubevirt := func(units string) resources.VMIClaims {
		t.Helper()
		code, out, errs := runCmd("kubevirt", "--pub", keys, "--unit", units, "--claim", "vm", path)
		if code != 0 {
			t.Fatalf("kubevirt --unit %s: exit %d: %s", units, code, errs)
		}
		var doc struct {
			Spec resources.VMIClaims `json:"spec"`
		}
		if err := yaml.UnmarshalStrict([]byte(out), &doc); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		return doc.Spec
	}
	s := kubevirt("gpu4,gpu5,gpu6,gpu7")
	if len(s.ResourceClaims) != 1 || s.ResourceClaims[0].Name != "vm" || s.ResourceClaims[0].ResourceClaimTemplateName != shape.NVLinkTemplateName(4) {
		t.Fatalf("a partition of 4: resourceClaims %+v", s.ResourceClaims)
	}
	var reqs []string
	for _, h := range s.Domain.Devices.HostDevices {
		if h.ClaimName != "vm" || h.Name != "vm-"+h.RequestName {
			t.Errorf("host device %+v", h)
		}
		reqs = append(reqs, h.RequestName)
	}
	if strings.Join(reqs, " ") != strings.Join(shape.NVLinkRequestNames(4), " ") || len(reqs) != 16 || reqs[4] != "u1-gpu" {
		t.Fatalf("hostDevices requests %v", reqs)
	}
	if s := kubevirt("gpu0,gpu2"); len(s.ResourceClaims) != 2 || s.ResourceClaims[1].ResourceClaimTemplateName != shape.TemplateName() {
		t.Fatalf("two units of two pairs: resourceClaims %+v", s.ResourceClaims)
	}
	if code, _, errs := runCmd("kubevirt", "--pub", keys, "--unit", "gpu2,gpu3", path); code != 1 || !strings.Contains(errs, "unit gpu3 is failed") {
		t.Fatalf("a pair with a failed unit: exit %d %s", code, errs)
	}

	for units, want := range map[string]int{"gpu0,gpu1": 2, "gpu4,gpu5,gpu6,gpu7": 4, "gpu0,gpu2": 0, "gpu0": 0, "gpu4,gpu5,gpu6": 0} {
		code, out, errs := runCmd("nccl-xml", "--pub", keys, "--unit", units, path)
		if code != 0 {
			t.Fatalf("nccl-xml --unit %s: exit %d: %s", units, code, errs)
		}
		if n := strings.Count(out, `<nvlink target="fffffff:ff:ff.0" count="18" tclass="0x068000">`); n != want {
			t.Errorf("nccl-xml --unit %s: %d GPUs with NVLinks, want %d\n%s", units, n, want, out)
		}
	}
}
