package perfcheck

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math"
	"regexp"
	"strconv"
	"strings"
	"sync"
)

// NCCLRun is one output file of an nccl-tests binary (all_reduce_perf, ...): one round.
type NCCLRun struct {
	File       string // as given to ParseNCCL
	Collective string // "all_reduce", "alltoall", ...: the binary's name without "_perf"; "" if the file does not say
	Version    string // "# nccl-tests version X ..." (newer nccl-tests only)
	Rows       []NCCLRow
	// Header is the column header line's names after "#", e.g. size count type redop root
	// time algbw busbw #wrong time algbw busbw #wrong; nil when the file has no header.
	Header []string
	// AvgBusBW is the "# Avg bus bandwidth : X" footer; nil when the run did not print it.
	AvgBusBW *float64
	// OutOfBounds is the "# Out of bounds values : N OK|FAILED" footer; nil when absent.
	OutOfBounds *int
	// Aborted holds the first line that shows the run died (NCCL/CUDA failure, MPI abort,
	// signal); "" when no such line was seen.
	Aborted     string
	AbortedLine int
	// Truncated is set when the file ends without the "# Avg bus bandwidth" footer, or in
	// the middle of a row.
	Truncated bool
}

// NCCLRow is one message size of an nccl-tests table.
type NCCLRow struct {
	Line       int    // 1-based line in the file
	Size       int64  // bytes, column "size (B)"
	Count      int64  // elements, column "count"
	Type       string // "float", ...
	Redop      string // "sum", "none"; "" when nccl-tests printed nothing (old alltoall)
	Root       string // "-1" or a rank; "" for versions without the column
	OutOfPlace NCCLResult
	InPlace    NCCLResult
}

// NCCLResult is the time/algbw/busbw/#wrong group of one column side (out-of-place or
// in-place). Values nccl-tests printed as nan/inf, or a side it did not print, are NaN;
// use Valid before trusting BusBW.
type NCCLResult struct {
	TimeUS float64 // "time (us)"
	AlgBW  float64 // GB/s
	BusBW  float64 // GB/s
	// Wrong is the "#wrong" count of mismatching elements; NaN when nccl-tests printed
	// N/A (run with -c 0). Versions older than 2.x printed a max "error" column instead,
	// which is a tolerance, not a count: those files leave Wrong NaN and set ErrorCol.
	Wrong    float64
	ErrorCol float64
}

// Valid reports whether the side carries a usable bus bandwidth.
func (r NCCLResult) Valid() bool {
	return !math.IsNaN(r.BusBW) && !math.IsInf(r.BusBW, 0) && r.BusBW >= 0
}

func nanResult() NCCLResult {
	n := math.NaN()
	return NCCLResult{TimeUS: n, AlgBW: n, BusBW: n, Wrong: n, ErrorCol: n}
}

// mpiPrefix matches what launchers put before each line of a rank's output:
// Open MPI --tag-output "[1,0]<stdout>:", Open MPI --timestamp-output too, Slurm
// srun --label "0: ", MPICH/Intel MPI -prepend-rank "[0] ".
var mpiPrefix = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^(\[\d+,\d+\]<std(out|err)>:|\s*\d+: |\[\d+\] )`)
})

// collectiveRe finds an nccl-tests binary name in a banner or an echoed command line.
var collectiveRe = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`([a-z][a-z_]*?)_perf\b`) })

// abortMarkers are substrings of the lines nccl-tests, NCCL, CUDA and the MPI launchers
// print when a run dies before its footer.
var abortMarkers = []string{
	"NCCL failure", "Test NCCL failure", "Test CUDA failure", "Test failure",
	"CUDA failure", "ncclInternalError", "ncclSystemError",
	"ncclUnhandledCudaError", "ncclInvalidUsage", "ncclRemoteError",
	"MPI_ABORT", "mpirun noticed", "exited on signal", "Segmentation fault",
	"terminate called", "core dumped", "srun: error", "Killed",
}

func abortLine(s string) bool {
	for _, m := range abortMarkers {
		if strings.Contains(s, m) {
			return true
		}
	}
	return false
}

// stripLine removes a launcher prefix, CR line ends and surrounding blanks.
func stripLine(s string) string {
	s = strings.TrimRight(s, "\r")
	if loc := mpiPrefix().FindStringIndex(s); loc != nil {
		s = s[loc[1]:]
	}
	return strings.TrimSpace(s)
}

// parseFloat accepts what C's printf prints for doubles, including nan, -nan and inf.
func parseFloat(s string) (float64, error) {
	switch strings.ToLower(s) {
	case "nan", "-nan", "+nan", "nan(ind)", "-nan(ind)":
		return math.NaN(), nil
	case "n/a":
		return math.NaN(), nil
	}
	return strconv.ParseFloat(s, 64)
}

func isInt(s string) bool {
	_, err := strconv.ParseInt(s, 10, 64)
	return err == nil
}

// ncclLayout says where a row's columns are, learnt from the column header line.
type ncclLayout struct {
	hasRedop, hasRoot bool
	// indexes into the measurement tokens (after size/count/type/redop/root)
	out, in measureIdx
	perSide int // measurement tokens per side
}

type measureIdx struct{ time, algbw, busbw, wrong, errcol int }

var defaultLayout = ncclLayout{
	hasRedop: true, hasRoot: true,
	out:     measureIdx{0, 1, 2, 3, -1},
	in:      measureIdx{4, 5, 6, 7, -1},
	perSide: 4,
}

// layoutFromHeader reads the names of the "#  size  count  type ..." line.
func layoutFromHeader(names []string) (ncclLayout, bool) {
	if len(names) < 4 || names[0] != "size" || names[1] != "count" {
		return ncclLayout{}, false
	}
	l := ncclLayout{out: measureIdx{-1, -1, -1, -1, -1}, in: measureIdx{-1, -1, -1, -1, -1}}
	i := 2
	if i < len(names) && names[i] == "type" {
		i++
	}
	if i < len(names) && names[i] == "redop" {
		l.hasRedop = true
		i++
	}
	if i < len(names) && names[i] == "root" {
		l.hasRoot = true
		i++
	}
	side := &l.out
	seenTime := false
	for j, n := range names[i:] {
		switch n {
		case "time", "cputime":
			if seenTime {
				if side == &l.in {
					break
				}
				l.perSide = j
				side = &l.in
			}
			seenTime = true
			side.time = j
		case "algbw":
			side.algbw = j
		case "busbw":
			side.busbw = j
		case "#wrong":
			side.wrong = j
		case "error":
			side.errcol = j
		}
	}
	if l.out.busbw < 0 {
		return ncclLayout{}, false
	}
	if l.perSide == 0 {
		l.perSide = len(names) - i
	}
	return l, true
}

func (m measureIdx) shift(by int) measureIdx {
	f := func(i int) int {
		if i < 0 {
			return i
		}
		return i - by
	}
	return measureIdx{f(m.time), f(m.algbw), f(m.busbw), f(m.wrong), f(m.errcol)}
}

func (m measureIdx) max() int {
	x := m.time
	for _, v := range []int{m.algbw, m.busbw, m.wrong, m.errcol} {
		if v > x {
			x = v
		}
	}
	return x
}

func readSide(tok []string, m measureIdx) (NCCLResult, error) {
	r := nanResult()
	get := func(i int, dst *float64, what string) error {
		if i < 0 {
			return nil
		}
		if i >= len(tok) {
			return fmt.Errorf("no %s column", what)
		}
		v, err := parseFloat(tok[i])
		if err != nil {
			return fmt.Errorf("%s %q is not a number", what, tok[i])
		}
		*dst = v
		return nil
	}
	for _, g := range []struct {
		i   int
		dst *float64
		n   string
	}{{m.time, &r.TimeUS, "time"}, {m.algbw, &r.AlgBW, "algbw"}, {m.busbw, &r.BusBW, "busbw"}, {m.wrong, &r.Wrong, "#wrong"}, {m.errcol, &r.ErrorCol, "error"}} {
		if err := get(g.i, g.dst, g.n); err != nil {
			return r, err
		}
	}
	return r, nil
}

// parseRow reads one table row. tok starts with the size.
func (l ncclLayout) parseRow(tok []string) (NCCLRow, error) {
	var row NCCLRow
	if len(tok) < 3 {
		return row, fmt.Errorf("row has %d columns", len(tok))
	}
	var err error
	if row.Size, err = strconv.ParseInt(tok[0], 10, 64); err != nil || row.Size < 0 {
		return row, fmt.Errorf("size %q is not a byte count", tok[0])
	}
	if row.Count, err = strconv.ParseInt(tok[1], 10, 64); err != nil || row.Count < 0 {
		return row, fmt.Errorf("count %q is not an element count", tok[1])
	}
	row.Type = tok[2]
	if _, err := strconv.ParseFloat(row.Type, 64); err == nil {
		return row, fmt.Errorf("type %q is a number", row.Type)
	}
	i := 3
	// Old nccl-tests print an empty redop for alltoall/sendrecv, so a redop column in the
	// header need not have a token in the row: a number here is already the next column.
	if l.hasRedop && i < len(tok) {
		if _, err := parseFloat(tok[i]); err != nil {
			row.Redop = tok[i]
			i++
		}
	}
	if l.hasRoot {
		if i >= len(tok) || !isInt(tok[i]) {
			return row, fmt.Errorf("no root column")
		}
		row.Root = tok[i]
		i++
	}
	meas := tok[i:]
	need := l.in.max() + 1
	switch {
	case len(meas) >= need:
		if row.OutOfPlace, err = readSide(meas, l.out); err != nil {
			return row, fmt.Errorf("out-of-place: %w", err)
		}
		if row.InPlace, err = readSide(meas, l.in); err != nil {
			return row, fmt.Errorf("in-place: %w", err)
		}
	case l.perSide > 0 && len(meas) >= l.perSide && len(meas) < need && l.in.max() >= 0:
		// nccl-tests leaves the out-of-place side blank when it only runs in place.
		row.OutOfPlace = nanResult()
		if row.InPlace, err = readSide(meas, l.in.shift(l.perSide)); err != nil {
			return row, fmt.Errorf("in-place: %w", err)
		}
	default:
		return row, fmt.Errorf("row has %d measurement columns, header has %d", len(meas), need)
	}
	return row, nil
}

// ParseNCCL reads the stdout of one nccl-tests binary. It accepts the table with or
// without the banner, `#` comments, NCCL INFO/WARN lines interleaved, launcher prefixes
// on every line, nan/N/A values, and files that stop early (Truncated/Aborted are set
// rather than failing). A line that starts like a table row but does not parse is an
// error naming the file and line.
func ParseNCCL(name string, r io.Reader) (*NCCLRun, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("nccl-tests %s: read: %w", name, err)
	}
	run := &NCCLRun{File: name}
	layout := defaultLayout
	sawHeader := false
	concluded := false
	endsInNewline := len(data) == 0 || data[len(data)-1] == '\n'
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	lineNo := 0
	lines := bytes.Count(data, []byte{'\n'})
	if !endsInNewline {
		lines++
	}
	for sc.Scan() {
		lineNo++
		raw := sc.Text()
		s := stripLine(raw)
		if s == "" {
			continue
		}
		if strings.HasPrefix(s, "#") {
			body := strings.TrimSpace(strings.TrimLeft(s, "#"))
			switch {
			case strings.HasPrefix(body, "Collective test starting:"):
				if m := collectiveRe().FindStringSubmatch(body); m != nil {
					run.Collective = m[1]
				}
			case strings.HasPrefix(body, "Collective test concluded"):
				concluded = true
			case strings.HasPrefix(body, "nccl-tests version"):
				if f := strings.Fields(body); len(f) >= 3 {
					run.Version = f[2]
				}
			case strings.HasPrefix(body, "Avg bus bandwidth"):
				v, err := footerValue(body)
				if err != nil {
					return nil, fmt.Errorf("nccl-tests %s:%d: avg bus bandwidth: %w", name, lineNo, err)
				}
				run.AvgBusBW = &v
			case strings.HasPrefix(body, "Out of bounds values"):
				v, err := footerValue(body)
				if err != nil || v != math.Trunc(v) {
					return nil, fmt.Errorf("nccl-tests %s:%d: out of bounds values: not a count", name, lineNo)
				}
				n := int(v)
				run.OutOfBounds = &n
			case strings.HasPrefix(body, "error:"):
				if run.Aborted == "" && strings.TrimSpace(strings.TrimPrefix(body, "error:")) != "" {
					run.Aborted, run.AbortedLine = s, lineNo
				}
			default:
				f := strings.Fields(body)
				if len(f) > 0 && f[0] == "size" {
					l, ok := layoutFromHeader(f)
					if !ok {
						return nil, fmt.Errorf("nccl-tests %s:%d: column header without busbw: %q", name, lineNo, s)
					}
					layout, sawHeader = l, true
					run.Header = f
				}
			}
			continue
		}
		f := strings.Fields(s)
		if _, err := strconv.ParseInt(f[0], 10, 64); err != nil {
			// Banner, echoed command, NCCL INFO lines, launcher chatter: not the table.
			if run.Collective == "" {
				if m := collectiveRe().FindStringSubmatch(s); m != nil && knownCollective(m[1]) {
					run.Collective = m[1]
				}
			}
			if run.Aborted == "" && abortLine(s) {
				run.Aborted, run.AbortedLine = s, lineNo
			}
			continue
		}
		if !sawHeader && len(run.Rows) == 0 {
			layout = guessLayout(f)
		}
		row, err := layout.parseRow(f)
		if err != nil {
			if lineNo == lines && !endsInNewline {
				run.Truncated = true
				break
			}
			return nil, fmt.Errorf("nccl-tests %s:%d: %w", name, lineNo, err)
		}
		row.Line = lineNo
		run.Rows = append(run.Rows, row)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("nccl-tests %s:%d: %w", name, lineNo+1, err)
	}
	if run.AvgBusBW == nil && !concluded {
		run.Truncated = true
	} else if !run.Truncated {
		// A run that printed its footer finished; a failure line before it was one NCCL
		// recovered from (a transport it fell back from), not the end of the run.
		run.Aborted, run.AbortedLine = "", 0
	}
	if len(run.Rows) == 0 && run.Aborted == "" {
		return nil, fmt.Errorf("nccl-tests %s: no result rows", name)
	}
	return run, nil
}

// guessLayout is for a table whose header line was cut off: count the columns.
func guessLayout(tok []string) ncclLayout {
	l := defaultLayout
	n := len(tok) - 3
	if n > 0 {
		if _, err := parseFloat(tok[3]); err != nil {
			n-- // a redop
		} else {
			l.hasRedop = false
		}
	}
	if n%4 == 0 {
		l.hasRoot = false
	}
	return l
}

func footerValue(body string) (float64, error) {
	_, v, ok := strings.Cut(body, ":")
	if !ok {
		return 0, fmt.Errorf("no value")
	}
	f := strings.Fields(v)
	if len(f) == 0 {
		return 0, fmt.Errorf("no value")
	}
	x, err := parseFloat(f[0])
	if err != nil {
		return 0, fmt.Errorf("%q is not a number", f[0])
	}
	return x, nil
}

// Collectives nccl-tests ships a binary for; the five of B300.md step 4 come first.
var collectives = []string{
	"all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv",
	"broadcast", "reduce", "gather", "scatter", "hypercube",
}

func knownCollective(s string) bool {
	for _, c := range collectives {
		if c == s {
			return true
		}
	}
	return false
}

// collectiveFromName finds a collective in a file name, ignoring '_' and '-' so that
// "allreduce", "all-reduce" and "all_reduce" all count; the longest match wins, so
// "reduce_scatter" is not taken for "reduce".
func collectiveFromName(base string) string {
	norm := strings.NewReplacer("_", "", "-", "").Replace(strings.ToLower(base))
	best := ""
	for _, c := range collectives {
		if strings.Contains(norm, strings.ReplaceAll(c, "_", "")) && len(c) > len(best) {
			best = c
		}
	}
	return best
}
