package main

import (
	"fmt"
	"io"
	"math"

	"github.com/passage-boot/passage/perfcheck"
)

func cmdPerfcheck(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("perfcheck", stderr)
	def := perfcheck.DefaultThresholds
	var cfg perfcheck.Config
	fs.StringVar(&cfg.HostDir, "host", "", "directory of the host's nccl-tests/nvbandwidth output files")
	fs.StringVar(&cfg.GuestDir, "guest", "", "directory of the guest's output files")
	fs.BoolVar(&cfg.JSON, "json", false, "print the full report as JSON instead of text")
	fs.StringVar(&cfg.HTMLFile, "html", "", "also write an HTML report with one plot per collective to `FILE`")
	fs.BoolVar(&cfg.Options.InPlace, "in-place", false, "compare the in-place busbw columns instead of out-of-place")
	th := &cfg.Options.Thresholds
	fs.Float64Var(&th.LargestPct, "largest", def.LargestPct, "max loss in `percent` at each collective's largest message")
	fs.Float64Var(&th.Large8MiBPct, "large", def.Large8MiBPct, "max loss in `percent` at any message >= 8 MiB")
	fs.Float64Var(&th.NVBandwidthPct, "nvbandwidth", def.NVBandwidthPct, "max loss in `percent` for nvbandwidth host->device and device->host")
	fs.Float64Var(&th.SmallPct, "small", def.SmallPct, "loss in `percent` that names a message < 8 MiB an outlier (never fails)")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	if cfg.HostDir == "" || cfg.GuestDir == "" {
		fmt.Fprintln(stderr, "passage perfcheck: --host and --guest are required")
		return 2
	}
	for _, l := range []struct {
		name string
		v    float64
	}{{"largest", th.LargestPct}, {"large", th.Large8MiBPct}, {"nvbandwidth", th.NVBandwidthPct}, {"small", th.SmallPct}} {
		if l.v < 0 || math.IsNaN(l.v) || math.IsInf(l.v, 0) {
			fmt.Fprintf(stderr, "passage perfcheck: --%s %g: a loss limit is a percentage >= 0\n", l.name, l.v)
			return 2
		}
	}
	rep, err := perfcheck.Run(cfg, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "passage perfcheck: %v\n", err)
		return 2
	}
	if !rep.Pass {
		return 1
	}
	return 0
}
