package stages

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// StageLine is the console line for a finished stage: what an operator watching the serial
// console over the BMC reads as the boot goes. Findings and changes follow, indented; the
// error (or skip reason) ends the block, its first line only.
func StageLine(r Result) string { return stageLine(r, false) }

// stageLine is StageLine; full prints every line of the error (a panic's stack), as
// passage.debug asks.
func stageLine(r Result, full bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "passage: %-9s %-8s %8s", r.Name, r.Status, fmtDuration(r.Duration))
	if n, c := len(r.Findings), len(r.Changes); n+c > 0 {
		fmt.Fprintf(&b, "  (%d findings, %d changes)", n, c)
	}
	b.WriteByte('\n')
	for _, f := range r.Findings {
		fmt.Fprintf(&b, "passage:   - %s\n", oneLine(f))
	}
	for _, c := range r.Changes {
		fmt.Fprintf(&b, "passage:   + %s\n", oneLine(c))
	}
	if r.Err != nil && full {
		for _, l := range strings.Split(strings.TrimRight(r.Err.Error(), "\n"), "\n") {
			fmt.Fprintf(&b, "passage:   ! %s\n", l)
		}
	} else if r.Err != nil {
		// Only the first line: a panic's stack goes to the log and the manifest.
		fmt.Fprintf(&b, "passage:   ! %s\n", oneLine(strings.SplitN(r.Err.Error(), "\n", 2)[0]))
	}
	return b.String()
}

func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }

func fmtDuration(d time.Duration) string {
	return fmt.Sprintf("%.3fs", d.Seconds())
}

// WriteUnitTable prints the units as a table: id, GPU BDF, NICs, status, and the first
// reason of a unit that is not ok.
func WriteUnitTable(w io.Writer, units []Unit) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "UNIT\tGPU\tNICS\tSTATUS\tWHY")
	for _, u := range units {
		nics := strings.Join(u.NICs, ",")
		if nics == "" {
			nics = "-"
		}
		why := ""
		if len(u.Reasons) > 0 {
			why = u.Reasons[0]
			if len(u.Reasons) > 1 {
				why += fmt.Sprintf(" (+%d more)", len(u.Reasons)-1)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", u.ID, u.GPU, nics, UnitWord(u.Status), oneLine(why))
	}
	if len(units) == 0 {
		fmt.Fprintln(tw, "(no units)\t\t\t\t")
	}
	return tw.Flush()
}

type unitJSON struct {
	Type string `json:"type"`
	Unit
	// Status shadows Unit's: a unit's word is the manifest's (ready, degraded, failed).
	Status string `json:"status"`
}

// UnitWord is a unit status in the manifest's words: ok is "ready".
func UnitWord(s Status) string {
	if s == OK {
		return "ready"
	}
	return string(s)
}

// WriteUnitsJSON appends one JSON line per unit ({"type":"unit",...}) to the log, its
// status in the manifest's words.
func WriteUnitsJSON(w io.Writer, units []Unit) error {
	for _, u := range units {
		b, err := json.Marshal(unitJSON{Type: "unit", Unit: u, Status: UnitWord(u.Status)})
		if err != nil {
			return fmt.Errorf("unit %s: %w", u.ID, err)
		}
		if _, err := w.Write(append(b, '\n')); err != nil {
			return fmt.Errorf("unit %s: write log: %w", u.ID, err)
		}
	}
	return nil
}
