package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/passage-boot/passage/perfcheck"
)

func cmdPerfcheck(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("perfcheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: passage perfcheck --host DIR --guest DIR [--json] [--html FILE] [thresholds]")
		fmt.Fprintln(stderr, "compares nccl-tests and nvbandwidth output of a host and a guest; exit 1 when a threshold is crossed")
		fs.PrintDefaults()
	}
	def := perfcheck.DefaultThresholds
	hostDir := fs.String("host", "", "directory of the host's nccl-tests/nvbandwidth output files")
	guestDir := fs.String("guest", "", "directory of the guest's output files")
	asJSON := fs.Bool("json", false, "print the full report as JSON instead of text")
	htmlFile := fs.String("html", "", "also write an HTML report with one plot per collective to `FILE`")
	inPlace := fs.Bool("in-place", false, "compare the in-place busbw columns instead of out-of-place")
	largest := fs.Float64("largest", def.LargestPct, "max loss in `percent` at each collective's largest message")
	large := fs.Float64("large", def.Large8MiBPct, "max loss in `percent` at any message >= 8 MiB")
	nvb := fs.Float64("nvbandwidth", def.NVBandwidthPct, "max loss in `percent` for nvbandwidth host->device and device->host")
	small := fs.Float64("small", def.SmallPct, "loss in `percent` that names a small message (< 8 MiB) as outlier or repeated; never fails")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "passage perfcheck: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if *hostDir == "" || *guestDir == "" {
		fmt.Fprintln(stderr, "passage perfcheck: --host and --guest are required")
		return 2
	}
	for name, v := range map[string]float64{"largest": *largest, "large": *large, "nvbandwidth": *nvb, "small": *small} {
		if v < 0 || v != v {
			fmt.Fprintf(stderr, "passage perfcheck: --%s %g: a loss limit is a percentage >= 0\n", name, v)
			return 2
		}
	}
	opt := perfcheck.Options{
		Thresholds: perfcheck.Thresholds{LargestPct: *largest, Large8MiBPct: *large, NVBandwidthPct: *nvb, SmallPct: *small},
		InPlace:    *inPlace,
	}
	var sides [2]*perfcheck.Side
	for i, dir := range []string{*hostDir, *guestDir} {
		st, err := os.Stat(dir)
		if err != nil {
			fmt.Fprintf(stderr, "passage perfcheck: %v\n", err)
			return 2
		}
		if !st.IsDir() {
			fmt.Fprintf(stderr, "passage perfcheck: %s: not a directory\n", dir)
			return 2
		}
		s, err := perfcheck.Load(os.DirFS(dir), dir)
		if err != nil {
			fmt.Fprintf(stderr, "passage perfcheck: %v\n", err)
			return 2
		}
		sides[i] = s
	}
	rep := perfcheck.CompareSides(sides[0], sides[1], opt)
	if *htmlFile != "" {
		if err := writeHTMLFile(*htmlFile, rep); err != nil {
			fmt.Fprintf(stderr, "passage perfcheck: %v\n", err)
			return 2
		}
	}
	var err error
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(rep)
	} else {
		err = perfcheck.WriteText(stdout, rep)
	}
	if err != nil {
		fmt.Fprintf(stderr, "passage perfcheck: write report: %v\n", err)
		return 2
	}
	if !rep.Pass {
		return 1
	}
	return 0
}

func writeHTMLFile(name string, rep *perfcheck.Report) error {
	f, err := os.Create(name)
	if err != nil {
		return fmt.Errorf("html %s: %w", name, err)
	}
	if err := perfcheck.WriteHTML(f, rep); err != nil {
		f.Close()
		return fmt.Errorf("html %s: %w", name, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("html %s: %w", name, err)
	}
	return nil
}
