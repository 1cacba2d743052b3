package perfcheck

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
)

// NVBRun is one output file of nvbandwidth (one or several invocations appended).
type NVBRun struct {
	File      string
	Version   string // "nvbandwidth Version: v0.8"
	Testcases []NVBTestcase
	// Aborted holds the first line that shows nvbandwidth died ([CUDA_ERROR_...],
	// terminate called, a signal); "" when none was seen.
	Aborted     string
	AbortedLine int
	// Truncated is set when the file ends inside a testcase (before its SUM line).
	Truncated bool
}

// NVBTestcase is one "Running <name>." block.
type NVBTestcase struct {
	Name        string // host_to_device_memcpy_ce, ...
	Line        int    // line of "Running <name>."
	Description string // "memcpy CE CPU(row) -> GPU(column) bandwidth (GB/s)"
	Columns     []int  // column device indexes
	// Matrix holds the printed values, row by row, in GB/s; N/A cells are NaN.
	Matrix [][]float64
	// Sum is the "SUM <name> X" line; nil when the block ended without it.
	Sum *float64
	// Status is "" for a testcase that printed results, otherwise what nvbandwidth
	// printed instead ("WAIVED: ...", "ERROR: ...").
	Status string
}

// Cells returns the matrix values that are numbers.
func (t NVBTestcase) Cells() []float64 {
	var out []float64
	for _, r := range t.Matrix {
		for _, v := range r {
			if !math.IsNaN(v) {
				out = append(out, v)
			}
		}
	}
	return out
}

// Value is the testcase's figure: the SUM line when printed, else the sum of cells.
func (t NVBTestcase) Value() (float64, bool) {
	if t.Sum != nil {
		return *t.Sum, true
	}
	c := t.Cells()
	if len(c) == 0 {
		return 0, false
	}
	s := 0.0
	for _, v := range c {
		s += v
	}
	return s, true
}

var nvbAbortMarkers = []string{
	"[CUDA_ERROR_", "[cuda", "CUDA_ERROR", "terminate called", "Segmentation fault",
	"core dumped", "Aborted", "Killed", "what():",
}

// ParseNVBandwidth reads nvbandwidth's plain-text output (not its -j JSON). Several
// invocations appended to one file are fine; each testcase block keeps its own line.
// A matrix row that does not fit its header is an error naming file and line, unless it
// is the unterminated last line of the file (then Truncated is set).
func ParseNVBandwidth(name string, r io.Reader) (*NVBRun, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("nvbandwidth %s: read: %w", name, err)
	}
	run := &NVBRun{File: name}
	endsInNewline := len(data) == 0 || data[len(data)-1] == '\n'
	lines := bytes.Count(data, []byte{'\n'})
	if !endsInNewline {
		lines++
	}
	var cur *NVBTestcase
	closeCur := func() {
		if cur != nil {
			run.Testcases = append(run.Testcases, *cur)
			cur = nil
		}
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	lineNo := 0
	sawAny := false
	for sc.Scan() {
		lineNo++
		s := stripLine(sc.Text())
		if s == "" {
			continue
		}
		last := lineNo == lines && !endsInNewline
		f := strings.Fields(s)
		switch {
		case strings.HasPrefix(s, "nvbandwidth Version:"):
			closeCur()
			run.Version = strings.TrimSpace(strings.TrimPrefix(s, "nvbandwidth Version:"))
			sawAny = true
			continue
		case strings.HasPrefix(s, "Running ") && strings.HasSuffix(s, ".") && len(f) == 2:
			closeCur()
			cur = &NVBTestcase{Name: strings.TrimSuffix(f[1], "."), Line: lineNo}
			sawAny = true
			continue
		case f[0] == "SUM":
			if len(f) != 3 {
				if last {
					run.Truncated = true
					continue
				}
				return nil, fmt.Errorf("nvbandwidth %s:%d: SUM line %q", name, lineNo, s)
			}
			if cur == nil || cur.Name != f[1] {
				return nil, fmt.Errorf("nvbandwidth %s:%d: SUM for %s outside its testcase", name, lineNo, f[1])
			}
			v, err := parseFloat(f[2])
			if err != nil {
				if last {
					run.Truncated = true
					continue
				}
				return nil, fmt.Errorf("nvbandwidth %s:%d: SUM %q is not a number", name, lineNo, f[2])
			}
			cur.Sum = &v
			closeCur()
			continue
		}
		if run.Aborted == "" && nvbAborted(s) {
			run.Aborted, run.AbortedLine = s, lineNo
		}
		if cur == nil {
			continue
		}
		switch {
		case cur.Columns == nil && cur.Description == "" && !isInt(f[0]):
			if st := statusWord(f[0]); st != "" {
				cur.Status = s
				closeCur()
				continue
			}
			cur.Description = s
		case cur.Columns == nil && allInts(f):
			cols := make([]int, len(f))
			for i, t := range f {
				cols[i], _ = strconv.Atoi(t)
			}
			cur.Columns = cols
		case cur.Columns != nil && isInt(f[0]):
			if len(f) != len(cur.Columns)+1 {
				if last {
					run.Truncated = true
					continue
				}
				return nil, fmt.Errorf("nvbandwidth %s:%d: %s row has %d values, header has %d columns", name, lineNo, cur.Name, len(f)-1, len(cur.Columns))
			}
			row := make([]float64, len(cur.Columns))
			for i, t := range f[1:] {
				v, err := parseFloat(t)
				if err != nil {
					if last {
						run.Truncated = true
						row = nil
						break
					}
					return nil, fmt.Errorf("nvbandwidth %s:%d: %s value %q is not a number", name, lineNo, cur.Name, t)
				}
				row[i] = v
			}
			if row != nil {
				cur.Matrix = append(cur.Matrix, row)
			}
		default:
			if st := statusWord(f[0]); st != "" {
				cur.Status = s
				closeCur()
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("nvbandwidth %s:%d: %w", name, lineNo+1, err)
	}
	if cur != nil {
		// The last block never printed its SUM: the run stopped inside it.
		run.Truncated = true
		closeCur()
	}
	if !sawAny {
		return nil, fmt.Errorf("nvbandwidth %s: no nvbandwidth version line or testcase", name)
	}
	return run, nil
}

func nvbAborted(s string) bool {
	for _, m := range nvbAbortMarkers {
		if strings.Contains(s, m) {
			return true
		}
	}
	return false
}

// statusWord recognises the word nvbandwidth prints instead of a result block.
func statusWord(w string) string {
	w = strings.TrimSuffix(strings.ToUpper(w), ":")
	switch w {
	case "WAIVED", "ERROR", "NOT_FOUND", "SKIPPED":
		return w
	}
	return ""
}

func allInts(f []string) bool {
	for _, t := range f {
		if !isInt(t) {
			return false
		}
	}
	return len(f) > 0
}
