package pci_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// Hostile lspci dumps: input that holds no function at all is an error; a function whose
// hex block is damaged is kept, with a problem naming the dump line.

// smallDump is lspci's dump (flags: -xxxx, -xxx, ...) of a root port and the NIC below
// it, read from a synthetic sysfs tree; root port first.
func smallDump(t *testing.T, flags string) (string, *pcitest.Node) {
	t.Helper()
	n := pcitest.New(t, pcitest.Spec{Hosts: []pcitest.Host{{Bus: 0, Fns: []pcitest.Fn{
		pcitest.MgmtNIC("mgmt0", 1, pcitest.VendorBCMNet, pcitest.DevBCM57414)}}}})
	return string(runLspci(t, "-D", flags, "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath())), n
}

func parseOK(t *testing.T, in string) *pci.Tree {
	t.Helper()
	tree, err := pci.ParseDump(strings.NewReader(in))
	if err != nil {
		t.Fatalf("ParseDump: %v", err)
	}
	return tree
}

func TestParseDumpHoldsNoFunction(t *testing.T) {
	for name, in := range map[string]string{
		"empty":                   "",
		"blank lines":             "\n\r\n\n",
		"text":                    "this is not an lspci dump\nat all\n",
		"binary":                  "\x00\x01\x02\xff\xfe\x7f\x80garbage\x00\n\x1b[0m",
		"hex without a function":  "00: 86 80 2a 35 06 00 10 00 00 00 04 06 00 00 01 00\n10: 00 00 00 00 00 00 00 00 00 01 02 00 00 00 00 00\n",
		"lspci without -x":        "00:01.0 PCI bridge: Intel Corporation Device 352a\n01:00.0 Ethernet controller: Broadcom\n",
		"lspci -vvv without -x":   "0000:00:01.0 PCI bridge: Intel\n\tControl: I/O+ Mem+\n\n0000:01:00.0 Ethernet: Broadcom\n\tStatus: Cap+\n\n",
		"lspci -tv (tree format)": "-[0000:00]-+-00.0  Intel Corporation Device 0d57\n           \\-01.0-[01]----00.0  Broadcom\n",
	} {
		t.Run(name, func(t *testing.T) {
			tree, err := pci.ParseDump(strings.NewReader(in))
			if err == nil {
				t.Fatalf("no error; %d functions, problems %v", len(tree.Devices), tree.Problems)
			}
			if !strings.Contains(err.Error(), "pci dump: ") {
				t.Errorf("error %q", err)
			}
		})
	}
	file := filepath.Join(t.TempDir(), "empty.txt")
	os.WriteFile(file, nil, 0o644)
	if _, err := pci.ReadDump(file); err == nil || !strings.Contains(err.Error(), file) || !strings.Contains(err.Error(), "no PCI function") {
		t.Errorf("ReadDump of an empty file: %v", err)
	}
}

// editLines rewrites in line by line: edit gets each line's number (from 1) and text
// with its "\n", and returns the replacement and whether to keep it.
func editLines(in string, edit func(i int, l string) (string, bool)) string {
	var b strings.Builder
	for i, l := range strings.SplitAfter(in, "\n") {
		if out, keep := edit(i+1, l); keep {
			b.WriteString(out)
		}
	}
	return b.String()
}

// lineOf is the 1-based number of the first line of in that starts with prefix, after
// the line that starts with after.
func lineOf(t *testing.T, in, after, prefix string) int {
	t.Helper()
	started := after == ""
	for i, l := range strings.Split(in, "\n") {
		if !started {
			started = strings.HasPrefix(l, after)
			continue
		}
		if strings.HasPrefix(l, prefix) {
			return i + 1
		}
	}
	t.Fatalf("no line %q after %q", prefix, after)
	return 0
}

func TestParseDumpDamagedFunction(t *testing.T) {
	dump, n := smallDump(t, "-xxxx")
	rp, nic := n.Addr("rp-mgmt0"), n.Addr("mgmt0")
	if tree := parseOK(t, dump); tree.Err() != nil || len(tree.Devices) != 2 {
		t.Fatalf("clean dump: %d functions, %v", len(tree.Devices), tree.Err())
	}
	rpLine := func(prefix string) int { return lineOf(t, dump, rp.String(), prefix) }
	for _, tc := range []struct {
		name    string
		in      string
		bad     pci.Address // the function the problem is on
		problem string
	}{
		{"a line missing", editLines(dump, func(i int, l string) (string, bool) { return l, i != rpLine("20: ") }),
			rp, fmt.Sprintf("dump line %d: offset 0x30 where 0x20 was due", rpLine("20: "))},
		{"lines missing in the extended space", editLines(dump, func(i int, l string) (string, bool) {
			return l, i < rpLine("100: ") || i > rpLine("120: ")
		}), rp, fmt.Sprintf("dump line %d: offset 0x130 where 0x100 was due", rpLine("100: "))},
		{"an odd offset", editLines(dump, func(i int, l string) (string, bool) {
			if i == rpLine("20: ") {
				return "24:" + l[3:], true
			}
			return l, true
		}), rp, fmt.Sprintf("dump line %d: offset 0x24 where 0x20 was due", rpLine("20: "))},
		{"a line twice", editLines(dump, func(i int, l string) (string, bool) {
			if i == rpLine("20: ") {
				return l + l, true
			}
			return l, true
		}), rp, fmt.Sprintf("dump line %d: offset 0x20 where 0x30 was due", rpLine("20: ")+1)},
		{"a line that is not hex", editLines(dump, func(i int, l string) (string, bool) {
			if i == rpLine("20: ") {
				return "2g: 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00\n", true
			}
			return l, true
		}), rp, fmt.Sprintf("dump line %d: not a hex line", rpLine("20: "))},
		{"text inside the hex", editLines(dump, func(i int, l string) (string, bool) {
			if i == rpLine("20: ") {
				return "Connection reset by peer\n" + l, true
			}
			return l, true
		}), rp, fmt.Sprintf("dump line %d: not a hex line", rpLine("20: "))},
		{"a byte that is not hex", editLines(dump, func(i int, l string) (string, bool) {
			if i == rpLine("20: ") {
				return strings.Replace(l, " 00", " 0x", 1), true
			}
			return l, true
		}), rp, fmt.Sprintf("dump line %d: %q is not a hex byte", rpLine("20: "), "0x")},
		{"a short line", editLines(dump, func(i int, l string) (string, bool) {
			if i == rpLine("20: ") {
				return l[:len(l)-7] + "\n", true
			}
			return l, true
		}), rp, fmt.Sprintf("dump line %d: offset 0x30 where 0x2e was due", rpLine("30: "))},
		{"cut inside the standard space", dump[:strings.LastIndex(dump, "\n90: ")+1], nic, "config space truncated to 144 bytes"},
		{"cut inside a line", dump[:strings.LastIndex(dump, "\n90: ")+13], nic, "config space truncated to 147 bytes"},
		{"cut inside the extended space", dump[:strings.LastIndex(dump, "\n400: ")+1], nic, "extended config space truncated to 1024 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tree := parseOK(t, tc.in)
			if len(tree.Devices) != 2 {
				t.Fatalf("%d functions", len(tree.Devices))
			}
			d := tree.Lookup(tc.bad)
			if d == nil || !hasProblem(d, tc.problem) {
				t.Fatalf("%s: problems %q, want %q", tc.bad, d.Problems, tc.problem)
			}
			if tree.Err() == nil {
				t.Error("tree.Err() is nil")
			}
			// The other function is intact.
			other := tree.Devices[0]
			if other == d {
				other = tree.Devices[1]
			}
			if len(other.Problems) != 0 {
				t.Errorf("%s: problems %q", other.Addr, other.Problems)
			}
		})
	}
}

// TestParseDumpGapReadsAsLspci: bytes a damaged dump leaves out read as lspci -F reads
// them (0xff, the value of a read nothing answered), not as zeros that decode as a
// function without capabilities.
func TestParseDumpGapReadsAsLspci(t *testing.T) {
	dump, n := smallDump(t, "-xxxx")
	rp := n.Addr("rp-mgmt0")
	drop := lineOf(t, dump, rp.String(), "30: ")
	cut := editLines(dump, func(i int, l string) (string, bool) { return l, i != drop })
	file := filepath.Join(t.TempDir(), "cut.txt")
	os.WriteFile(file, []byte(cut), 0o644)
	again := parseOK(t, string(runLspci(t, "-F", file, "-xxxx")))
	ours := parseOK(t, cut)
	for _, d := range ours.Devices {
		l := again.Lookup(d.Addr)
		if l == nil || !bytes.Equal(d.Config, l.Config) {
			t.Errorf("%s: our bytes differ from lspci -F's", d.Addr)
		}
	}
	d := ours.Lookup(rp)
	if d.Express != nil || d.ExpressKnown() || !hasProblem(d, "unaligned pointer 0xff") {
		t.Errorf("root port with its capability pointer line missing: express %v known %v, problems %q", d.Express, d.ExpressKnown(), d.Problems)
	}
}

func TestParseDumpHexOutsideFunction(t *testing.T) {
	dump, n := smallDump(t, "-xxxx")
	nic := n.Addr("mgmt0")
	// A blank line splits the NIC's block: the rest is no function's.
	split := lineOf(t, dump, nic.String(), "80: ")
	in := editLines(dump, func(i int, l string) (string, bool) {
		if i == split {
			return "\n" + l, true
		}
		return l, true
	})
	tree := parseOK(t, in)
	want := fmt.Sprintf("dump lines %d-", split+1)
	if len(tree.Problems) != 1 || !strings.HasPrefix(tree.Problems[0], want) || !strings.Contains(tree.Problems[0], "outside any function") {
		t.Errorf("tree problems %q, want %q...", tree.Problems, want)
	}
	if d := tree.Lookup(nic); !hasProblem(d, "config space truncated to 128 bytes") {
		t.Errorf("nic problems %q", d.Problems)
	}
	// A dump whose head was cut off: hex before the first function.
	tree = parseOK(t, dump[strings.Index(dump, "\n10: ")+1:])
	if len(tree.Devices) != 1 || len(tree.Problems) != 1 || !strings.HasPrefix(tree.Problems[0], "dump lines 1-") {
		t.Errorf("%d functions, tree problems %q", len(tree.Devices), tree.Problems)
	}
}

// TestParseDump256OfExpress: lspci -xxx stops at 256 bytes, where the ACS and ATS
// capabilities of an Express function are not: the dump says so instead of showing a
// port without ACS.
func TestParseDump256OfExpress(t *testing.T) {
	dump, n := smallDump(t, "-xxx")
	tree := parseOK(t, dump)
	for _, name := range []string{"rp-mgmt0", "mgmt0"} {
		d := tree.Lookup(n.Addr(name))
		if !hasProblem(d, "dump holds only 256 bytes of config space") {
			t.Errorf("%s: problems %q", name, d.Problems)
		}
		if d.ExtCapsUnknown == "" {
			t.Errorf("%s: extended capabilities taken as known", name)
		}
	}
}

// endless is n bytes of a harmless text line over and over, without holding them.
type endless struct{ n int64 }

func (e *endless) Read(p []byte) (int, error) {
	if e.n <= 0 {
		return 0, io.EOF
	}
	const line = "\tControl: I/O+ Mem+ BusMaster+ SpecCycle- MemWINV- VGASnoop- ParErr- Stepping-\n"
	k := 0
	for k < len(p) && int64(k) < e.n {
		k += copy(p[k:min(len(p), k+int(min(e.n-int64(k), int64(len(line)))))], line)
	}
	e.n -= int64(k)
	return k, nil
}

func TestParseDumpSizeBound(t *testing.T) {
	const limit = 64 << 20
	in := io.MultiReader(strings.NewReader("00:01.0 x\n00: 86 80 2a 35\n\n"), &endless{n: limit})
	_, err := pci.ParseDump(in)
	if err == nil || !strings.Contains(err.Error(), "larger than 64 MiB") {
		t.Errorf("ParseDump past 64 MiB: %v", err)
	}
	// Exactly at the limit is fine.
	in = io.MultiReader(strings.NewReader("00:01.0 x\n00: 86 80 2a 35\n\n"), &endless{n: limit - 27})
	if _, err := pci.ParseDump(in); err != nil {
		t.Errorf("ParseDump of 64 MiB: %v", err)
	}
	big := filepath.Join(t.TempDir(), "big.txt")
	f, err := os.Create(big)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("00:01.0 x\n00: 86 80 2a 35\n")
	f.Truncate(limit + 1) // sparse: not written
	f.Close()
	if _, err := pci.ReadDump(big); err == nil || !strings.Contains(err.Error(), "larger than 64 MiB") || !strings.Contains(err.Error(), big) {
		t.Errorf("ReadDump of a file past 64 MiB: %v", err)
	}
	// A read error is an error, naming the line.
	_, err = pci.ParseDump(io.MultiReader(strings.NewReader("00:01.0 x\n00: 86 80\n"), iotestErr{}))
	if err == nil || !errors.Is(err, errBroken) {
		t.Errorf("read error: %v", err)
	}
}

var errBroken = errors.New("broken pipe")

type iotestErr struct{}

func (iotestErr) Read([]byte) (int, error) { return 0, errBroken }

// TestParseDumpFunctionBound: a dump names at most 65536 functions; more is no node's
// (and each costs memory), so it is refused rather than parsed.
func TestParseDumpFunctionBound(t *testing.T) {
	var b strings.Builder
	for i := 0; i <= 1<<16; i++ {
		fmt.Fprintf(&b, "%04x:%02x:%02x.%d x\n00: 86 80\n", i>>13, i>>5&0xff, i&0x1f, 0)
	}
	_, err := pci.ParseDump(strings.NewReader(b.String()))
	if err == nil || !strings.Contains(err.Error(), "more than 65536 functions") {
		t.Errorf("%v", err)
	}
}

// TestParseDumpDamageCounted: a function whose every line is damaged gets its first few
// damaged lines named and the rest counted, not a problem per line.
func TestParseDumpDamageCounted(t *testing.T) {
	var b strings.Builder
	b.WriteString("00:01.0 x\n")
	for off := 0; off < 0x1000; off += 0x20 { // every other line missing
		fmt.Fprintf(&b, "%03x: 86 80 2a 35 06 00 10 00 00 00 04 06 00 00 01 00\n", off)
	}
	tree := parseOK(t, b.String())
	d := tree.Devices[0]
	if len(d.Problems) > 8 || !hasProblem(d, "dump line 3: offset 0x20 where 0x10 was due") || !hasProblem(d, "more damaged hex lines") {
		t.Errorf("%d problems: %q", len(d.Problems), d.Problems)
	}
	if d.CapsUnknown == "" || d.ExtCapsUnknown == "" {
		t.Errorf("capability lists taken as known: %q %q", d.CapsUnknown, d.ExtCapsUnknown)
	}
}
