package kubevirthook

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"
	"kubevirt.io/kubevirt/pkg/dra/metadata"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/device/hostdevice/dra"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// requests are the unit shape's request names, as passage-dra's claim template names
// them (gpu, gpu-nic-0, gpu-nic-1, gpu-nvme), in the unit's function order.
var requests = []string{"gpu", "gpu-nic-0", "gpu-nic-1", "gpu-nvme"}

// kubevirtHostdevs runs KubeVirt v1.9.0's own DRA host device code
// (dra.CreateDRAHostDevices, what its converter calls for a VMI's hostDevices) on a VMI
// claiming the units, each claim's KEP-5304 metadata written where virt-launcher reads
// it, with each function's pciBusID from the manifest.
func kubevirtHostdevs(t testing.TB, m *manifest.Manifest, units []string) ([]api.HostDevice, *v1.VirtualMachineInstance) {
	t.Helper()
	base := t.TempDir()
	vmi := &v1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: "tenant"}}
	for _, id := range units {
		var u *manifest.Unit
		for i := range m.Units {
			if m.Units[i].ID == id {
				u = &m.Units[i]
			}
		}
		if u == nil {
			t.Fatalf("no unit %s", id)
		}
		claim := id + "-claim"
		vmi.Spec.ResourceClaims = append(vmi.Spec.ResourceClaims, v1.VirtualMachineInstanceResourceClaim{Name: claim})
		for k, f := range u.Functions {
			req := requests[k]
			vmi.Spec.Domain.Devices.HostDevices = append(vmi.Spec.Domain.Devices.HostDevices,
				v1.HostDevice{Name: claim + "-" + req, ClaimRequest: &v1.ClaimRequest{ClaimName: claim, RequestName: req}})
			bdf := f.BDF
			md := metadata.DeviceMetadata{TypeMeta: metav1.TypeMeta{APIVersion: metadata.APIVersionV1Alpha1, Kind: "DeviceMetadata"},
				ObjectMeta: metav1.ObjectMeta{Name: claim, Namespace: "tenant"},
				Requests: []metadata.DeviceMetadataRequest{{Name: req, Devices: []metadata.Device{{Driver: "passage-boot.github.io", Pool: "node",
					Name:       fmt.Sprintf("%s-%s", id, strings.NewReplacer(":", "-", ".", "-").Replace(bdf)),
					Attributes: map[resourcev1.QualifiedName]resourcev1.DeviceAttribute{metadata.PCIBusIDAttribute: {StringValue: &bdf}}}}}}}
			b, err := json.Marshal(md)
			if err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(base, "resourceclaimtemplates", claim, req)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "passage-boot.github.io-metadata.json"), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	hds, err := dra.CreateDRAHostDevices(vmi, base)
	if err != nil {
		t.Fatal(err)
	}
	if len(hds) != 4*len(units) {
		t.Fatalf("KubeVirt made %d hostdevs for %d units", len(hds), len(units))
	}
	return hds, vmi
}

// kubevirtDomain is the domain virt-launcher hands the hook first: KubeVirt's DomainSpec
// with a virtio disk, a memballoon, the controllers its converter writes, and the DRA
// host devices its own code made, marshalled tab-indented as virt-launcher does. With
// numa, the guest has one cell per host node (guestMappingPassthrough, bound by
// <numatune> memnodes) and the host devices are placed as PCINUMAAwareTopology places
// them (converter/pci-placement.go: one pcie-expander-bus per guest node, indexes upward
// from the highest, one pcie-root-port per device at slot = its place, busNr = 255 -
// controllers so far + 1, the hostdev at bus "<decimal index>" slot 0x00).
func kubevirtDomain(t testing.TB, m *manifest.Manifest, units []string, numa bool) []byte {
	t.Helper()
	hds, _ := kubevirtHostdevs(t, m, units)
	s := api.NewMinimalDomainSpec("tenant_vm")
	s.Type = "kvm"
	s.UUID = "5d3c3b1e-6c1f-4a63-9e0b-7a4f2d9c8e11" // virt-launcher writes the VMI's
	s.XmlNS = "http://libvirt.org/schemas/domain/qemu/1.0"
	s.Memory = api.Memory{Unit: "b", Value: 2 << 30}
	s.VCPU = &api.VCPU{Placement: "static", CPUs: 4}
	s.OS = api.OS{Type: api.OSType{OS: "hvm", Arch: "x86_64", Machine: "q35"}}
	s.Devices.Emulator = "/usr/bin/qemu-system-x86_64"
	s.Devices.Controllers = []api.Controller{
		{Type: "usb", Index: "0", Model: "none"},
		{Type: "scsi", Index: "0", Model: "virtio-non-transitional"},
		{Type: "virtio-serial", Index: "0", Model: "virtio-non-transitional"},
	}
	s.Devices.Disks = []api.Disk{{Device: "disk", Type: "file", Source: api.DiskSource{File: "/var/run/kubevirt-private/vmi-disks/rootdisk/disk.img"},
		Target: api.DiskTarget{Bus: "virtio", Device: "vda"}, Driver: &api.DiskDriver{Name: "qemu", Type: "raw", Cache: "none"},
		Alias: api.NewUserDefinedAlias("rootdisk")}}
	s.Devices.Ballooning = &api.MemBalloon{Model: "virtio-non-transitional"}
	s.Devices.HostDevices = hds
	if numa {
		s.CPU = api.CPU{NUMA: &api.NUMA{Cells: []api.NUMACell{{ID: "0", CPUs: "0-1", Memory: ptr(uint64(1 << 20)), Unit: "KiB"}, {ID: "1", CPUs: "2-3", Memory: ptr(uint64(1 << 20)), Unit: "KiB"}}}}
		s.NUMATune = &api.NUMATune{Memory: api.NumaTuneMemory{Mode: "strict", NodeSet: "0-1"},
			MemNodes: []api.MemNode{{CellID: 0, Mode: "strict", NodeSet: "0"}, {CellID: 1, Mode: "strict", NodeSet: "1"}}}
		placeNUMA(t, s, m)
	}
	b, err := xml.MarshalIndent(s, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// placeNUMA places the host devices as KubeVirt v1.9.0's expanderBusAssigner does
// (pkg/virt-launcher/virtwrap/converter/pci-placement.go, buildTopology/assignBusNr):
// the converter package itself cannot be built from the module proxy.
func placeNUMA(t testing.TB, s *api.DomainSpec, m *manifest.Manifest) {
	t.Helper()
	node := map[string]uint32{}
	for _, u := range m.Units {
		for _, f := range u.Functions {
			node[f.BDF] = uint32(u.NUMANode)
		}
	}
	idx, count := uint32(0), uint32(0) // no pci controller yet: the highest index is 0
	byNode := map[uint32][]int{}
	var nodes []uint32
	for i, h := range s.Devices.HostDevices {
		a := h.Source.Address
		bdf := fmt.Sprintf("%s:%s:%s.%s", strings.TrimPrefix(a.Domain, "0x"), strings.TrimPrefix(a.Bus, "0x"), strings.TrimPrefix(a.Slot, "0x"), strings.TrimPrefix(a.Function, "0x"))
		n, ok := node[bdf]
		if !ok {
			t.Fatalf("hostdev %s not in the manifest", bdf)
		}
		if _, seen := byNode[n]; !seen {
			nodes = append(nodes, n)
		}
		byNode[n] = append(byNode[n], i)
	}
	for _, n := range nodes {
		idx++
		count++
		n := n
		pxb := api.Controller{Type: "pci", Index: fmt.Sprint(idx), Model: "pcie-expander-bus", Target: &api.ControllerTarget{NUMANode: &n}}
		pxbIndex := pxb.Index
		var rps []api.Controller
		for k, i := range byNode[n] {
			idx++
			count++
			slot := "0x00"
			if k > 0 {
				slot = fmt.Sprintf("%#02x", k)
			}
			rps = append(rps, api.Controller{Type: "pci", Index: fmt.Sprint(idx), Model: "pcie-root-port",
				Address: &api.Address{Type: "pci", Domain: "0x0000", Bus: pxbIndex, Slot: slot, Function: "0x0"}})
			s.Devices.HostDevices[i].Address = &api.Address{Type: "pci", Domain: "0x0000", Bus: fmt.Sprint(idx), Slot: "0x00", Function: "0x0"}
		}
		nr := 255 - count + 1
		pxb.Target.BusNr = &nr
		s.Devices.Controllers = append(s.Devices.Controllers, pxb)
		s.Devices.Controllers = append(s.Devices.Controllers, rps...)
	}
}

// roundTrip is what virt-launcher keeps of a domain: parsed into KubeVirt's DomainSpec
// and written back as it writes it.
func roundTrip(t *testing.T, b []byte) []byte {
	t.Helper()
	var s api.DomainSpec
	if err := xml.Unmarshal(b, &s); err != nil {
		t.Fatalf("api.DomainSpec: %v\n%s", err, b)
	}
	out, err := xml.MarshalIndent(s, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// signed writes the B300 manifest (changed by edit) signed by a node key enrolled for
// its DMI UUID, and returns the manifest path and the key directory.
func signed(t testing.TB, edit func(*manifest.Manifest)) (*manifest.Manifest, string, string) {
	t.Helper()
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	if err := os.Mkdir(keys, 0o755); err != nil {
		t.Fatal(err)
	}
	seed := make([]byte, ed25519.SeedSize)
	seed[0] = 7
	priv := ed25519.NewKeyFromSeed(seed)
	signer, err := manifest.NewEd25519Signer(priv)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := manifest.MarshalPublicKey(priv.Public())
	if err != nil {
		t.Fatal(err)
	}
	pubPath := filepath.Join(keys, "node.pub")
	if err := os.WriteFile(pubPath, pub, 0o644); err != nil {
		t.Fatal(err)
	}
	m := manifesttest.B300(7)
	if edit != nil {
		edit(m)
	}
	id, _ := signer.KeyID()
	e, err := manifest.NewEnrolment(id, manifest.Node{DMIUUID: m.Node.DMIUUID}, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := manifest.WriteEnrolment(pubPath, e); err != nil {
		t.Fatal(err)
	}
	sg, err := manifest.Sign(context.Background(), m, signer)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "manifest.dsse.json")
	if err := os.WriteFile(path, sg.Envelope, 0o644); err != nil {
		t.Fatal(err)
	}
	return m, path, keys
}
