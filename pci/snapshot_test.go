package pci_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// flat is a function without its tree pointers, which DeepEqual would chase.
type flat struct {
	pci.Device
	parent   string
	children []string
}

func flatten(t *pci.Tree) []flat {
	out := make([]flat, 0, len(t.Devices))
	for _, d := range t.Devices {
		f := flat{Device: *d}
		f.Parent, f.Children = nil, nil
		if d.Parent != nil {
			f.parent = d.Parent.Addr.String()
		}
		for _, c := range d.Children {
			f.children = append(f.children, c.Addr.String())
		}
		out = append(out, f)
	}
	return out
}

// sameTree fails unless a and b hold the same functions with the same fields and links.
func sameTree(t *testing.T, a, b *pci.Tree) {
	t.Helper()
	fa, fb := flatten(a), flatten(b)
	if len(fa) != len(fb) {
		t.Fatalf("%d functions vs %d", len(fa), len(fb))
	}
	for i := range fa {
		if !reflect.DeepEqual(fa[i], fb[i]) {
			t.Errorf("%s differs:\n%+v\n%+v", fa[i].Addr, fa[i], fb[i])
		}
	}
	if !reflect.DeepEqual(a.Problems, b.Problems) {
		t.Errorf("tree problems %q vs %q", a.Problems, b.Problems)
	}
}

func tarEntries(t *testing.T, b []byte) map[string]*tar.Header {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	out := map[string]*tar.Header{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out[strings.TrimSuffix(h.Name, "/")] = h
	}
}

func TestSnapshotRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec pcitest.Spec
		mess func(t *testing.T, n *pcitest.Node)
	}{
		{"B300", pcitest.B300(), nil},
		{"SR-IOV", pcitest.SRIOVNode(1, 6, 3), nil},
		{"broken", small(), func(t *testing.T, n *pcitest.Node) {
			// Config gone (ID files read instead), a bad VPD, and a vanished function.
			os.Remove(filepath.Join(devDir(t, n, "rp"), "config"))
			os.WriteFile(filepath.Join(devDir(t, n, "nic"), "vpd"), []byte{0x82, 9, 9}, 0o600)
			os.Symlink("../../../devices/pci0000:00/0000:00:07.0", filepath.Join(n.Root, pci.DevicesDir, "0000:00:07.0"))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, tc.spec)
			if tc.mess != nil {
				tc.mess(t, n)
			}
			live := scan(t, n.Root)
			var buf bytes.Buffer
			written, err := pci.WriteSnapshot(&buf, n.Root)
			if err != nil {
				t.Fatal(err)
			}
			sameTree(t, live, written)
			back, err := pci.ScanSnapshot(bytes.NewReader(buf.Bytes()))
			if err != nil {
				t.Fatal(err)
			}
			if back.Root != "" {
				t.Errorf("snapshot tree root %q", back.Root)
			}
			sameTree(t, live, back)
			if tc.name == "B300" {
				g := back.Lookup(n.Addr("gpu0"))
				if g == nil {
					t.Fatal("gpu0 missing from the snapshot")
				}
				if len(g.BARs) != 3 || g.BARs[1].Size != 512<<30 {
					t.Errorf("gpu0's BARs through the snapshot: %+v, want BAR1 of 512 GiB among 3", g.BARs)
				}
			}

			// Exactly what Scan reads: no irq or link-speed files; resource, for the
			// BAR sizes, is read.
			ents := tarEntries(t, buf.Bytes())
			var names []string
			for name, h := range ents {
				base := filepath.Base(name)
				switch base {
				case "irq", "enable", "current_link_speed", "max_link_width", "sriov_numvfs":
					t.Errorf("snapshot holds %s, which Scan does not read", name)
				}
				if h.Typeflag == tar.TypeReg {
					names = append(names, base)
				}
			}
			sort.Strings(names)
			if !strings.Contains(strings.Join(names, " "), "config") {
				t.Errorf("no config files in %v", names)
			}
			for _, d := range live.Devices {
				l := ents[pci.DevicesDir+"/"+d.Addr.String()]
				if l == nil || l.Typeflag != tar.TypeSymlink {
					t.Fatalf("%s: bus link missing or not a symlink: %+v", d.Addr, l)
				}
			}
			// Deterministic: the same tree gives the same bytes.
			var again bytes.Buffer
			if _, err := pci.WriteSnapshot(&again, n.Root); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf.Bytes(), again.Bytes()) {
				t.Error("two snapshots of one tree differ")
			}
		})
	}
}

func TestSnapshotCapturesFallbacks(t *testing.T) {
	n := pcitest.New(t, small())
	os.Remove(filepath.Join(devDir(t, n, "rp"), "config"))
	var buf bytes.Buffer
	if _, err := pci.WriteSnapshot(&buf, n.Root); err != nil {
		t.Fatal(err)
	}
	ents := tarEntries(t, buf.Bytes())
	rp := strings.TrimPrefix(lookup(t, scan(t, n.Root), n, "rp").SysPath, "/")
	for _, f := range []string{"vendor", "device", "class", "numa_node", "driver", "iommu_group"} {
		if ents[rp+"/"+f] == nil {
			t.Errorf("snapshot lacks %s/%s, read when config is missing", rp, f)
		}
	}
	nic := strings.TrimPrefix(lookup(t, scan(t, n.Root), n, "nic").SysPath, "/")
	if ents[nic+"/vpd"] == nil || ents[nic+"/vendor"] != nil {
		t.Errorf("nic: vpd %v, vendor %v; want vpd only", ents[nic+"/vpd"] != nil, ents[nic+"/vendor"] != nil)
	}
}

func makeTar(t *testing.T, hdrs ...*tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for _, h := range hdrs {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write(make([]byte, h.Size))
		}
	}
	tw.Close()
	zw.Close()
	return buf.Bytes()
}

func TestExtractSnapshotRejects(t *testing.T) {
	reg := func(name string, size int64) *tar.Header {
		return &tar.Header{Name: name, Typeflag: tar.TypeReg, Size: size, Mode: 0o644}
	}
	link := func(name, target string) *tar.Header {
		return &tar.Header{Name: name, Typeflag: tar.TypeSymlink, Linkname: target}
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"not gzip", []byte("plain text"), "snapshot: gzip: invalid header"},
		{"dot-dot path", makeTar(t, reg("../evil", 1)), `snapshot entry "../evil": path leaves the snapshot`},
		{"absolute path", makeTar(t, reg("/etc/evil", 1)), `snapshot entry "/etc/evil": path leaves the snapshot`},
		{"absolute link", makeTar(t, link("sys/x", "/etc")), `snapshot entry "sys/x": link target "/etc" leaves the snapshot`},
		{"link out", makeTar(t, link("sys/x", "../../etc")), `snapshot entry "sys/x": link target "../../etc" leaves the snapshot`},
		{"below a link", makeTar(t, link("sys/x", "y"), reg("sys/x/config", 4)), `snapshot entry "sys/x/config": below symlink sys/x`},
		{"hard link", makeTar(t, &tar.Header{Name: "sys/h", Typeflag: tar.TypeLink, Linkname: "sys/a"}), `snapshot entry "sys/h": type '1' not allowed`},
		{"device node", makeTar(t, &tar.Header{Name: "sys/dev", Typeflag: tar.TypeChar}), `type '3' not allowed`},
		{"huge file", makeTar(t, reg("sys/big", 2<<20)), `snapshot entry "sys/big": 2097152 bytes, more than 1048576`},
		{"duplicate", makeTar(t, reg("sys/a", 1), reg("sys/a", 1)), `snapshot entry "sys/a": file exists`},
		{"file over link", makeTar(t, link("sys/a", "b"), reg("sys/a", 1)), `snapshot entry "sys/a": file exists`},
		{"truncated", makeTar(t, reg("sys/a", 1))[:30], "snapshot: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			err := pci.ExtractSnapshot(bytes.NewReader(tc.data), dir)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want %q", err, tc.want)
			}
		})
	}
	// A snapshot without the devices directory scans to a clear error.
	_, err := pci.ScanSnapshot(bytes.NewReader(makeTar(t, reg("sys/a", 1))))
	if err == nil || !strings.Contains(err.Error(), "sys/bus/pci/devices") {
		t.Errorf("err %v", err)
	}
}

// TestSnapshotLive snapshots this machine's /sys (reading only) and checks that the
// snapshot scans to the same tree as /sys itself.
func TestSnapshotLive(t *testing.T) {
	live := scan(t, "/")
	var buf bytes.Buffer
	written, err := pci.WriteSnapshot(&buf, "/")
	if err != nil {
		t.Fatal(err)
	}
	sameTree(t, live, written)
	size := buf.Len()
	back, err := pci.ScanSnapshot(&buf)
	if err != nil {
		t.Fatal(err)
	}
	sameTree(t, live, back)
	t.Logf("%d functions, %d bytes", len(back.Devices), size)
}
