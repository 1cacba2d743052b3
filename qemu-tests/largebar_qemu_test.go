//go:build qemu

package qemutest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/manifest/manifesttest"
	"github.com/passage-boot/passage/topology"
)

// largeBARStandIn is a QEMUDevice whose stand-in for each function has no I/O BAR (as
// GPUs and ConnectX PFs have none: an I/O BAR per function exhausts x86's 64 KiB I/O
// space past about four units, and OVMF then drops whole devices) and a 64-bit
// prefetchable BAR2 the size of the function's largest BAR: ivshmem-plain over a
// memory backend on a sparse file, which takes address space and no memory. objects
// collects the -object arguments the devices need.
func largeBARStandIn(t *testing.T, dir string, objects *[]string) topology.QEMUDevice {
	return func(f topology.GuestFunction, bus string) string {
		size := uint64(4096)
		for _, b := range f.Host.BARs {
			size = max(size, b.Size)
		}
		path := filepath.Join(dir, f.ID)
		fh, err := os.Create(path)
		if err == nil {
			err = fh.Truncate(int64(size))
			if cerr := fh.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		*objects = append(*objects, "-object", fmt.Sprintf("memory-backend-file,id=mem-%s,size=%d,mem-path=%s,share=on", f.ID, size, path))
		return fmt.Sprintf("ivshmem-plain,id=%s,bus=%s,addr=0x0,memdev=mem-%s", f.ID, bus, f.ID)
	}
}

// TestLargeBARGuests boots, under OVMF, the guests render builds from a manifest whose
// units carry B300 BAR sizes (GPU 512 GiB), at the width render sets, with stand-ins of
// those sizes and no I/O BAR; inside each guest every stand-in's BAR0 and BAR2 is
// assigned (sysfs resource), at the size given, and each unit's functions sit below one
// root port, one switch (passage inspect's parents).
func TestLargeBARGuests(t *testing.T) {
	m := manifesttest.B300(1)
	src, err := hypervisor.Sources(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{8, 4, 2, 1} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			// Two guests at a time: TCG runs each guest's one vCPU on one thread, and the
			// suite runs nothing beside this test, so each takes a core of the two and the
			// four boots (OVMF's enumeration alone is minutes each) take half the wall time.
			t.Parallel()
			var ids []topology.UnitID
			for i := 0; i < n; i++ {
				ids = append(ids, topology.UnitID(i))
			}
			in := hypervisor.Input{Sources: src, Units: ids}
			r, err := hypervisor.Render(in, hypervisor.FormatQEMU, topology.DomainOptions{})
			if err != nil {
				t.Fatal(err)
			}
			want := map[int]int{1: 43, 2: 44, 4: 45, 8: 46}[n]
			if first := strings.SplitN(string(r.Out), "\n", 2)[0]; r.PhysBits != want || first != fmt.Sprintf("-cpu host,phys-bits=%d \\", want) {
				t.Fatalf("render: width %d, first line %q; want %d", r.PhysBits, first, want)
			}
			// At one bit less, render refuses before any guest exists.
			in.PhysBits = want - 1
			if _, err := hypervisor.Render(in, hypervisor.FormatQEMU, topology.DomainOptions{}); err == nil ||
				!strings.Contains(err.Error(), fmt.Sprintf("a %d-bit physical address width; the width given is %d bits", want, want-1)) {
				t.Fatalf("render at %d bits: %v", want-1, err)
			}
			var objects []string
			devs := r.Guest.QEMUArgs(largeBARStandIn(t, t.TempDir(), &objects))
			then := []string{"passage inspect --json"}
			var fns []topology.GuestFunction
			unitOf := map[string]string{}
			for _, u := range r.Guest.Units {
				for _, f := range u.Functions {
					fns = append(fns, f)
					unitOf[f.ID] = u.Unit.String()
					then = append(then, "cat /sys/bus/pci/devices/"+f.Addr.String()+"/resource")
				}
			}
			run, _ := measureGuest(t, guestBoot{Name: fmt.Sprintf("largebar-%d", n), Devices: append(objects, devs...), Then: then,
				OVMF: true, PhysBits: r.PhysBits})
			var tree struct {
				Devices []struct {
					BDF    string  `json:"bdf"`
					Parent *string `json:"parent"`
				} `json:"devices"`
			}
			if err := json.Unmarshal(run.Files["run-2.out"], &tree); err != nil {
				t.Fatalf("passage inspect --json: %v\n%s", err, run.Files["run-2.out"])
			}
			parent := map[string]string{}
			for _, d := range tree.Devices {
				if d.Parent != nil {
					parent[d.BDF] = *d.Parent
				}
			}
			rootPort := func(bdf string) string {
				for i := 0; i < 8 && parent[bdf] != ""; i++ {
					if _, ok := parent[parent[bdf]]; !ok {
						return parent[bdf]
					}
					bdf = parent[bdf]
				}
				return bdf
			}
			units := map[string]string{} // root port -> unit
			for i, f := range fns {
				res := string(run.Files[fmt.Sprintf("run-%d.out", i+3)])
				lines := strings.Split(res, "\n")
				if len(lines) < 3 {
					t.Errorf("%s (%s %s): resource %q", f.Addr, f.Role, f.ID, res)
					continue
				}
				size := uint64(4096)
				for _, b := range f.Host.BARs {
					size = max(size, b.Size)
				}
				for _, bar := range []struct {
					index int
					size  uint64
				}{{0, 256}, {2, size}} {
					var start, end, flags uint64
					if _, err := fmt.Sscanf(lines[bar.index], "0x%x 0x%x 0x%x", &start, &end, &flags); err != nil || start == 0 || end-start+1 != bar.size {
						t.Errorf("%s (%s of %s): BAR%d %q not assigned at %s", f.Addr, f.Role, f.ID, bar.index, lines[bar.index], topology.Bytes(bar.size))
					}
				}
				rp := rootPort(f.Addr.String())
				unit := unitOf[f.ID]
				if u, ok := units[rp]; ok && u != unit {
					t.Errorf("%s: below root port %s with %s's functions", f.ID, rp, u)
				}
				units[rp] = unit
			}
			if len(units) != n {
				t.Errorf("%d units below %d root ports: %v", n, len(units), units)
			}
			t.Logf("%d units: %s of 64-bit MMIO at %d bits; %d functions' BARs assigned", n, topology.Bytes(r.MMIO.Prefetchable64), r.PhysBits, len(fns))
		})
	}
}
