package perfcheck

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

func fmtPtr(p *float64, format string) string {
	if p == nil {
		return "-"
	}
	return fmt.Sprintf(format, *p)
}

func verdictWord(pass bool) string {
	if pass {
		return "PASS"
	}
	return "FAIL"
}

func worstString(w *Worst) string {
	if w == nil {
		return "-"
	}
	return fmt.Sprintf("%+.2f%% (%s %s: %.2f -> %.2f GB/s)", w.DeltaPct, w.Collective, sizeString(w.Size), w.Host, w.Guest)
}

func nvbString(t *NVBTestcaseReport) string {
	if t == nil || t.DeltaPct == nil {
		return "-"
	}
	return fmt.Sprintf("%+.2f%% (%s: %.2f -> %.2f %s, %s)", *t.DeltaPct, t.Name, *t.Host, *t.Guest, t.Unit, t.Basis)
}

// WriteText prints the summary, the findings and per-collective tables for a terminal.
func WriteText(w io.Writer, rep *Report) error {
	var b strings.Builder
	th := rep.Thresholds
	fmt.Fprintf(&b, "perfcheck: host %s vs guest %s (busbw %s, median over rounds)\n\n", rep.Host, rep.Guest, rep.Column)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "largest message, worst\t%s\tlimit -%g%%\n", worstString(rep.Summary.Largest), th.LargestPct)
	fmt.Fprintf(tw, ">= 8 MiB, worst\t%s\tlimit -%g%%\n", worstString(rep.Summary.Worst8MiB), th.Large8MiBPct)
	fmt.Fprintf(tw, "nvbandwidth host->device\t%s\tlimit -%g%%\n", nvbString(rep.Summary.H2D), th.NVBandwidthPct)
	fmt.Fprintf(tw, "nvbandwidth device->host\t%s\tlimit -%g%%\n", nvbString(rep.Summary.D2H), th.NVBandwidthPct)
	fmt.Fprintf(tw, "small-message outliers\t%d (not repeated by a neighbour)\t\n", len(rep.Summary.Outliers))
	fmt.Fprintf(tw, "small-message repeated losses\t%d\t\n", len(rep.Summary.Repeated))
	tw.Flush()

	for _, c := range rep.Collectives {
		fmt.Fprintf(&b, "\n%s (host %d rounds, guest %d rounds)\n", c.Name, c.HostRounds, c.GuestRounds)
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "size\thost GB/s\tguest GB/s\tdelta\t\t\n")
		for _, p := range c.Points {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t\n", sizeString(p.Size), fmtPtr(p.Host, "%.2f"), fmtPtr(p.Guest, "%.2f"), fmtPtr(p.DeltaPct, "%+.2f%%"), p.Class)
		}
		tw.Flush()
	}
	if len(rep.NVBandwidth) > 0 {
		fmt.Fprintf(&b, "\nnvbandwidth\n")
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
		fmt.Fprintf(tw, "testcase\thost\tguest\tdelta\tbasis\tworst cell\t\n")
		for _, t := range rep.NVBandwidth {
			cell := "-"
			if t.WorstCellDelta != nil {
				cell = fmt.Sprintf("%+.2f%% (%s)", *t.WorstCellDelta, t.WorstCell)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", t.Name, fmtPtr(t.Host, "%.2f"), fmtPtr(t.Guest, "%.2f"), fmtPtr(t.DeltaPct, "%+.2f%%"), t.Basis, cell)
		}
		tw.Flush()
	}
	if len(rep.Findings) > 0 {
		fmt.Fprintf(&b, "\nfindings\n")
		for _, f := range rep.Findings {
			fmt.Fprintf(&b, "  %-4s %s: %s\n", f.Severity, f.Subject, f.Message)
		}
	}
	fmt.Fprintf(&b, "\nverdict: %s\n", verdictWord(rep.Pass))
	_, err := io.WriteString(w, b.String())
	return err
}
