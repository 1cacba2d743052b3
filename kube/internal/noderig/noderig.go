// Package noderig is a B300 node as the DRA plugin sees it, for the driver's tests:
// pcitest's HGX B300 tree whose eight units' functions vfiotest's simulated kernel bound
// to vfio-pci, the node's DMI UUID, and a manifest of those units signed by the node's
// key, enrolled for the node in a key directory.
package noderig

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/passage-boot/passage/kube/internal/signedtest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// Rig is one node.
type Rig struct {
	Root, Dir string // the node's sys/ and dev/ are below Root; Dir holds the rest
	Tree      *pcitest.Node
	Kernel    *vfiotest.Kernel
	Key       *signedtest.Key
	M         *manifest.Manifest
	Path      string // the signed manifest envelope
	Keys      string // the key directory (--pub)
}

// UnitNames are pcitest's names of unit i's functions, in the manifest's order.
func UnitNames(i int) []string {
	return []string{fmt.Sprintf("gpu%d", i), fmt.Sprintf("nic%d.0", i), fmt.Sprintf("nic%d.1", i), fmt.Sprintf("nvme%d", i)}
}

// New builds the node with DMI UUID uuid and hostname host, its manifest of generation 7
// signed by key seed seed, enrolled in keys (a fleet's directory, shared by rigs).
func New(t testing.TB, uuid, host string, seed byte, keys string) *Rig {
	t.Helper()
	r := &Rig{Dir: t.TempDir(), Keys: keys}
	r.Tree = pcitest.New(t, pcitest.B300())
	r.Root = r.Tree.Root
	dmi := filepath.Join(r.Root, "sys/class/dmi/id")
	if err := os.MkdirAll(dmi, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dmi, "product_uuid"), []byte(uuid+"\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	var err error
	if r.Kernel, err = vfiotest.New(r.Root); err != nil {
		t.Fatal(err)
	}
	if err := r.Kernel.Load("vfio-pci"); err != nil {
		t.Fatal(err)
	}
	r.M = manifesttest.B300(7)
	r.M.Node.DMIUUID, r.M.Node.Hostname = uuid, host
	for i := range r.M.Units {
		for j, name := range UnitNames(i) {
			a := r.Tree.Addr(name)
			r.Rebind(t, a, "vfio-pci")
			f := &r.M.Units[i].Functions[j]
			f.BDF, f.IOMMUGroup = a.String(), r.group(t, a)
		}
	}
	r.Key = signedtest.NewKey(t, keys, host, seed, uuid)
	r.Path = r.Sign(t)
	return r
}

// Sign signs the rig's manifest M as it is now into Path.
func (r *Rig) Sign(t testing.TB) string {
	t.Helper()
	return r.Key.Sign(t, r.M, filepath.Join(r.Dir, "manifest.dsse.json"))
}

func (r *Rig) group(t testing.TB, a pci.Address) int {
	l, err := os.Readlink(filepath.Join(r.Root, pci.DevicesDir, a.String(), "iommu_group"))
	if err != nil {
		t.Fatal(err)
	}
	g, _ := strconv.Atoi(path.Base(l))
	return g
}

// Rebind moves a function to drv ("vfio-pci", or "" for its host driver) the way
// vfiobind does: driver_override, unbind, drivers_probe.
func (r *Rig) Rebind(t testing.TB, a pci.Address, drv string) {
	t.Helper()
	dev := path.Join(pci.DevicesDir, a.String())
	if err := r.Kernel.WriteFile(path.Join(dev, "driver_override"), []byte(drv+"\n")); err != nil {
		t.Fatal(err)
	}
	if cur, err := r.Kernel.ReadLink(path.Join(dev, "driver")); err == nil {
		if err := r.Kernel.WriteFile(path.Join("sys/bus/pci/drivers", path.Base(cur), "unbind"), []byte(a.String())); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Kernel.WriteFile("sys/bus/pci/drivers_probe", []byte(a.String())); err != nil {
		t.Fatal(err)
	}
}
