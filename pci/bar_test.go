package pci_test

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// TestResourceInput feeds sysfs resource files as a kernel or a damaged copy could hold
// them to the nic of small(), whose config space has no BARs: what parses is kept, what
// does not is a problem naming the line, and nothing panics.
func TestResourceInput(t *testing.T) {
	const zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
	line := func(start, end, flags uint64) string {
		return "0x" + hex16(start) + " 0x" + hex16(end) + " 0x" + hex16(flags) + "\n"
	}
	for _, tc := range []struct {
		name    string
		text    string // "" removes the file
		want    []pci.BAR
		problem string
	}{
		{"missing file", "", nil, ""},
		{"all zero", strings.Repeat(zero, 17), nil, ""},
		{"64-bit prefetchable from flags alone (a VF)", line(0x10000000000, 0x1ffffffffff, 0x14220c) + zero + strings.Repeat(zero, 15),
			[]pci.BAR{{Index: 0, Is64: true, Prefetch: true, Base: 0x10000000000, Size: 1 << 40}}, ""},
		{"unassigned keeps its size", line(0, 0xfff, 0x40200) + strings.Repeat(zero, 16),
			[]pci.BAR{{Index: 0, Size: 4096}}, ""},
		{"I/O", zero + line(0x2000, 0x207f, 0x40101) + strings.Repeat(zero, 15),
			[]pci.BAR{{Index: 1, IO: true, Base: 0x2000, Size: 128}}, ""},
		{"short line", "0x1 0x2\n", nil, "resource: line 1"},
		{"not hex", "0x1 0xzz 0x200\n", nil, "is not a hex number"},
		{"end below start", line(0x2000, 0x1000, 0x200) + zero, nil, "end 0x1000 below start 0x2000"},
		{"whole space", line(0, 0xffffffffffffffff, 0x200), nil, "spans the whole address space"},
		{"only two lines (an old kernel's)", zero + line(0x1000, 0x1fff, 0x40200), []pci.BAR{{Index: 1, Base: 0x1000, Size: 4096}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, small())
			p := filepath.Join(devDir(t, n, "nic"), "resource")
			if tc.text == "" {
				if err := os.Remove(p); err != nil {
					t.Fatal(err)
				}
			} else if err := os.WriteFile(p, []byte(tc.text), 0o644); err != nil {
				t.Fatal(err)
			}
			d := lookup(t, scan(t, n.Root), n, "nic")
			if !reflect.DeepEqual(d.BARs, tc.want) {
				t.Errorf("BARs %+v, want %+v", d.BARs, tc.want)
			}
			if tc.problem == "" && d.Err() != nil || tc.problem != "" && !hasProblem(d, tc.problem) {
				t.Errorf("problems %q, want one with %q", d.Problems, tc.problem)
			}
		})
	}
}

func hex16(v uint64) string {
	const digits = "0123456789abcdef"
	b := make([]byte, 16)
	for i := 15; i >= 0; i-- {
		b[i] = digits[v&0xf]
		v >>= 4
	}
	return string(b)
}

// FuzzResource: any bytes in a resource file give BARs with sizes that fit their start
// and end, and never a panic.
func FuzzResource(f *testing.F) {
	f.Add("0x0000010000000000 0x000001ffffffffff 0x000000000014220c\n")
	f.Add("0x0 0xffffffffffffffff 0x200\n0x1 0x0 0x100\n")
	f.Fuzz(func(t *testing.T, text string) {
		d := &pci.Device{}
		d.SetResources(text)
		for i, b := range d.BARs {
			if b.Index < 0 || b.Index > 5 || i > 0 && d.BARs[i-1].Index >= b.Index {
				t.Fatalf("BAR indexes %+v", d.BARs)
			}
			if b.Size == 0 || b.Base+(b.Size-1) < b.Base {
				t.Fatalf("BAR %+v: size does not fit", b)
			}
		}
	})
}
