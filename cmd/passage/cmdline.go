package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/passage-boot/passage/decision"
)

// cmdCmdline prints the kernel arguments a signed boot image carries for a saved plan:
// `make uki PLAN=F` appends them to the image's command line.
func cmdCmdline(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cmdline", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage cmdline --plan FILE\n\nPrints the kernel arguments a boot image carries for the saved plan FILE (passage plan --out):\nits pci=config_acs=, which Linux 6.11+ programs before passage runs, and passage.plan=sha256:<digest of FILE>.")
		fs.PrintDefaults()
	}
	plan := fs.String("plan", "", "saved plan `FILE` (passage plan --out)")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if *plan == "" || fs.NArg() != 0 {
		fs.Usage()
		return 2
	}
	b, err := readBounded(*plan)
	if err != nil {
		fmt.Fprintf(stderr, "cmdline: %v\n", err)
		return 2
	}
	a, err := decision.ImageArgs(b)
	if err != nil {
		fmt.Fprintf(stderr, "cmdline: %s: %v\n", *plan, err)
		return 2
	}
	fmt.Fprintln(stdout, a)
	return 0
}

// readBounded reads a saved plan, refusing what is not a regular file (a FIFO would
// hang) and what is larger than a plan can be.
func readBounded(name string) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file", name)
	}
	b, err := io.ReadAll(io.LimitReader(f, 16<<20+1))
	if err != nil {
		return nil, err
	}
	if len(b) > 16<<20 {
		return nil, fmt.Errorf("%s: larger than 16 MiB", name)
	}
	return b, nil
}
