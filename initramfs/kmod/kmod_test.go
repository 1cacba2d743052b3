package kmod

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// elfModule builds a minimal ELF64 little-endian relocatable object, the shape of a
// .ko, with one .modinfo section holding the given key=value entries (NUL-separated,
// as modpost writes them) and the .shstrtab that names it.
func elfModule(t testing.TB, entries ...string) []byte {
	t.Helper()
	var modinfo []byte
	for _, e := range entries {
		modinfo = append(modinfo, e...)
		modinfo = append(modinfo, 0)
	}
	return elfWithSection(".modinfo", modinfo)
}

func elfWithSection(name string, data []byte) []byte {
	shstrtab := []byte("\x00" + name + "\x00.shstrtab\x00")
	const ehsize, shentsize = 64, 64
	dataOff := uint64(ehsize)
	strOff := dataOff + uint64(len(data))
	shoff := (strOff + uint64(len(shstrtab)) + 7) &^ 7

	var b bytes.Buffer
	ident := [16]byte{0x7f, 'E', 'L', 'F', 2 /* ELFCLASS64 */, 1 /* ELFDATA2LSB */, 1 /* EV_CURRENT */}
	b.Write(ident[:])
	le := binary.LittleEndian
	w := func(v any) { binary.Write(&b, le, v) }
	w(uint16(1))  // e_type ET_REL
	w(uint16(62)) // e_machine EM_X86_64
	w(uint32(1))  // e_version
	w(uint64(0))  // e_entry
	w(uint64(0))  // e_phoff
	w(shoff)      // e_shoff
	w(uint32(0))  // e_flags
	w(uint16(ehsize))
	w(uint16(0)) // e_phentsize
	w(uint16(0)) // e_phnum
	w(uint16(shentsize))
	w(uint16(3)) // e_shnum
	w(uint16(2)) // e_shstrndx
	b.Write(data)
	b.Write(shstrtab)
	for uint64(b.Len()) < shoff {
		b.WriteByte(0)
	}
	sh := func(nameOff, typ uint32, off, size uint64) {
		w(nameOff)
		w(typ)
		w(uint64(0)) // sh_flags
		w(uint64(0)) // sh_addr
		w(off)
		w(size)
		w(uint32(0)) // sh_link
		w(uint32(0)) // sh_info
		w(uint64(1)) // sh_addralign
		w(uint64(0)) // sh_entsize
	}
	sh(0, 0, 0, 0)                                            // SHN_UNDEF
	sh(1, 1, dataOff, uint64(len(data)))                      // SHT_PROGBITS
	sh(uint32(2+len(name)), 3, strOff, uint64(len(shstrtab))) // SHT_STRTAB
	return b.Bytes()
}

func compress(t testing.TB, ext string, data []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	switch ext {
	case ".ko.xz":
		w, err := xz.NewWriter(&b)
		if err != nil {
			t.Fatal(err)
		}
		w.Write(data)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
	case ".ko.zst":
		w, err := zstd.NewWriter(&b)
		if err != nil {
			t.Fatal(err)
		}
		w.Write(data)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
	case ".ko.gz":
		w := gzip.NewWriter(&b)
		w.Write(data)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
	default:
		return data
	}
	return b.Bytes()
}

type fakeMod struct {
	path    string // below lib/modules/<release>, with extension
	name    string // name= ("" leaves it out)
	depends string
}

// The dependency closure QEMU.md records for Debian's 6.1 kernel, with the .deb's
// file names, some compressed to cover the other encodings.
var debianLike = []fakeMod{
	{"kernel/drivers/vfio/vfio.ko", "vfio", ""},
	{"kernel/drivers/vfio/vfio_iommu_type1.ko", "vfio_iommu_type1", "vfio"},
	{"kernel/drivers/vfio/vfio_virqfd.ko.xz", "vfio_virqfd", ""},
	{"kernel/virt/lib/irqbypass.ko.zst", "irqbypass", ""},
	{"kernel/drivers/vfio/pci/vfio-pci-core.ko", "vfio_pci_core", "vfio,irqbypass,vfio_virqfd"},
	{"kernel/drivers/vfio/pci/vfio-pci.ko", "vfio_pci", "vfio-pci-core,vfio"},
	{"kernel/lib/crc-t10dif.ko.gz", "crc_t10dif", "crct10dif_common"},
	{"kernel/crypto/crct10dif_common.ko", "", ""},
	{"kernel/drivers/nvme/host/nvme-core.ko", "nvme_core", "t10-pi"},
	{"kernel/block/t10-pi.ko", "t10_pi", "crc-t10dif,crc64-rocksoft"},
	{"kernel/lib/crc64-rocksoft.ko", "crc64_rocksoft", "crc64"},
	{"kernel/lib/crc64.ko", "crc64", ""},
	{"kernel/drivers/nvme/host/nvme.ko", "nvme", "nvme-core"},
	{"kernel/drivers/net/ethernet/intel/e1000e/e1000e.ko", "e1000e", ""},
}

func writeTree(t testing.TB, mods []fakeMod, builtin ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "lib", "modules", "6.1.0-57-amd64")
	for _, m := range mods {
		var ents []string
		if m.name != "" {
			ents = append(ents, "name="+m.name)
		}
		ents = append(ents, "license=GPL", "alias=pci:v*d*", "alias=second", "depends="+m.depends, "vermagic=6.1.0-57-amd64 SMP mod_unload modversions")
		p := filepath.Join(dir, m.path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, compress(t, moduleExt(filepath.Base(p)), elfModule(t, ents...)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if len(builtin) > 0 {
		var b strings.Builder
		for _, n := range builtin {
			b.WriteString("kernel/" + n + ".ko\n")
		}
		if err := os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestParseModinfo(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      string
		want    Modinfo
		depends []string
		wantErr bool
	}{
		{"typical", "name=vfio_pci\x00depends=vfio-pci-core,vfio\x00alias=a\x00alias=b\x00", Modinfo{"name": {"vfio_pci"}, "depends": {"vfio-pci-core,vfio"}, "alias": {"a", "b"}}, []string{"vfio_pci_core", "vfio"}, false},
		{"empty depends", "depends=\x00name=x", Modinfo{"depends": {""}, "name": {"x"}}, nil, false},
		{"padding and junk skipped", "\x00\x00junk\x00=novalue\x00k=v=w\x00\x00", Modinfo{"k": {"v=w"}}, nil, false},
		{"empty", "", nil, nil, true},
		{"only NULs", "\x00\x00\x00", nil, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mi, err := ParseModinfo([]byte(tc.in))
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if tc.wantErr {
				return
			}
			if !reflect.DeepEqual(mi, tc.want) {
				t.Errorf("got %q, want %q", mi, tc.want)
			}
			if got := mi.Depends(); !reflect.DeepEqual(got, tc.depends) {
				t.Errorf("Depends() = %q, want %q", got, tc.depends)
			}
		})
	}
}

func TestReadModinfoEveryEncoding(t *testing.T) {
	raw := elfModule(t, "name=virtio-net", "depends=net_failover,virtio")
	dir := t.TempDir()
	for _, ext := range []string{".ko", ".ko.xz", ".ko.zst", ".ko.gz"} {
		p := filepath.Join(dir, "virtio_net"+ext)
		if err := os.WriteFile(p, compress(t, ext, raw), 0o644); err != nil {
			t.Fatal(err)
		}
		mi, err := ReadModinfo(p)
		if err != nil {
			t.Fatalf("%s: %v", ext, err)
		}
		if mi.First("name") != "virtio-net" || !reflect.DeepEqual(mi.Depends(), []string{"net_failover", "virtio"}) {
			t.Errorf("%s: got %q", ext, mi)
		}
	}
}

func TestReadModinfoErrorsNameTheFile(t *testing.T) {
	dir := t.TempDir()
	cases := map[string][]byte{
		"notelf.ko":     []byte("this is not an ELF file at all, just text"),
		"nomodinfo.ko":  elfWithSection(".text", []byte{0x90, 0xc3}),
		"emptyinfo.ko":  elfWithSection(".modinfo", []byte{0, 0}),
		"badxz.ko.xz":   []byte("not xz"),
		"badzst.ko.zst": []byte("not zstd"),
		"truncated.ko":  elfModule(t, "name=x")[:40],
	}
	for name, data := range cases {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := ReadModinfo(p)
		if err == nil {
			t.Errorf("%s: no error", name)
			continue
		}
		if !strings.Contains(err.Error(), p) {
			t.Errorf("%s: error %q does not name the file", name, err)
		}
	}
	if _, err := ReadModinfo(filepath.Join(dir, "missing.ko")); err == nil {
		t.Error("missing file: no error")
	}
}

func TestOpenIndexesEveryModule(t *testing.T) {
	dir := writeTree(t, debianLike)
	// Files that are not modules stay out of the index.
	os.WriteFile(filepath.Join(dir, "modules.order"), []byte("kernel/drivers/vfio/vfio.ko\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "kernel", "README.ko.txt"), []byte("x"), 0o644)
	ix, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(ix.Names()); got != len(debianLike) {
		t.Fatalf("indexed %d modules %q, want %d", got, ix.Names(), len(debianLike))
	}
	m := ix.Module("vfio-pci")
	if m == nil || m.Name != "vfio_pci" || filepath.Base(m.Path) != "vfio-pci.ko" || !filepath.IsAbs(m.Path) {
		t.Fatalf("Module(vfio-pci) = %+v", m)
	}
	if !reflect.DeepEqual(m.Depends, []string{"vfio_pci_core", "vfio"}) {
		t.Errorf("vfio_pci depends %q", m.Depends)
	}
	// No name= in .modinfo: the file name names it.
	if ix.Module("crct10dif_common") == nil {
		t.Error("crct10dif_common (no name=) not indexed by its file name")
	}
}

func TestOpenErrors(t *testing.T) {
	if _, err := Open(filepath.Join(t.TempDir(), "nope")); err == nil {
		t.Error("missing dir: no error")
	}
	dir := writeTree(t, debianLike[:2])
	bad := filepath.Join(dir, "kernel", "broken.ko")
	os.WriteFile(bad, []byte("garbage"), 0o644)
	ix, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	// A module file is read when an order needs it, and then an unreadable one is an
	// error naming it.
	if _, err := ix.Order("broken"); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("broken module: err = %v, want it to name %s", err, bad)
	}
	misnamed := writeTree(t, []fakeMod{{"kernel/a/x.ko", "y", ""}})
	if ix, err := Open(misnamed); err != nil {
		t.Fatal(err)
	} else if _, err := ix.Order("x"); err == nil || !strings.Contains(err.Error(), "names it y") {
		t.Errorf("module whose .modinfo names another: err = %v", err)
	}
	dup := writeTree(t, []fakeMod{{"kernel/a/x.ko", "x", ""}, {"kernel/b/x.ko.xz", "x", ""}})
	if _, err := Open(dup); err == nil || !strings.Contains(err.Error(), "also in") {
		t.Errorf("duplicate module: err = %v", err)
	}
}

func TestOrder(t *testing.T) {
	dir := writeTree(t, append(debianLike,
		fakeMod{"kernel/x/cyc-a.ko", "cyc_a", "cyc_b"},
		fakeMod{"kernel/x/cyc-b.ko", "cyc_b", "cyc_a"},
		fakeMod{"kernel/x/needs-missing.ko", "needs_missing", "nothere"},
		fakeMod{"kernel/x/needs-builtin.ko", "needs_builtin", "crc32c_generic"},
	), "crypto/crc32c_generic")
	ix, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		in      []string
		want    []string
		wantErr string
	}{
		{"vfio stack", []string{"vfio", "vfio_iommu_type1", "vfio-pci"},
			[]string{"vfio", "vfio_iommu_type1", "irqbypass", "vfio_virqfd", "vfio_pci_core", "vfio_pci"}, ""},
		{"request order kept, each once", []string{"e1000e", "vfio_pci", "vfio", "nvme", "e1000e"},
			[]string{"e1000e", "vfio", "irqbypass", "vfio_virqfd", "vfio_pci_core", "vfio_pci",
				"crct10dif_common", "crc_t10dif", "crc64", "crc64_rocksoft", "t10_pi", "nvme_core", "nvme"}, ""},
		{"either spelling", []string{"vfio-iommu-type1"}, []string{"vfio", "vfio_iommu_type1"}, ""},
		{"builtin", []string{"needs-builtin", "crc32c-generic"}, []string{"crc32c_generic", "needs_builtin"}, ""},
		{"nothing", nil, nil, ""},
		{"unknown", []string{"nosuch"}, nil, "kmod nosuch: no such module"},
		{"missing dependency", []string{"needs_missing"}, nil, "kmod nothere: needed by needs_missing"},
		{"cycle", []string{"cyc-a"}, nil, "dependency cycle cyc_a -> cyc_b -> cyc_a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ix.Order(tc.in...)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %q\nwant %q", got, tc.want)
			}
			// Every module comes after all its dependencies.
			pos := map[string]int{}
			for i, n := range got {
				pos[n] = i
			}
			for _, n := range got {
				if m := ix.Module(n); m != nil {
					for _, d := range m.Depends {
						if pos[d] >= pos[n] {
							t.Errorf("%s before its dependency %s", n, d)
						}
					}
				}
			}
		})
	}
}

func TestLoad(t *testing.T) {
	dir := writeTree(t, debianLike, "crypto/crc32c_generic")
	ix, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	var loaded []string
	ix.load = func(m *Module) error {
		loaded = append(loaded, m.Name)
		switch m.Name {
		case "vfio":
			return syscall.EEXIST // built into this kernel or loaded earlier
		case "crc64":
			return syscall.ENOEXEC
		}
		return nil
	}
	res, err := ix.Load("vfio-pci", "nvme", "e1000e", "crc32c_generic")
	if err == nil {
		t.Fatal("no error although crc64 failed")
	}
	if !errors.Is(err, syscall.ENOEXEC) || !strings.Contains(err.Error(), "kmod crc64") {
		t.Errorf("err = %v", err)
	}
	wantLoaded := []string{"vfio", "irqbypass", "vfio_virqfd", "vfio_pci_core", "vfio_pci",
		"crct10dif_common", "crc_t10dif", "crc64", "e1000e"}
	if !reflect.DeepEqual(loaded, wantLoaded) {
		t.Errorf("loaded %q\nwant   %q", loaded, wantLoaded)
	}
	byName := map[string]Result{}
	for _, r := range res {
		byName[r.Name] = r
	}
	if len(res) != 14 {
		t.Errorf("%d results, want 14", len(res))
	}
	if r := byName["vfio"]; !r.AlreadyLoaded || r.Err != nil || r.Path == "" {
		t.Errorf("vfio: %+v, want already loaded", r)
	}
	if r := byName["vfio_pci"]; r.AlreadyLoaded || r.Err != nil || filepath.Base(r.Path) != "vfio-pci.ko" {
		t.Errorf("vfio_pci: %+v", r)
	}
	if r := byName["crc32c_generic"]; !r.AlreadyLoaded || r.Path != "" || r.Err != nil {
		t.Errorf("builtin crc32c_generic: %+v", r)
	}
	// A failure fails its dependents without a try, and names the failed dependency.
	for _, n := range []string{"crc64_rocksoft", "t10_pi", "nvme_core", "nvme"} {
		if r := byName[n]; r.Err == nil || !strings.Contains(r.Err.Error(), "failed to load") {
			t.Errorf("%s: %+v, want failed dependency", n, r)
		}
	}
	if r := byName["e1000e"]; r.Err != nil {
		t.Errorf("e1000e: %v (independent of the failure)", r.Err)
	}
	if _, err := ix.Load("nosuch"); err == nil {
		t.Error("Load(nosuch): no error")
	}
}

func FuzzParseModinfo(f *testing.F) {
	f.Add([]byte("name=vfio_pci\x00depends=vfio-pci-core,vfio\x00"))
	f.Add([]byte("\x00=\x00a=\x00,,,\x00depends=,a,,b"))
	f.Fuzz(func(t *testing.T, data []byte) {
		mi, err := ParseModinfo(data)
		if err != nil {
			return
		}
		for _, d := range mi.Depends() {
			if d == "" || strings.Contains(d, "-") || strings.Contains(d, ",") {
				t.Fatalf("bad dependency name %q from %q", d, data)
			}
		}
	})
}

func FuzzModinfoFromELF(f *testing.F) {
	f.Add(elfModule(f, "name=x", "depends=y"))
	f.Add(elfWithSection(".modinfo", nil))
	f.Fuzz(func(t *testing.T, data []byte) {
		mi, err := modinfoFromELF("fuzz.ko", bytes.NewReader(data))
		if err == nil && len(mi) == 0 {
			t.Fatal("no error and no entries")
		}
	})
}

// BenchmarkOpenOrder is the boot-time cost of indexing a module tree the size of the
// image's (30 modules) and ordering the vfio stack.
func BenchmarkOpenOrder(b *testing.B) {
	var mods []fakeMod
	for i := 0; i < 2; i++ {
		for _, m := range debianLike {
			m.path = strings.Replace(m.path, "kernel/", fmt.Sprintf("kernel/copy%d/", i), 1)
			if i > 0 {
				if m.name != "" {
					m.name = fmt.Sprintf("%s_copy%d", m.name, i)
				}
				m.path = strings.Replace(m.path, ".ko", fmt.Sprintf("_copy%d.ko", i), 1)
				m.depends = ""
			}
			mods = append(mods, m)
		}
	}
	dir := writeTree(b, mods)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ix, err := Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ix.Order("vfio", "vfio_iommu_type1", "vfio-pci"); err != nil {
			b.Fatal(err)
		}
	}
}

// The modules.dep modsel writes is what the boot reads: the same order as from every
// module's .modinfo, without opening a module file.
func TestModulesDep(t *testing.T) {
	dir := writeTree(t, debianLike, "crypto/crc32c_generic")
	ix, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	want, err := ix.Order("vfio", "vfio_iommu_type1", "vfio-pci", "nvme", "e1000e")
	if err != nil {
		t.Fatal(err)
	}
	var dep bytes.Buffer
	rel := func(m *Module) (string, error) {
		r, err := filepath.Rel(ix.Dir(), m.Path)
		return filepath.ToSlash(r), err
	}
	if err := ix.WriteDep(&dep, want, rel); err != nil {
		t.Fatal(err)
	}
	// depmod's shape: every dependency, the last to load first.
	if !strings.Contains(dep.String(), "kernel/drivers/vfio/pci/vfio-pci.ko: kernel/drivers/vfio/pci/vfio-pci-core.ko ") ||
		!strings.HasPrefix(dep.String(), "kernel/drivers/vfio/vfio.ko:\n") {
		t.Errorf("modules.dep:\n%s", dep.String())
	}
	os.WriteFile(filepath.Join(dir, DepFile), dep.Bytes(), 0o644)
	// Every module file becomes unreadable: only modules.dep can answer.
	for _, m := range debianLike {
		os.WriteFile(filepath.Join(dir, filepath.FromSlash(m.path)), []byte("not read"), 0o644)
	}
	fromDep, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	got, err := fromDep.Order("vfio", "vfio_iommu_type1", "vfio-pci", "nvme", "e1000e")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("order from modules.dep %q\nfrom .modinfo %q", got, want)
	}
	if m := fromDep.Module("vfio_pci"); m == nil || m.Path != filepath.Join(dir, "kernel/drivers/vfio/pci/vfio-pci.ko") {
		t.Errorf("vfio_pci from modules.dep: %+v", m)
	}
	if !fromDep.Builtin("crc32c_generic") {
		t.Error("modules.builtin not read beside modules.dep")
	}

	for _, tc := range []struct{ name, dep, want string }{
		{"no colon", "kernel/a.ko kernel/b.ko\n", "no ':'"},
		{"outside the directory", "kernel/a.ko: ../../etc/x.ko\n", "not a module path"},
		{"absolute", "/lib/a.ko:\n", "not a module path"},
		{"not a module", "kernel/a.txt:\n", "not a module path"},
		{"twice", "kernel/a.ko:\nkernel/b/a.ko.xz:\n", "also at"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := t.TempDir()
			os.WriteFile(filepath.Join(d, DepFile), []byte(tc.dep), 0o644)
			if _, err := Open(d); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), DepFile) {
				t.Errorf("err = %v, want %q naming %s", err, tc.want, DepFile)
			}
		})
	}
}
