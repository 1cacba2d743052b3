package main

import (
	"fmt"
	"io"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// printErase is a unit's erase record in verify's summary (manifest/SCHEMA.md, Erase).
func printErase(w io.Writer, e *manifest.UnitErase) {
	if e == nil {
		return
	}
	fmt.Fprintf(w, "             erase (%s)\n", pr(e.Policy))
	for _, n := range e.NVMe {
		method := n.Method
		if method == "" {
			method = "not erased"
		}
		fmt.Fprintf(w, "               %s %s %s serial %s fw %s: %s, %d LBAs verified, %s\n", pr(n.BDF), pr(n.Controller), pr(n.Model),
			pr(n.Serial), pr(n.Firmware), pr(method), n.VerifiedLBAs, n.Duration.Round(time.Millisecond))
		for _, ns := range n.Namespaces {
			fmt.Fprintf(w, "                 ns %d: %d blocks of %d bytes, %d verified\n", ns.NSID, ns.Blocks, ns.BlockSize, ns.VerifiedLBAs)
		}
		if n.Error != "" {
			fmt.Fprintf(w, "                 error: %s\n", pr(n.Error))
		}
	}
	for _, r := range e.Resets {
		fmt.Fprintf(w, "               reset %s (%s): %s\n", pr(r.BDF), pr(r.Methods), pr(r.Result))
	}
	if e.Error != "" {
		fmt.Fprintf(w, "               error: %s\n", pr(e.Error))
	}
}
