package pciids_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/pciids"
	"github.com/passage-boot/passage/pciids/hwdbtest"
)

// testHwdb is a hardware database source the tests write: two files, so that both the
// later line and the later file's override are exercised, with globs of each kind.
var testHwdb = map[string]string{
	"etc/udev/hwdb.d/20-pci-test.hwdb": `# passage test
pci:v000015B3*
 ID_VENDOR_FROM_DATABASE=Test Mellanox

pci:v000015B3d00001023*
 ID_MODEL_FROM_DATABASE=CX8 by device

pci:v000015B3d0000102?*
 ID_MODEL_FROM_DATABASE=CX7-8 by glob
 TEST_GLOB=question

pci:v000010DEd0000[2-3]???*
 ID_MODEL_FROM_DATABASE=NVIDIA by bracket

pci:v000010DEd0000[!2-3]???*
 ID_MODEL_FROM_DATABASE=NVIDIA by negated bracket

pci:v000010DE*
 ID_VENDOR_FROM_DATABASE=Test NVIDIA

pci:v00001AF4d00001041*
 ID_MODEL_FROM_DATABASE=virtio 1.0 net

pci:v00001AF4d0000104?*
 ID_MODEL_FROM_DATABASE=virtio by glob, after 1041 and before 1042

pci:v00001AF4d00001042*
 ID_MODEL_FROM_DATABASE=virtio block, exact and a later line

pci:v*d*sv*sd*bc02*
 ID_PCI_CLASS_FROM_DATABASE=Network controller
`,
	"etc/udev/hwdb.d/30-pci-override.hwdb": `pci:v000010DE*
 ID_VENDOR_FROM_DATABASE=NVIDIA from the later file

usb:v1D6Bp0002*
 ID_MODEL_FROM_DATABASE=2.0 root hub
`,
}

// systemdQuery is systemd-hwdb query's answer for modalias: the oracle for Properties.
func systemdQuery(t *testing.T, root, modalias string) map[string]string {
	t.Helper()
	out, err := exec.Command("systemd-hwdb", "query", "--root", root, modalias).Output()
	if err != nil {
		t.Fatalf("systemd-hwdb query %s: %v", modalias, err)
	}
	props := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), "=")
		if !ok {
			t.Fatalf("systemd-hwdb query %s: line %q", modalias, sc.Text())
		}
		props[k] = v
	}
	return props
}

// TestHwdbEqualsSystemd holds Properties against systemd-hwdb query on a database built
// from files the test writes: the lookups libpci makes (with their trailing '*'), plain
// modaliases as the kernel writes them, and searches that stop inside a key.
func TestHwdbEqualsSystemd(t *testing.T) {
	root, bin := hwdbtest.Build(t, testHwdb)
	h, err := pciids.OpenHwdb(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	nonEmpty := 0
	for _, m := range []string{
		"pci:v000015B3*", "pci:v000015B3d00001023*", "pci:v000015B3d00001021*", "pci:v000015B3d00001030*",
		"pci:v000010DE*", "pci:v000010DEd000022A3*", "pci:v000010DEd00003182*", "pci:v000010DEd00001234*",
		"pci:v000010DEd00002901sv000010DEsd00001999bc03sc02i00",
		"pci:v00001AF4d00001041*", "pci:v00001AF4d00001042*", "pci:v00001AF4d00001043*", "pci:v00001AF4d00001000*", "pci:v00008086d00001234sv0sd0bc02sc00i00",
		"pci:v0000", "pci:", "", "usb:v1D6Bp0002d0601", "usb:v1D6Bp0003*",
	} {
		got, err := h.Properties(m)
		if err != nil {
			t.Fatalf("Properties(%q): %v", m, err)
		}
		if want := systemdQuery(t, root, m); !maps.Equal(got, want) {
			t.Errorf("Properties(%q) = %v, systemd-hwdb %v", m, got, want)
		}
		if len(got) > 0 {
			nonEmpty++
		}
	}
	if nonEmpty < 8 {
		t.Errorf("only %d lookups found anything: the comparison shows little", nonEmpty)
	}
}

// TestOpenDefaultForHwdb: names come from pci.ids first and from hwdb for what pci.ids
// does not list, vendor and device each on its own (libpci's id_lookup); none reads
// pci.ids alone; neither names nothing.
func TestOpenDefaultForHwdb(t *testing.T) {
	_, bin := hwdbtest.Build(t, testHwdb)
	ids := filepath.Join(t.TempDir(), "pci.ids")
	os.WriteFile(ids, []byte("15b3  Mellanox Technologies\n\t1021  CX7 from pci.ids\n\t1023  \n"), 0o644)
	want := []pciids.ID{{0x15b3, 0x1021}, {0x15b3, 0x1023}, {0x15b3, 0x1025}, {0x10de, 0x22a3}, {0x1af4, 0x1041}, {0x1af4, 0x1042}, {0x8086, 0x1234}}
	db, err := pciids.OpenDefaultFor(ids, bin, want)
	if err != nil {
		t.Fatal(err)
	}
	none, err := pciids.OpenDefaultFor(ids, pciids.NoHwdb, want)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		db     *pciids.DB
		v, d   uint16
		vn, dn string
	}{
		{db, 0x15b3, 0x1021, "Mellanox Technologies", "CX7 from pci.ids"},
		// pci.ids lists 1023 with no name: libpci takes that as the answer, hwdb is not asked.
		{db, 0x15b3, 0x1023, "Mellanox Technologies", ""},
		{db, 0x15b3, 0x1025, "Mellanox Technologies", "CX7-8 by glob"},
		{db, 0x10de, 0x22a3, "NVIDIA from the later file", "NVIDIA by bracket"},
		// 1041's exact key is on an earlier line than the glob that also matches it: the
		// later line wins, as in sd-hwdb.
		{db, 0x1af4, 0x1041, "", "virtio by glob, after 1041 and before 1042"},
		{db, 0x1af4, 0x1042, "", "virtio block, exact and a later line"},
		{db, 0x8086, 0x1234, "", ""},
		{db, 0x10de, 0x4444, "NVIDIA from the later file", ""}, // not asked for
		{none, 0x15b3, 0x1025, "Mellanox Technologies", ""},
		{none, 0x10de, 0x22a3, "", ""},
	} {
		if vn, dn := c.db.Names(c.v, c.d); vn != c.vn || dn != c.dn {
			t.Errorf("%s/%s: Names(%04x:%04x) = %q %q, want %q %q", c.db.Path(), c.db.Hwdb(), c.v, c.d, vn, dn, c.vn, c.dn)
		}
	}
	if db.Hwdb() != bin || none.Hwdb() != "" {
		t.Errorf("Hwdb() = %q and %q, want %q and none", db.Hwdb(), none.Hwdb(), bin)
	}
	// No pci.ids given and none at a path that does not exist: an explicit file must exist.
	if _, err := pciids.OpenDefaultFor(filepath.Join(t.TempDir(), "none"), bin, want); err == nil {
		t.Error("a missing explicit pci.ids is no error")
	}
	if _, err := pciids.OpenDefaultFor(ids, filepath.Join(t.TempDir(), "none"), want); err == nil {
		t.Error("a missing explicit hwdb is no error")
	}
}

// TestHwdbBadInput: a hwdb.bin that is short, foreign, lies about its size, points outside
// itself or loops is an error naming the file, never a panic or a hang.
func TestHwdbBadInput(t *testing.T) {
	_, bin := hwdbtest.Build(t, testHwdb)
	good, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	root := le.Uint64(good[56:])
	edit := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	dir := t.TempDir()
	for name, b := range map[string][]byte{
		"empty":          {},
		"short header":   good[:40],
		"signature":      edit(func(b []byte) []byte { b[0] = 'X'; return b }),
		"truncated":      good[:len(good)-10],
		"size field":     edit(func(b []byte) []byte { le.PutUint64(b[16:], 1); return b }),
		"node size":      edit(func(b []byte) []byte { le.PutUint64(b[32:], 1); return b }),
		"root outside":   edit(func(b []byte) []byte { le.PutUint64(b[56:], uint64(len(b))+8); return b }),
		"prefix outside": edit(func(b []byte) []byte { le.PutUint64(b[root:], uint64(len(b))); return b }),
		// The root's first child becomes a '*' glob whose node is the root again: the glob's
		// subtree is endless.
		"loop": edit(func(b []byte) []byte {
			b[root+24] = '*'
			le.PutUint64(b[root+24+8:], root)
			return b
		}),
		"many values": edit(func(b []byte) []byte { le.PutUint64(b[root+16:], 1<<60); return b }),
	} {
		p := filepath.Join(dir, strings.ReplaceAll(name, " ", "-"))
		os.WriteFile(p, b, 0o644)
		h, err := pciids.OpenHwdb(p)
		if err == nil {
			_, err = h.Properties("pci:v000015B3d00001023*")
			h.Close()
		}
		if err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("%s: %v, want an error naming the file", name, err)
		}
	}
	if _, err := pciids.OpenHwdb(dir); err == nil {
		t.Error("a directory opened as hwdb.bin")
	}
}

// FuzzHwdb: whatever the bytes, opening and looking up returns, without a panic.
func FuzzHwdb(f *testing.F) {
	_, bin := hwdbtest.Build(f, testHwdb)
	good, err := os.ReadFile(bin)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add([]byte("KSLPHHRH"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(dir, "hwdb.bin")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Skip()
		}
		h, err := pciids.OpenHwdb(p)
		if err != nil {
			return
		}
		defer h.Close()
		h.Properties("pci:v000015B3d00001023*")
		h.Properties("pci:v*d*sv*sd*bc02*")
	})
}

// lspciWithHwdb runs lspci -mm over the tree with ids as pci.ids and bin as the hwdb.bin
// libudev opens: in a mount namespace of its own, a tmpfs over /etc/udev (the first
// directory libudev searches that udev creates; /etc/systemd/hwdb, searched before it,
// is covered empty when it exists) holds bin. Nothing changes outside the namespace.
func lspciWithHwdb(t *testing.T, n *pcitest.Node, ids, bin string) map[string][2]string {
	t.Helper()
	if fi, err := os.Stat("/etc/udev"); err != nil || !fi.IsDir() {
		t.Fatalf("no /etc/udev to cover (image/deps.sh installs udev): %v", err)
	}
	script := `set -e
[ -d /etc/systemd/hwdb ] && mount -t tmpfs none /etc/systemd/hwdb
mount -t tmpfs none /etc/udev
cp "$1" /etc/udev/hwdb.bin
shift
exec lspci "$@"`
	out, err := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", bin,
		"-D", "-mm", "-i", ids, "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath()).Output()
	if err != nil {
		t.Fatalf("lspci in a mount namespace with %s: %v", bin, err)
	}
	return parseLspciMM(t, out)
}

// TestNamesEqualLspciWithTestHwdb: on three trees, a pci.ids and a hwdb the test writes
// (the hwdb naming some vendors and devices the pci.ids lacks, one it also lists, by
// exact keys and by globs), passage's names equal those of lspci reading the same two
// files: the lookup order and the glob and priority rules of libpci and libudev, held
// against them on a database whose answers the test chose.
func TestNamesEqualLspciWithTestHwdb(t *testing.T) {
	for name, spec := range referenceTrees() {
		n := pcitest.New(t, spec)
		tree, err := pci.Scan(n.Root)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[pciids.ID]bool{}
		var hw, ids strings.Builder
		ids.WriteString("# test pci.ids\n15b3  Mellanox from pci.ids\n\t1021  CX7 from pci.ids\n\t1023  CX8 from pci.ids\n")
		// What pci.ids names, hwdb names otherwise: libpci never asks hwdb for it.
		hw.WriteString("pci:v000015B3*\n ID_VENDOR_FROM_DATABASE=Mellanox from hwdb, not asked\n\n" +
			"pci:v000015B3d0000102?*\n ID_MODEL_FROM_DATABASE=CX from hwdb, not asked\n\n")
		i := 0
		for _, d := range tree.Devices {
			id := pciids.ID{Vendor: d.VendorID, Device: d.DeviceID}
			if seen[id] {
				continue
			}
			seen[id] = true
			switch i++; i % 3 {
			case 0: // by exact key, vendor and device
				fmt.Fprintf(&hw, "pci:v%08X*\n ID_VENDOR_FROM_DATABASE=vendor %04x from hwdb\n\n", id.Vendor, id.Vendor)
				fmt.Fprintf(&hw, "pci:v%08Xd%08X*\n ID_MODEL_FROM_DATABASE=device %04x from hwdb\n\n", id.Vendor, id.Device, id.Device)
			case 1: // the device by a glob on its last digit
				fmt.Fprintf(&hw, "pci:v%08Xd%07X?*\n ID_MODEL_FROM_DATABASE=%04x by glob\n\n", id.Vendor, id.Device>>4, id.Device&0xfff0)
			}
		}
		_, bin := hwdbtest.Build(t, map[string]string{"etc/udev/hwdb.d/20-test.hwdb": hw.String()})
		idsFile := filepath.Join(t.TempDir(), "pci.ids")
		os.WriteFile(idsFile, []byte(ids.String()), 0o644)
		db, err := pciids.OpenDefaultFor(idsFile, bin, treeIDs(tree))
		if err != nil {
			t.Fatal(err)
		}
		want := lspciWithHwdb(t, n, idsFile, bin)
		if len(want) != len(tree.Devices) {
			t.Fatalf("%s: lspci lists %d functions, the scan %d", name, len(want), len(tree.Devices))
		}
		fromHwdb := 0
		for _, d := range tree.Devices {
			got := ours(db, d)
			if got != want[d.Addr.String()] {
				t.Errorf("%s %s (%s): ours %q, lspci %q", name, d.Addr, d.IDs(), got, want[d.Addr.String()])
			}
			if strings.Contains(got[0]+got[1], "hwdb") || strings.Contains(got[1], "by glob") {
				fromHwdb++
			}
		}
		if fromHwdb == 0 {
			t.Errorf("%s: no name came from the test's hwdb: the comparison shows nothing", name)
		}
	}
}
