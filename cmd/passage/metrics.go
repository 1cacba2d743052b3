package main

import (
	"fmt"
	"io"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/metrics"
	"github.com/passage-boot/passage/pci"
)

// cmdMetrics prints a verified manifest as Prometheus metrics. With --root it also reads
// the node's ACS Control registers now and says which ports drifted from what the boot
// wrote and signed (passage_acs_port_drifted): run on the node by a timer into
// node_exporter's textfile directory, that is what the ACS drift alert reads.
func cmdMetrics(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("metrics", stderr)
	var file string
	deprecatedFlag(fs, "manifest", "the MANIFEST argument", func(v string) error { file = v; return nil })
	var vf verifyFlags
	vf.register(fs)
	root := fs.String("root", "", "also compare the ports' ACS Control under `DIR` (/ on the node) with the manifest")
	pos, code, ok := parseFlags(fs, args, stdout)
	if !ok {
		return code
	}
	if file != "" {
		pos = append([]string{file}, pos...)
	}
	if len(pos) != 1 {
		fmt.Fprintln(stderr, "passage metrics: give one MANIFEST (the signed envelope, manifest.dsse.json); see passage help metrics")
		return 2
	}
	v, signer, code := vf.verify("metrics", pos[0], stderr)
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
		if !anyPort(v.Manifest, src.LiveACS) {
			// Every port would read as drifted: this is another node than the manifest's.
			fmt.Fprintf(stderr, "passage metrics: --root %s holds none of the ports the manifest of %s recorded: not that node\n", *root, pr(orDash(v.Manifest.Node.Hostname)))
			return 2
		}
	}
	if err := metrics.Write(stdout, src); err != nil {
		fmt.Fprintf(stderr, "passage metrics: %v\n", err)
		return 2
	}
	return 0
}

// anyPort says whether live holds a port of m's ACS records (or m records none).
func anyPort(m *manifest.Manifest, live map[string]string) bool {
	recorded := false
	for _, u := range m.Units {
		for _, c := range u.ACSChanges {
			if _, ok := live[c.Port]; ok {
				return true
			}
			recorded = true
		}
	}
	return !recorded
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
