// Command modsel copies kernel modules and their dependency closure, as .modinfo's
// depends= gives it (initramfs/kmod), from an unpacked kernel package into an
// initramfs staging tree, keeping the .deb's lib/modules/<release>/kernel/... paths:
// u-root's init auto-loads only *.ko placed flat in /lib/modules/, and passage boot
// must decide what loads and when.
//
//	modsel -kernel build/kernel -out STAGE vfio vfio-pci nvme ...
package main

import (
	"flag"
	"fmt"
	"io"
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
	var total int64
	for _, name := range order {
		m := ix.Module(name)
		if m == nil {
			fmt.Fprintf(stdout, "%-24s built in\n", name)
			continue
		}
		r, err := filepath.Rel(ix.Dir(), m.Path)
		if err != nil {
			return fmt.Errorf("module %s: %w", name, err)
		}
		n, err := copyFile(m.Path, filepath.Join(dst, r))
		if err != nil {
			return fmt.Errorf("module %s: %w", name, err)
		}
		total += n
		fmt.Fprintf(stdout, "%-24s %8d  %s\n", name, n, r)
	}
	// kmod.Open reads modules.builtin in the guest too, so a request for a built-in
	// module is answered there as well.
	for _, f := range []string{"modules.builtin", "modules.order"} {
		if _, err := os.Stat(filepath.Join(src, f)); err == nil {
			if _, err := copyFile(filepath.Join(src, f), filepath.Join(dst, f)); err != nil {
				return err
			}
		}
	}
	fmt.Fprintf(stdout, "%d modules, %d bytes (%s)\n", len(order), total, release)
	return nil
}

func copyFile(src, dst string) (int64, error) {
	in, err := os.Open(src)
	if err != nil {
		return 0, err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return 0, err
	}
	o, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(o, in)
	if cerr := o.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return 0, fmt.Errorf("copy %s: %w", src, err)
	}
	return n, nil
}
