// Command pciids writes the pci.ids subset the initramfs carries: the names of the
// vendors and devices that passage's built-in profiles know (pciids.ProfileWants), taken
// from the build machine's database, so that inspect, plan and apply on the node print
// names as lspci does without the whole database in the image.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pciids"
	"github.com/passage-boot/passage/topology"
)

func main() {
	from := flag.String("from", pciids.DefaultPath, "the full pci.ids database")
	out := flag.String("out", "", "where to write the subset")
	flag.Parse()
	if *out == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: pciids [-from FILE] -out FILE")
		os.Exit(2)
	}
	db, err := pciids.Open(*from)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pciids: %v\n", err)
		os.Exit(1)
	}
	var profiles []*topology.Profile
	for _, n := range topology.Builtins() {
		p, err := topology.Builtin(n)
		if err != nil {
			fmt.Fprintf(os.Stderr, "pciids: %v\n", err)
			os.Exit(1)
		}
		profiles = append(profiles, p)
	}
	want := pciids.ProfileWants(profiles)
	var b bytes.Buffer
	if err := db.WriteSubset(&b, want); err != nil {
		fmt.Fprintf(os.Stderr, "pciids: %v\n", err)
		os.Exit(1)
	}
	if err := os.MkdirAll(filepath.Dir(*out), 0o755); err != nil {
		fmt.Fprintf(os.Stderr, "pciids: %v\n", err)
		os.Exit(1)
	}
	if err := manifest.WriteAtomic(filepath.Dir(*out), filepath.Base(*out), b.Bytes()); err != nil {
		fmt.Fprintf(os.Stderr, "pciids: %v\n", err)
		os.Exit(1)
	}
	fi, _ := os.Stat(*from)
	fmt.Printf("%d vendors, %d bytes of the %d in %s\n", len(want), b.Len(), fi.Size(), *from)
}
