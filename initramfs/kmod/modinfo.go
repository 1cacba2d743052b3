package kmod

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// maxModuleSize bounds decompression: the largest module in a distribution kernel is a
// few tens of MiB (amdgpu, with debug info stripped); anything past this is not a module.
const maxModuleSize = 256 << 20

// Modinfo is a module's .modinfo section: the NUL-separated key=value strings that
// modpost and MODULE_*() macros emit (include/linux/moduleparam.h, __MODULE_INFO).
// A key may repeat (alias=, parm=), so each maps to every value in file order.
type Modinfo map[string][]string

// First is the first value of key, or "".
func (mi Modinfo) First(key string) string {
	if v := mi[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// ParseModinfo splits a .modinfo section. Entries without '=' are skipped, as the
// kernel's own get_next_modinfo does; an empty section is an error because modpost
// always writes at least name= (and vermagic=) into a module.
func ParseModinfo(data []byte) (Modinfo, error) {
	mi := Modinfo{}
	for _, ent := range bytes.Split(data, []byte{0}) {
		k, v, ok := bytes.Cut(ent, []byte{'='})
		if !ok || len(k) == 0 {
			continue
		}
		mi[string(k)] = append(mi[string(k)], string(v))
	}
	if len(mi) == 0 {
		return nil, fmt.Errorf("no key=value entries in %d bytes", len(data))
	}
	return mi, nil
}

// Depends is the depends= list in canonical spelling (modpost writes "a,b" or "").
func (mi Modinfo) Depends() []string {
	var out []string
	for _, v := range mi["depends"] {
		for _, d := range strings.Split(v, ",") {
			if d = strings.TrimSpace(d); d != "" {
				out = append(out, Canonical(d))
			}
		}
	}
	return out
}

// ReadModinfo reads the .modinfo section of a module file, decompressing .ko.xz,
// .ko.zst and .ko.gz in memory first.
func ReadModinfo(path string) (Modinfo, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("kmod %s: %w", path, err)
	}
	defer f.Close()
	var ra io.ReaderAt = f
	if moduleExt(filepath.Base(path)) != ".ko" {
		b, err := decompress(path, f)
		if err != nil {
			return nil, err
		}
		ra = bytes.NewReader(b)
	}
	return modinfoFromELF(path, ra)
}

// modinfoFromELF reads the .modinfo section of the ELF image in ra; path names it in errors.
func modinfoFromELF(path string, ra io.ReaderAt) (Modinfo, error) {
	ef, err := elf.NewFile(ra)
	if err != nil {
		return nil, fmt.Errorf("kmod %s: not an ELF module: %w", path, err)
	}
	sec := ef.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("kmod %s: no .modinfo section", path)
	}
	if sec.Type == elf.SHT_NOBITS {
		return nil, fmt.Errorf("kmod %s: .modinfo section has no contents", path)
	}
	if sec.Size > maxModuleSize {
		return nil, fmt.Errorf("kmod %s: .modinfo section of %d bytes", path, sec.Size)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("kmod %s: read .modinfo: %w", path, err)
	}
	mi, err := ParseModinfo(data)
	if err != nil {
		return nil, fmt.Errorf("kmod %s: .modinfo: %w", path, err)
	}
	return mi, nil
}

// ReadModule returns the module file at path as the kernel loads it: decompressed when
// it is a .ko.xz, .ko.zst or .ko.gz. A signed module keeps its signature: kbuild signs
// the ELF image before compressing it.
func ReadModule(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("kmod %s: %w", path, err)
	}
	defer f.Close()
	return decompress(path, f)
}

// Uncompressed is a module file name with its compression ending replaced by .ko.
func Uncompressed(name string) string {
	if e := moduleExt(name); e != "" {
		return strings.TrimSuffix(name, e) + ".ko"
	}
	return name
}

// decompress returns the whole decompressed module named path read from r.
func decompress(path string, r io.Reader) ([]byte, error) {
	var dr io.Reader
	switch moduleExt(filepath.Base(path)) {
	case ".ko.xz":
		x, err := xz.NewReader(r)
		if err != nil {
			return nil, fmt.Errorf("kmod %s: xz: %w", path, err)
		}
		dr = x
	case ".ko.zst":
		z, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, fmt.Errorf("kmod %s: zstd: %w", path, err)
		}
		defer z.Close()
		dr = z
	case ".ko.gz":
		g, err := gzip.NewReader(r)
		if err != nil {
			return nil, fmt.Errorf("kmod %s: gzip: %w", path, err)
		}
		dr = g
	default:
		return io.ReadAll(r)
	}
	b, err := io.ReadAll(io.LimitReader(dr, maxModuleSize+1))
	if err != nil {
		return nil, fmt.Errorf("kmod %s: decompress: %w", path, err)
	}
	if len(b) > maxModuleSize {
		return nil, fmt.Errorf("kmod %s: decompresses to more than %d bytes", path, maxModuleSize)
	}
	return b, nil
}
