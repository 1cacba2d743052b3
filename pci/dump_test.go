package pci_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// TestDumpMatchesScan has the real lspci dump a reference tree (-vvvxxxx: text around the
// hex) and checks that the dump reader rebuilds what Scan read from sysfs: the same
// config bytes, decodings and parents, the latter from bus numbers alone.
func TestDumpMatchesScan(t *testing.T) {
	for _, flags := range []string{"-xxxx", "-vvvxxxx"} {
		t.Run(flags, func(t *testing.T) {
			n := pcitest.New(t, pcitest.B300())
			live := scan(t, n.Root)
			out := runLspci(t, "-D", flags, "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath())
			dump, err := pci.ParseDump(bytes.NewReader(out))
			if err != nil {
				t.Fatal(err)
			}
			if err := dump.Err(); err != nil {
				t.Fatal(err)
			}
			if len(dump.Devices) != len(live.Devices) {
				t.Fatalf("dump %d functions, scan %d", len(dump.Devices), len(live.Devices))
			}
			for i, d := range dump.Devices {
				l := live.Devices[i]
				if d.Addr != l.Addr || !bytes.Equal(d.Config, l.Config) {
					t.Fatalf("%s: config differs from %s's", d.Addr, l.Addr)
				}
				if fmt.Sprint(d.Parent) != fmt.Sprint(l.Parent) {
					t.Errorf("%s: dump parent %v, sysfs parent %v", d.Addr, d.Parent, l.Parent)
				}
				// A dump holds config space only: its BARs are the scan's without the
				// sizes sysfs resource gives, and it has no VPD (sysfs vpd).
				unsized := *l
				unsized.BARs, unsized.VPD = nil, nil
				for _, b := range l.BARs {
					b.Size = 0
					unsized.BARs = append(unsized.BARs, b)
				}
				if fmt.Sprint(ourView(d)) != fmt.Sprint(ourView(&unsized)) || d.IDs() != l.IDs() || fmt.Sprint(d.BARs) != fmt.Sprint(unsized.BARs) {
					t.Errorf("%s decodes differently: BARs %+v, scan's %+v", d.Addr, d.BARs, l.BARs)
				}
				if d.NUMANode != -1 || d.IOMMUGroup != -1 || d.Driver != "" || d.SysPath != "" {
					t.Errorf("%s: sysfs-only fields set from a dump", d.Addr)
				}
			}
		})
	}
}

const hdr64 = `00: 86 80 2a 35 06 00 10 00 00 00 04 06 00 00 01 00
10: 00 00 00 00 00 00 00 00 00 01 02 00 00 00 00 00
20: 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
30: 00 00 00 00 40 00 00 00 00 00 00 00 00 00 00 00
`

func TestParseDumpCases(t *testing.T) {
	for _, tc := range []struct {
		name  string
		in    string
		check func(t *testing.T, tree *pci.Tree)
	}{
		{"lspci -x: 64 bytes", "00:01.0 PCI bridge: Intel\n" + hdr64, func(t *testing.T, tree *pci.Tree) {
			d := tree.Devices[0]
			if d.IDs() != "8086:352a" || !d.IsBridge() || d.SecondaryBus != 1 || d.SubordinateBus != 2 {
				t.Errorf("%s bridge %v [%d-%d]", d.IDs(), d.IsBridge(), d.SecondaryBus, d.SubordinateBus)
			}
			if len(d.Problems) != 1 || !strings.Contains(d.Problems[0], "dump holds only 64 bytes") {
				t.Errorf("problems %q", d.Problems)
			}
		}},
		{"CRLF, domain, text between", "0000:00:01.0 PCI bridge\r\n\tControl: I/O+\r\n" + strings.ReplaceAll(hdr64, "\n", "\r\n"), func(t *testing.T, tree *pci.Tree) {
			if d := tree.Devices[0]; d.IDs() != "8086:352a" || len(d.Config) != 64 {
				t.Errorf("%s %d bytes", d.IDs(), len(d.Config))
			}
		}},
		{"five-digit domain", "00001:02:03.4 x\n00: de 10\n", func(t *testing.T, tree *pci.Tree) {
			if d := tree.Devices[0]; d.Addr.String() != "0001:02:03.4" || d.VendorID != 0x10de {
				t.Errorf("%s %s", d.Addr, d.IDs())
			}
		}},
		{"domain too wide", "10000:02:03.4 x\n00: de 10\n", func(t *testing.T, tree *pci.Tree) {
			if len(tree.Devices) != 0 || len(tree.Problems) != 1 || !strings.Contains(tree.Problems[0], `function "10000:02:03.4" not representable`) {
				t.Errorf("%d functions, problems %q", len(tree.Devices), tree.Problems)
			}
		}},
		{"hex before any function, and after a blank line", "00: ff ff\n00:02.0 x\n00: de 10\n\n00: 86 80\n", func(t *testing.T, tree *pci.Tree) {
			if len(tree.Devices) != 1 || tree.Devices[0].VendorID != 0x10de || len(tree.Devices[0].Config) != 2 {
				t.Errorf("%d functions %v", len(tree.Devices), tree.Devices)
			}
		}},
		{"listed twice", "00:02.0 x\n00: de 10\n\n00:02.0 y\n00: 86 80\n", func(t *testing.T, tree *pci.Tree) {
			if len(tree.Devices) != 1 || tree.Devices[0].VendorID != 0x10de || len(tree.Problems) != 1 {
				t.Errorf("%v problems %q", tree.Devices, tree.Problems)
			}
		}},
		{"offset past 4096", "00:02.0 x\nff8: 01 02 03 04 05 06 07 08 09 0a\n", func(t *testing.T, tree *pci.Tree) {
			d := tree.Devices[0]
			if len(d.Config) != 4096 || d.Config[0xfff] != 0x08 || !hasProblem(d, "dump line 2: offset 0x1000 past 4096 bytes") {
				t.Errorf("%d bytes, problems %q", len(d.Config), d.Problems)
			}
		}},
		{"odd bytes stop a line", "00:02.0 x\n00: de 10 zz 86\n", func(t *testing.T, tree *pci.Tree) {
			if d := tree.Devices[0]; len(d.Config) != 2 {
				t.Errorf("%d bytes", len(d.Config))
			}
		}},
		{"bridges in a bus loop", "01:00.0 a\n" + bridgeHex(1, 2, 2) + "\n02:00.0 b\n" + bridgeHex(2, 1, 1), func(t *testing.T, tree *pci.Tree) {
			// 01:00.0 forwards to bus 2 and 02:00.0 back to bus 1: a loop, cut and reported.
			for _, d := range tree.Devices {
				steps := 0
				for p := d.Parent; p != nil; p = p.Parent {
					if steps++; steps > 2 {
						t.Fatalf("%s: parent chain loops", d.Addr)
					}
				}
			}
			if err := tree.Err(); err == nil || !strings.Contains(err.Error(), "is its own descendant") {
				t.Errorf("err %v", err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tree, err := pci.ParseDump(strings.NewReader(tc.in))
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, tree)
		})
	}
}

// bridgeHex is a type 1 header's dump with the given bus numbers.
func bridgeHex(pri, sec, sub int) string {
	return fmt.Sprintf("00: 86 80 2a 35 00 00 00 00 00 00 04 06 00 00 01 00\n10: 00 00 00 00 00 00 00 00 %02x %02x %02x 00\n", pri, sec, sub)
}

func TestParseDumpErrors(t *testing.T) {
	long := "00:01.0 x\n" + strings.Repeat("a", 70<<10) + "\n"
	if _, err := pci.ParseDump(strings.NewReader(long)); err == nil || !strings.Contains(err.Error(), "line 2 longer than") {
		t.Errorf("long line: %v", err)
	}
	if _, err := pci.ReadDump(filepath.Join(t.TempDir(), "none")); err == nil || !os.IsNotExist(err) && !strings.Contains(err.Error(), "no such file") {
		t.Errorf("missing file: %v", err)
	}
}
