package main

import (
	"flag"
	"fmt"
	"io"
	"strconv"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/metrics"
	"github.com/passage-boot/passage/pci"
)

// cmdMetrics prints a verified manifest as Prometheus metrics. With --root it also reads
// the node's ACS Control registers now and says which ports drifted from what the boot
// wrote and signed (passage_acs_port_drifted): run on the node by a timer into
// node_exporter's textfile directory, that is what the ACS drift alert reads.
func cmdMetrics(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("metrics", flag.ContinueOnError)
	fs.SetOutput(stderr)
	file := fs.String("manifest", "", "the signed manifest envelope `FILE` (manifest.dsse.json)")
	pub := fs.String("pub", "", "public key file of the node's ed25519 key, or a directory of keys")
	tpmPub := fs.String("tpm-pub", "", "public key file of the node's TPM key")
	minGen := fs.String("min-generation", "0", "refuse manifests with a lower generation (replay)")
	root := fs.String("root", "", "also compare the ports' ACS Control under `DIR` (/ on the node) with the manifest")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage metrics --manifest FILE --pub KEY|--tpm-pub FILE [--root DIR] [--min-generation N]")
		fmt.Fprintln(stderr, "prints the verified manifest in Prometheus text format; metrics report the manifest, they judge nothing")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 || *file == "" || (*pub == "") == (*tpmPub == "") {
		fs.Usage()
		return 2
	}
	min, err := strconv.ParseUint(*minGen, 10, 64)
	if err != nil {
		fmt.Fprintf(stderr, "passage metrics: --min-generation %q: not a generation number\n", *minGen)
		return 2
	}
	kr, err := loadKeyring(*pub+*tpmPub, *tpmPub != "")
	if err != nil {
		fmt.Fprintf(stderr, "passage metrics: %v\n", err)
		return 2
	}
	o := verifyFile(*file, kr, manifest.VerifyOptions{MinGeneration: min})
	switch {
	case o.failed != nil:
		fmt.Fprintf(stderr, "passage metrics: %s\n", oneLine(o.failed))
		return 2
	case o.refused != nil:
		fmt.Fprintf(stderr, "passage metrics: %s: REFUSED: %s\n", *file, oneLine(o.refused))
		return 1
	}
	src := metrics.Source{Manifest: o.verified.Manifest, Signed: true}
	if *root != "" {
		tree, err := pci.Scan(*root)
		if err != nil {
			fmt.Fprintf(stderr, "passage metrics: %v\n", err)
			return 2
		}
		src.LiveACS = liveACS(tree)
	}
	if err := metrics.Write(stdout, src); err != nil {
		fmt.Fprintf(stderr, "passage metrics: %v\n", err)
		return 2
	}
	return 0
}

// liveACS is every port's ACS Control register in lspci's words, as the manifest
// records them.
func liveACS(t *pci.Tree) map[string]string {
	live := map[string]string{}
	for _, d := range t.Devices {
		if d.ACS != nil {
			live[d.Addr.String()] = d.ACS.Ctl.Lspci()
		}
	}
	return live
}
