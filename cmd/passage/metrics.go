package main

import (
	"flag"
	"fmt"
	"io"

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
	var vf verifyFlags
	vf.register(fs)
	root := fs.String("root", "", "also compare the ports' ACS Control under `DIR` (/ on the node) with the manifest")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage metrics --manifest FILE --pub KEY|KEYDIR|--tpm-pub FILE [--root DIR] [--min-generation N] [--boot-id ID]")
		fmt.Fprintln(stderr, "prints the verified manifest in Prometheus text format; metrics report the manifest, they judge nothing")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 || *file == "" {
		fs.Usage()
		return 2
	}
	v, signer, code := vf.verify("metrics", *file, stderr)
	if code != 0 {
		return code
	}
	src := metrics.Source{Manifest: v.Manifest, Signed: true, Signer: signer}
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
