package main

import (
	"flag"
	"fmt"
	"io"
)

func cmdRender(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("render", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var f planFlags
	f.register(fs)
	format := fs.String("format", "qemu", "qemu (arguments), libvirt (<devices> fragment) or nccl-xml (NCCL_TOPO_FILE)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "passage render: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	switch *format {
	case "qemu", "libvirt", "nccl-xml":
	default:
		fmt.Fprintf(stderr, "passage render: --format %q: want qemu, libvirt or nccl-xml\n", *format)
		return 2
	}
	d, err := f.decide(fs)
	if err == nil && d.LabelErr != nil {
		// A guest must not be rendered from a labelling the rules disagree on.
		err = d.LabelErr
	}
	if err == nil && d.Guest == nil {
		err = d.GuestErr
	}
	if err != nil {
		return exitFor(stderr, err)
	}
	pl := d.Plan()
	var out []byte
	switch *format {
	case "qemu":
		out = []byte(pl.Guest.QEMUText(nil))
	case "libvirt":
		out, err = pl.Guest.Libvirt()
	case "nccl-xml":
		out, err = pl.Guest.NCCLTopology()
	}
	if err != nil {
		return exitFor(stderr, err)
	}
	if _, err := stdout.Write(out); err != nil {
		fmt.Fprintf(stderr, "passage render: %v\n", err)
		return 1
	}
	return 0
}
