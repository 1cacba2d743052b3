package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// cpioFile is one regular file of a newc archive.
type cpioFile struct {
	name string
	data []byte
}

// readNewc reads the regular files of one or more concatenated newc ("070701") archives.
func readNewc(b []byte) ([]cpioFile, error) {
	var files []cpioFile
	off := 0
	for off < len(b) {
		if b[off] == 0 { // padding between concatenated archives
			off++
			continue
		}
		if off+110 > len(b) || string(b[off:off+6]) != "070701" {
			return nil, fmt.Errorf("cpio: bad header at offset %d", off)
		}
		field := func(i int) (int, error) {
			v, err := strconv.ParseUint(string(b[off+6+8*i:off+14+8*i]), 16, 32)
			return int(v), err
		}
		mode, err1 := field(1)
		size, err2 := field(6)
		nameSize, err3 := field(11)
		if err := errors.Join(err1, err2, err3); err != nil {
			return nil, fmt.Errorf("cpio: header at offset %d: %w", off, err)
		}
		nameEnd := off + 110 + nameSize
		dataOff := (nameEnd + 3) &^ 3
		if nameSize < 1 || dataOff+size > len(b) {
			return nil, fmt.Errorf("cpio: entry at offset %d runs past the archive", off)
		}
		name := string(b[off+110 : nameEnd-1])
		if mode&0o170000 == 0o100000 {
			files = append(files, cpioFile{name: name, data: b[dataOff : dataOff+size]})
		}
		off = (dataOff + size + 3) &^ 3
	}
	return files, nil
}

func gzSize(data []byte) int64 {
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	zw.Write(data)
	zw.Close()
	return int64(buf.Len())
}

// passageSymbols sums the sizes of the symbols of passage's own packages in a Go binary.
func passageSymbols(bin string) (int64, error) {
	out, err := exec.Command("go", "tool", "nm", "-size", bin).Output()
	if err != nil {
		return 0, fmt.Errorf("go tool nm %s: %w", bin, err)
	}
	var n int64
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// addr size type name...
		if len(f) < 4 || !strings.HasPrefix(f[3], "github.com/passage-boot/passage/") {
			continue
		}
		if sz, err := strconv.ParseInt(f[1], 10, 64); err == nil {
			n += sz
		}
	}
	return n, sc.Err()
}

func rowImage(e *env, t *table, w io.Writer) error {
	// The standalone binary as an image would carry it alone: static, stripped.
	stripped := filepath.Join(e.scratch, "passage-stripped")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", stripped, "./cmd/passage")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build passage: %w: %s", err, firstLine(string(out)))
	}
	sb, err := os.ReadFile(stripped)
	if err != nil {
		return err
	}
	fi, err := os.Stat(e.passage)
	if err != nil {
		return err
	}
	t.add(row{id: "6a", what: "image: `passage` binary", input: "cmd/passage",
		passage: fmt.Sprintf("%s (%s gzip -9)", mib(int64(len(sb))), mib(gzSize(sb))),
		note:    fmt.Sprintf("static, -trimpath -s -w; %s as `go build` makes it", mib(fi.Size()))})

	gzPath := filepath.Join(e.build, "initramfs.cpio.gz")
	gz, err := os.ReadFile(gzPath)
	if err != nil {
		return fmt.Errorf("%s: %w (make initramfs builds it)", gzPath, err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	if err != nil {
		return fmt.Errorf("%s: %w", gzPath, err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		return fmt.Errorf("%s: %w", gzPath, err)
	}
	files, err := readNewc(raw)
	if err != nil {
		return fmt.Errorf("%s: %w", gzPath, err)
	}
	var bb []byte
	var modules, modulesGz, other int64
	for _, f := range files {
		switch {
		case f.name == "bbin/bb":
			bb = f.data
		case strings.HasPrefix(f.name, "lib/modules/"):
			modules += int64(len(f.data))
			modulesGz += gzSize(f.data)
		default:
			other += int64(len(f.data))
		}
	}
	if bb == nil {
		return fmt.Errorf("%s: no bbin/bb (u-root busybox) in the archive", gzPath)
	}
	bbGz := gzSize(bb)
	// u-root strips the busybox, so passage's own code is measured in the unstripped
	// binary the process rows run: the same packages, linked the same way.
	own, err := passageSymbols(e.passage)
	if err != nil {
		return err
	}
	total := int64(len(gz))
	t.add(row{id: "6b", what: "image: initramfs.cpio.gz", input: gzPath,
		passage: fmt.Sprintf("%s compressed (%s raw)", mib(total), mib(int64(len(raw)))),
		note:    fmt.Sprintf("u-root busybox (passage + core commands) %s gz = %.0f%%; modules %s gz = %.0f%%", mib(bbGz), 100*float64(bbGz)/float64(total), mib(modulesGz), 100*float64(modulesGz)/float64(total))})
	t.add(row{id: "6c", what: "image: passage's own code", input: "symbols of github.com/passage-boot/passage/...",
		passage: fmt.Sprintf("%s = %.0f%% of the %s busybox", mib(own), 100*float64(own)/float64(len(bb)), mib(int64(len(bb)))),
		note: fmt.Sprintf("go tool nm -size on the unstripped binary (u-root strips bb); passage with all its dependencies is at most the %s stripped binary = %.0f%% of bb",
			mib(int64(len(sb))), 100*float64(len(sb))/float64(len(bb)))})
	t.target(total < 16<<20, "initramfs under 16 MiB compressed: %s", mib(total))
	fmt.Fprintf(w, "## Image (row 6)\n\n%s: %d regular files; busybox %s (%s gzip -9 alone), modules %s (%s), other files %s. "+
		"Standalone stripped passage: %s (%s gzip -9).\n\n",
		gzPath, len(files), mib(int64(len(bb))), mib(bbGz), mib(modules), mib(modulesGz), mib(other), mib(int64(len(sb))), mib(gzSize(sb)))
	return nil
}
