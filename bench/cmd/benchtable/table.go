package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// row is one line of the table: passage's figure, the baseline's, and their ratio.
type row struct {
	id, what, input string
	passage, base   string
	ratio           string
	note            string
}

type table struct {
	rows    []row
	targets []string
}

func (t *table) add(r row) { t.rows = append(t.rows, r) }

// pair adds a row comparing two medians.
func (t *table) pair(id, what, input string, p, b time.Duration, baseName, note string) float64 {
	ratio := float64(b) / float64(p)
	t.add(row{id: id, what: what, input: input, passage: dur(p), base: fmt.Sprintf("%s %s", dur(b), baseName),
		ratio: fmt.Sprintf("%.1fx", ratio), note: note})
	return ratio
}

// target records whether a target was met, with the figure that decides it.
func (t *table) target(met bool, format string, args ...any) {
	word := "MET    "
	if !met {
		word = "NOT MET"
	}
	t.targets = append(t.targets, word+"  "+fmt.Sprintf(format, args...))
}

func dur(d time.Duration) string {
	switch {
	case d >= 10*time.Second:
		return fmt.Sprintf("%.1f s", d.Seconds())
	case d >= time.Second:
		return fmt.Sprintf("%.2f s", d.Seconds())
	case d >= 10*time.Millisecond:
		return fmt.Sprintf("%.1f ms", float64(d)/1e6)
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2f ms", float64(d)/1e6)
	default:
		return fmt.Sprintf("%.0f µs", float64(d)/1e3)
	}
}

func mib(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20)) }

var header = []string{"#", "measurement", "input", "passage", "baseline", "ratio", "note"}

func (r row) cells() []string {
	dash := func(s string) string {
		if s == "" {
			return "—"
		}
		return s
	}
	return []string{r.id, r.what, dash(r.input), dash(r.passage), dash(r.base), dash(r.ratio), r.note}
}

func (t *table) text(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for _, r := range t.rows {
		fmt.Fprintln(tw, strings.Join(r.cells(), "\t"))
	}
	tw.Flush()
}

func (t *table) markdown(w io.Writer) {
	fmt.Fprintf(w, "| %s |\n", strings.Join(header, " | "))
	fmt.Fprintf(w, "|%s\n", strings.Repeat("---|", len(header)))
	for _, r := range t.rows {
		c := r.cells()
		for i := range c {
			c[i] = strings.ReplaceAll(c[i], "|", `\|`)
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(c, " | "))
	}
}
