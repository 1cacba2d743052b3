package main

import (
	"fmt"
	"io"
	"os"

	"github.com/passage-boot/passage/decision"
)

// cmdCmdline prints the kernel arguments a signed boot image carries for a saved plan:
// `make uki PLAN=F` appends them to the image's command line.
func cmdCmdline(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("cmdline", stderr)
	plan := fs.String("plan", "", "saved plan `FILE` (passage plan -o)")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	if *plan == "" {
		fmt.Fprintln(stderr, "passage cmdline: --plan FILE is required")
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
