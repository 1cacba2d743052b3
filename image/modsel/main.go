// Command modsel copies kernel modules and their dependency closure, as .modinfo's
// depends= gives it (initramfs/kmod), from an unpacked kernel package into an
// initramfs staging tree, keeping the package's lib/modules/<release>/kernel/... paths:
// u-root's init auto-loads only *.ko placed flat in /lib/modules/, and passage boot
// must decide what loads and when.
//
// It does at build time what would cost the boot seconds: compressed modules (.ko.xz on
// Debian 13) are written decompressed, and a modules.dep for the selected modules lets
// the boot order them without reading a single module file. The signature kbuild
// appended before compressing stays, so a locked-down kernel still loads them.
//
//	modsel -kernel build/linux-6.12/kernel -out STAGE vfio vfio-pci nvme ...
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/passage-boot/passage/initramfs/kmod"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("modsel", flag.ContinueOnError)
	fs.SetOutput(stderr)
	kernel := fs.String("kernel", "", "unpacked kernel package (holds release and lib/modules/<release>)")
	out := fs.String("out", "", "staging root; modules go to OUT/lib/modules/<release>/...")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *kernel == "" || *out == "" || fs.NArg() == 0 {
		fmt.Fprintln(stderr, "usage: modsel -kernel DIR -out DIR module...")
		return 2
	}
	if err := selectModules(*kernel, *out, fs.Args(), stdout); err != nil {
		fmt.Fprintf(stderr, "modsel: %v\n", err)
		return 1
	}
	return 0
}

func selectModules(kernel, out string, names []string, stdout io.Writer) error {
	rel, err := os.ReadFile(filepath.Join(kernel, "release"))
	if err != nil {
		return fmt.Errorf("kernel %s: %w", kernel, err)
	}
	release := strings.TrimSpace(string(rel))
	if release == "" || strings.ContainsAny(release, "/ \n") {
		return fmt.Errorf("kernel %s: bad release %q", kernel, release)
	}
	src := filepath.Join(kernel, "lib", "modules", release)
	ix, err := kmod.Open(src)
	if err != nil {
		return err
	}
	order, err := ix.Order(names...)
	if err != nil {
		return err
	}
	dst := filepath.Join(out, "lib", "modules", release)
	// imagePath is where a module goes in the image, relative to dst, with slashes.
	imagePath := func(m *kmod.Module) (string, error) {
		r, err := filepath.Rel(ix.Dir(), m.Path)
		if err != nil {
			return "", fmt.Errorf("module %s: %w", m.Name, err)
		}
		return filepath.ToSlash(kmod.Uncompressed(r)), nil
	}
	var total int64
	for _, name := range order {
		m := ix.Module(name)
		if m == nil {
			fmt.Fprintf(stdout, "%-24s built in\n", name)
			continue
		}
		r, err := imagePath(m)
		if err != nil {
			return err
		}
		b, err := kmod.ReadModule(m.Path)
		if err != nil {
			return err
		}
		if err := writeFile(filepath.Join(dst, filepath.FromSlash(r)), b); err != nil {
			return fmt.Errorf("module %s: %w", name, err)
		}
		total += int64(len(b))
		fmt.Fprintf(stdout, "%-24s %8d  %s\n", name, len(b), r)
	}
	var dep bytes.Buffer
	if err := ix.WriteDep(&dep, order, imagePath); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(dst, kmod.DepFile), dep.Bytes()); err != nil {
		return err
	}
	// kmod.Open reads modules.builtin in the guest too, so a request for a built-in
	// module is answered there as well.
	for _, f := range []string{"modules.builtin", "modules.order"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err == nil {
			err = writeFile(filepath.Join(dst, f), b)
		}
		if err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "%d modules, %d bytes (%s)\n", len(order), total, release)
	return nil
}

func writeFile(dst string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o644)
}
