package pciids_test

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/pciids"
	"github.com/passage-boot/passage/topology"
)

// lspciNames runs lspci -mm (machine-readable: "slot" "class" "vendor" "device" ...) over
// the tree with the database file and returns each function's vendor and device words.
// With hwdb false, lspci reads pci.ids alone (-O hwdb.disable=1); otherwise it also asks
// the hwdb.bin libudev finds, if any.
func lspciNames(t *testing.T, n *pcitest.Node, ids string, hwdb bool) map[string][2]string {
	t.Helper()
	lspci, err := exec.LookPath("lspci")
	if err != nil {
		t.Fatalf("lspci not found (image/deps.sh installs pciutils): %v", err)
	}
	args := []string{"-D", "-mm", "-i", ids, "-A", "linux-sysfs", "-O", "sysfs.path=" + n.SysfsPath()}
	if !hwdb {
		args = append(args, "-O", "hwdb.disable=1")
	}
	out, err := exec.Command(lspci, args...).Output()
	if err != nil {
		t.Fatalf("lspci: %v", err)
	}
	return parseLspciMM(t, out)
}

// parseLspciMM reads lspci -D -mm output: each function's vendor and device words.
func parseLspciMM(t *testing.T, out []byte) map[string][2]string {
	t.Helper()
	field := regexp.MustCompile(`"([^"]*)"`)
	names := map[string][2]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		l := sc.Text()
		slot, rest, _ := strings.Cut(l, " ")
		f := field.FindAllStringSubmatch(rest, -1)
		if len(f) < 3 {
			t.Fatalf("lspci -mm line %q", l)
		}
		names[slot] = [2]string{f[1][1], f[2][1]}
	}
	return names
}

// ours renders what lspci -mm prints from our lookup: lspci's "Vendor 15b3" and
// "Device 1023" where the database has no name.
func ours(db *pciids.DB, d *pci.Device) [2]string {
	v, dev := db.Names(d.VendorID, d.DeviceID)
	if v == "" {
		v = "Vendor " + leftPad(d.VendorID)
	}
	if dev == "" {
		dev = "Device " + leftPad(d.DeviceID)
	}
	return [2]string{v, dev}
}

func leftPad(id uint16) string {
	return strings.Repeat("0", 4-len(strconv.FormatUint(uint64(id), 16))) + strconv.FormatUint(uint64(id), 16)
}

func referenceTrees() map[string]pcitest.Spec {
	return map[string]pcitest.Spec{"b300": pcitest.B300(), "b200": pcitest.B200(), "sriov": pcitest.SRIOVNode(2, 4, 2)}
}

// TestNamesEqualLspci holds every function of three trees against lspci, with the
// system's pci.ids and with the subset an initramfs carries, each both with the hwdb.bin
// libudev finds (which lspci asks after pci.ids; on a host without udev there is none,
// and both read pci.ids alone) and with hwdb off (lspci -O hwdb.disable=1).
func TestNamesEqualLspci(t *testing.T) {
	full, err := pciids.Open(pciids.DefaultPath)
	if err != nil {
		t.Fatalf("%v (image/deps.sh installs pciutils, which ships it)", err)
	}
	subsetFile := filepath.Join(t.TempDir(), "pci.ids")
	var b bytes.Buffer
	if err := full.WriteSubset(&b, pciids.ProfileWants(builtinProfiles(t))); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(subsetFile, b.Bytes(), 0o644)
	subset, err := pciids.Open(subsetFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, whole := range []*pciids.DB{full, subset} {
		for name, spec := range referenceTrees() {
			n := pcitest.New(t, spec)
			tree, err := pci.Scan(n.Root)
			if err != nil {
				t.Fatal(err)
			}
			// What the commands read: the names of this tree's functions only.
			only, err := pciids.OpenFor(whole.Path(), treeIDs(tree))
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range tree.Devices {
				if got, want := ours(only, d), ours(whole, d); got != want {
					t.Errorf("%s %s %s: OpenFor names it %q, Open %q", name, d.IDs(), only.Path(), got, want)
				}
			}
			for _, hwdb := range []string{"", pciids.NoHwdb} {
				db, err := pciids.OpenDefaultFor(whole.Path(), hwdb, treeIDs(tree))
				if err != nil {
					t.Fatal(err)
				}
				src := db.Path() + " hwdb " + db.Hwdb()
				want := lspciNames(t, n, db.Path(), hwdb != pciids.NoHwdb)
				if len(want) != len(tree.Devices) || len(want) == 0 {
					t.Fatalf("%s: lspci lists %d functions, the scan %d", name, len(want), len(tree.Devices))
				}
				named := 0
				for _, d := range tree.Devices {
					got := ours(db, d)
					if got != want[d.Addr.String()] {
						t.Errorf("%s %s (%s) %s: ours %q, lspci %q", name, d.Addr, d.IDs(), src, got, want[d.Addr.String()])
					}
					if v, dv := db.Names(d.VendorID, d.DeviceID); v != "" && dv != "" {
						named++
					}
				}
				if named == 0 {
					t.Errorf("%s with %s: no function named; the comparison shows nothing", name, src)
				}
			}
		}
	}
	if fi, _ := os.Stat(subsetFile); fi.Size() > 100<<10 {
		t.Errorf("subset is %d bytes: not a small part of the database", fi.Size())
	}
}

func treeIDs(tree *pci.Tree) []pciids.ID {
	var ids []pciids.ID
	for _, d := range tree.Devices {
		ids = append(ids, pciids.ID{Vendor: d.VendorID, Device: d.DeviceID})
	}
	return ids
}

// TestOpenForStops: OpenFor reads no further than the vendors it was asked for; what it
// does read is checked as Open checks it.
func TestOpenForStops(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "pci.ids")
	os.WriteFile(f, []byte("# test\n10de  NVIDIA Corporation\n\t3182  B300\n15b3  Mellanox Technologies\n\t1021  CX7\n\t1023  CX8\n\t\t15b3 0001  card\n"+
		"8086  Intel Corporation\n\t352a  Root Port\nthis line is not pci.ids\n"), 0o644)
	if _, err := pciids.Open(f); err == nil {
		t.Fatal("Open accepted the malformed last line")
	}
	db, err := pciids.OpenFor(f, []pciids.ID{{0x15b3, 0x1023}, {0x10de, 0x3182}, {0x15b3, 0x9999}})
	if err != nil {
		t.Fatalf("OpenFor read past Mellanox's block: %v", err)
	}
	for _, c := range []struct {
		v, d   uint16
		vn, dn string
	}{
		{0x15b3, 0x1023, "Mellanox Technologies", "CX8"},
		{0x10de, 0x3182, "NVIDIA Corporation", "B300"},
		{0x15b3, 0x9999, "Mellanox Technologies", ""},
		{0x15b3, 0x1021, "Mellanox Technologies", ""}, // in the file, not asked for
		{0x8086, 0x352a, "", ""},                      // after the stop
	} {
		if vn, dn := db.Names(c.v, c.d); vn != c.vn || dn != c.dn {
			t.Errorf("Names(%04x:%04x) = %q %q, want %q %q", c.v, c.d, vn, dn, c.vn, c.dn)
		}
	}
	// A vendor the file lacks is looked for up to the class section, and a malformed line
	// on the way is an error.
	if _, err := pciids.OpenFor(f, []pciids.ID{{0x1af4, 0x1000}}); err == nil || !strings.Contains(err.Error(), f) {
		t.Errorf("OpenFor of an absent vendor: %v, want the malformed line named", err)
	}
	os.WriteFile(f, []byte("15b3  Mellanox\n\t1023  CX8\nC 02  Network controller\nnot read\n"), 0o644)
	if db, err := pciids.OpenFor(f, []pciids.ID{{0x1af4, 0x1000}}); err != nil || db == nil {
		t.Errorf("OpenFor read past the class section: %v", err)
	}
}

func builtinProfiles(t *testing.T) []*topology.Profile {
	var out []*topology.Profile
	for _, n := range topology.Builtins() {
		p, err := topology.Builtin(n)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

func TestLabel(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "pci.ids")
	os.WriteFile(f, []byte("# test\n15b3  Mellanox Technologies\n\t1023  CX8 Family [ConnectX-8]\n\t\t15b3 0001  Some card\nC 02  Network controller\n\t00  Ethernet controller\n\t\t00  plain\n"), 0o644)
	db, err := pciids.Open(f)
	if err != nil {
		t.Fatal(err)
	}
	var none *pciids.DB
	for _, c := range []struct {
		db     *pciids.DB
		v, d   uint16
		want   string
		vn, dn string
	}{
		{db, 0x15b3, 0x1023, "Mellanox Technologies CX8 Family [ConnectX-8] [15b3:1023]", "Mellanox Technologies", "CX8 Family [ConnectX-8]"},
		{db, 0x15b3, 0x1021, "Mellanox Technologies Device 1021 [15b3:1021]", "Mellanox Technologies", ""},
		{db, 0x10de, 0x2901, "[10de:2901]", "", ""},
		{none, 0x15b3, 0x1023, "[15b3:1023]", "", ""},
	} {
		if got := c.db.Label(c.v, c.d); got != c.want {
			t.Errorf("Label(%04x:%04x) = %q, want %q", c.v, c.d, got, c.want)
		}
		if vn, dn := c.db.Names(c.v, c.d); vn != c.vn || dn != c.dn {
			t.Errorf("Names(%04x:%04x) = %q %q", c.v, c.d, vn, dn)
		}
	}
}

func TestOpenBadInput(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"short vendor":        "15b3\n",
		"device first":        "\t1023  CX8\n",
		"short device":        "15b3  Mellanox\n\t10\n",
		"short subsystem":     "15b3  Mellanox\n\t1023  CX8\n\t\t15b3\n",
		"short class":         "C 0\n",
		"not hex":             "zzzz  Vendor\n",
		"multibyte, short":    "15b3  M\n\t1ä\n",
		"line past 64 KiB":    "15b3  " + strings.Repeat("x", 70<<10) + "\n",
		"short prog-if":       "C 02  Net\n\t00  Eth\n\t\t0\n",
		"short class subline": "C 02  Net\n\t0\n",
	} {
		f := filepath.Join(dir, strings.ReplaceAll(name, " ", "-"))
		os.WriteFile(f, []byte(content), 0o644)
		db, err := pciids.Open(f)
		if err == nil || db != nil || !strings.Contains(err.Error(), f) {
			t.Errorf("%s: db %v err %v, want an error naming the file", name, db, err)
		}
	}
	if _, err := pciids.Open(dir); err == nil {
		t.Error("a directory opened as pci.ids")
	}
	if _, err := pciids.Open(filepath.Join(dir, "none")); err == nil {
		t.Error("a missing explicit file is no error")
	}
}

func FuzzOpen(f *testing.F) {
	f.Add([]byte("15b3  Mellanox Technologies\n\t1023  CX8 Family [ConnectX-8]\n\t\t15b3 0001  card\nC 02  Net\n\t00  Eth\n\t\t00  x\n"))
	f.Add([]byte("\t\t\n"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(dir, "pci.ids")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Skip()
		}
		db, err := pciids.Open(p)
		if err != nil {
			return
		}
		db.Label(0x15b3, 0x1023)
		// Whatever the whole file names, a lookup of those IDs alone names the same.
		ids := []pciids.ID{{0x15b3, 0x1023}, {0x15b3, 0x0001}, {0x1234, 0x5678}}
		few, err := pciids.OpenFor(p, ids)
		if err != nil {
			t.Fatalf("Open accepted the file, OpenFor: %v", err)
		}
		for _, id := range ids {
			v1, d1 := db.Names(id.Vendor, id.Device)
			v2, d2 := few.Names(id.Vendor, id.Device)
			if v1 != v2 || d1 != d2 {
				t.Fatalf("%04x:%04x: Open %q %q, OpenFor %q %q", id.Vendor, id.Device, v1, d1, v2, d2)
			}
		}
	})
}

// BenchmarkNames: the whole database against the names of the B300 reference's functions.
func BenchmarkNames(b *testing.B) {
	n := pcitest.New(b, pcitest.B300())
	tree, err := pci.Scan(n.Root)
	if err != nil {
		b.Fatal(err)
	}
	ids := treeIDs(tree)
	b.Run("Open", func(b *testing.B) {
		for b.Loop() {
			if _, err := pciids.Open(pciids.DefaultPath); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("OpenFor", func(b *testing.B) {
		for b.Loop() {
			if _, err := pciids.OpenFor(pciids.DefaultPath, ids); err != nil {
				b.Fatal(err)
			}
		}
	})
	// What the commands do: OpenFor, then the host's hwdb for what pci.ids lacks.
	b.Run("OpenDefaultFor", func(b *testing.B) {
		b.Logf("hwdb: %q", pciids.DefaultHwdb())
		for b.Loop() {
			if _, err := pciids.OpenDefaultFor("", "", ids); err != nil {
				b.Fatal(err)
			}
		}
	})
}
