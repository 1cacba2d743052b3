package main

import (
	"fmt"
	"io"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/manifest"
)

// cmdCmdline prints the kernel arguments a signed boot image carries for a saved plan:
// `make uki PLAN=F` appends them to the image's command line, whose other arguments
// --base names, so that a line the kernel would cut short is refused before anything
// is signed.
func cmdCmdline(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("cmdline", stderr)
	plan := fs.String("plan", "", "saved plan `FILE` (passage plan -o)")
	base := fs.String("base", "", "the image's other kernel `ARGUMENTS` (make uki's UKI_CMDLINE): with the plan's they must be shorter than the kernel keeps (at most 2046 bytes on x86)")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	if *plan == "" {
		fmt.Fprintln(stderr, "passage cmdline: --plan FILE is required")
		return 2
	}
	// Not a FIFO (the open would wait for a writer), nothing larger than a plan can be.
	b, err := manifest.ReadRegular(*plan, decision.MaxSaved)
	if err != nil {
		fmt.Fprintf(stderr, "cmdline: %v\n", err)
		return 2
	}
	a, err := decision.ImageCmdline(b, *base)
	if err != nil {
		fmt.Fprintf(stderr, "cmdline: %s: %v\n", *plan, err)
		return 2
	}
	fmt.Fprintln(stdout, a)
	return 0
}
