package emit

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Report is what the guest said on its console.
type Report struct {
	Files   map[string][]byte  // decoded file blocks, by name, size and sha256 verified
	Done    string             // PASSAGE-DONE summary: ok, degraded or failed; "" if never seen
	Markers map[string]float64 // PASSAGE-T events: seconds since kernel start (guest /proc/uptime); -1 = unknown
	// HostAt is the host time (since NewParser) at which each marker, "done" and
	// "first-line" arrived; empty unless the parser was given a clock.
	HostAt map[string]time.Duration
	Errors []error // malformed or corrupted blocks, each naming the file
}

// The decoder finds protocol lines anywhere in a console line: a printk or a partial
// line from another writer may sit in front of one. Patterns come from emit.go's words.
// They are compiled on a parser's first use, not at package init: passage links this
// package for the writer side, and every passage process (passage help too) would pay
// for compiling what only a reader of a console uses.
type patterns struct {
	begin, end, done, marker, b64Line *regexp.Regexp
}

var parsePatterns = sync.OnceValue(func() *patterns {
	return &patterns{
		begin: regexp.MustCompile(regexp.QuoteMeta(beginPrefix) +
			`(` + namePattern + `) ([0-9]+) ([0-9a-f]{64})` + regexp.QuoteMeta(closer)),
		end:     regexp.MustCompile(regexp.QuoteMeta(endPrefix) + `(\S+)` + regexp.QuoteMeta(closer)),
		done:    regexp.MustCompile(regexp.QuoteMeta(donePrefix) + `(` + strings.Join(summaries, "|") + `)` + regexp.QuoteMeta(closer)),
		marker:  regexp.MustCompile(regexp.QuoteMeta(markPrefix) + `(` + eventPattern + `) (-?[0-9]+\.[0-9]{3})\b`),
		b64Line: regexp.MustCompile(`^[A-Za-z0-9+/]+={0,2}$`),
	}
})

// maxFileSize bounds one decoded block: a manifest or log is kilobytes; a runaway guest
// must not make the reader hold gigabytes.
const maxFileSize = 64 << 20

// maxLine bounds one console line Parse holds. The longest protocol line is a BEGIN
// with a 255-byte name; anything far longer is noise and is dropped.
const maxLine = 1 << 20

type block struct {
	name     string
	size     int
	sum      string
	b64      strings.Builder
	overflow bool // more base64 than the BEGIN line's size encodes to
}

// Parser is the console protocol's decoder, fed one line at a time (a live console or
// Parse). It never fails: damage lands in Report.Errors.
type Parser struct {
	rep   *Report
	cur   *block
	start time.Time
	now   func() time.Time
}

// NewParser returns a parser. With now set, the report's HostAt says when markers, the
// PASSAGE-DONE line and the first line arrived, counted from this call.
func NewParser(now func() time.Time) *Parser {
	p := &Parser{
		rep: &Report{Files: map[string][]byte{}, Markers: map[string]float64{}, HostAt: map[string]time.Duration{}},
		now: now,
	}
	if now != nil {
		p.start = now()
	}
	return p
}

// Report is the report so far; the parser keeps adding to it until Finish.
func (p *Parser) Report() *Report { return p.rep }

func (p *Parser) stamp(key string) {
	if p.now == nil {
		return
	}
	if _, ok := p.rep.HostAt[key]; !ok {
		p.rep.HostAt[key] = p.now().Sub(p.start)
	}
}

func (p *Parser) errorf(format string, args ...any) {
	p.rep.Errors = append(p.rep.Errors, fmt.Errorf(format, args...))
}

// Line takes one console line, with or without its line ending. Kernel messages may
// interleave with the guest's output: inside a block only lines of the base64
// alphabet count, and the size and sha256 in the BEGIN line catch any damage.
// PASSAGE-DONE and markers count wherever they appear, the first of each name winning.
func (p *Parser) Line(s string) {
	s = strings.TrimRight(s, "\r\n")
	p.stamp("first-line")
	if strings.Contains(s, beginPrefix) {
		p.begin(s)
		return
	}
	if p.cur != nil && strings.Contains(s, endPrefix+p.cur.name+closer) {
		p.end(p.cur.name)
		return
	}
	if m := parsePatterns().end.FindStringSubmatch(s); m != nil {
		p.end(m[1])
		return
	}
	if m := parsePatterns().done.FindStringSubmatch(s); m != nil {
		if p.rep.Done == "" {
			p.rep.Done = m[1]
			p.stamp("done")
		}
		return
	}
	if m := parsePatterns().marker.FindStringSubmatch(s); m != nil {
		if _, ok := p.rep.Markers[m[1]]; !ok {
			v, err := strconv.ParseFloat(m[2], 64)
			if err != nil {
				p.errorf("console marker %s: time %q: %w", m[1], m[2], err)
				return
			}
			p.rep.Markers[m[1]] = v
			p.stamp(m[1])
		}
		return
	}
	if p.cur == nil || p.cur.overflow {
		return
	}
	t := strings.TrimSpace(s)
	if len(t) > lineWidth || !parsePatterns().b64Line.MatchString(t) {
		return
	}
	if p.cur.b64.Len()+len(t) > base64.StdEncoding.EncodedLen(p.cur.size) {
		p.cur.overflow = true
		return
	}
	p.cur.b64.WriteString(t)
}

func (p *Parser) begin(s string) {
	if p.cur != nil {
		p.errorf("console file %s: no END before the next BEGIN", p.cur.name)
		p.cur = nil
	}
	m := parsePatterns().begin.FindStringSubmatch(s)
	if m == nil {
		rest := s[strings.Index(s, beginPrefix)+len(beginPrefix):]
		name, _, _ := strings.Cut(rest, " ")
		p.errorf("console file %q: malformed BEGIN line %q", strings.TrimSuffix(name, closer), s)
		return
	}
	name := m[1]
	if !validName(name) {
		p.errorf("console file %q: not a file name", name)
		return
	}
	size, err := strconv.Atoi(m[2])
	if err != nil || size > maxFileSize {
		p.errorf("console file %s: bad size %s (at most %d)", name, m[2], maxFileSize)
		return
	}
	p.cur = &block{name: name, size: size, sum: m[3]}
}

func (p *Parser) end(name string) {
	b := p.cur
	p.cur = nil
	if b == nil {
		p.errorf("console file %s: END without BEGIN", name)
		return
	}
	if b.name != name {
		p.errorf("console file %s: END names %s", b.name, name)
		return
	}
	if b.overflow {
		p.errorf("console file %s: more data than the %d bytes BEGIN said", name, b.size)
		return
	}
	data, err := base64.StdEncoding.DecodeString(b.b64.String())
	if err != nil {
		p.errorf("console file %s: base64: %w", name, err)
		return
	}
	if len(data) != b.size {
		p.errorf("console file %s: %d bytes, BEGIN said %d", name, len(data), b.size)
		return
	}
	sum := sha256.Sum256(data)
	if got := hex.EncodeToString(sum[:]); got != b.sum {
		p.errorf("console file %s: sha256 %s, BEGIN said %s", name, got, b.sum)
		return
	}
	if _, dup := p.rep.Files[name]; dup {
		p.errorf("console file %s: sent twice", name)
		return
	}
	p.rep.Files[name] = data
}

// Finish ends the console: a block still open is an error. It returns the report.
func (p *Parser) Finish() *Report {
	if p.cur != nil {
		p.errorf("console file %s: no END before the console closed", p.cur.name)
		p.cur = nil
	}
	return p.rep
}

// Parse reads a whole console capture. Damaged blocks land in Report.Errors; the error
// return is only for a failed read (with the report of what came before it).
func Parse(r io.Reader) (*Report, error) {
	p := NewParser(nil)
	br := bufio.NewReaderSize(r, 64<<10)
	var line []byte
	long := false
	for {
		chunk, err := br.ReadSlice('\n')
		if !long {
			line = append(line, chunk...)
			if len(line) > maxLine {
				long, line = true, line[:0]
			}
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if len(chunk) > 0 || len(line) > 0 {
			if !long {
				p.Line(string(bytes.TrimSuffix(line, []byte("\n"))))
			}
		}
		line, long = line[:0], false
		if err == io.EOF {
			return p.Finish(), nil
		}
		if err != nil {
			return p.Finish(), fmt.Errorf("console: read: %w", err)
		}
	}
}

// Timeline renders the boot timeline: kernel start (guest uptime 0) to each marker in
// guest time, in time order; markers of unknown time come last.
func (r *Report) Timeline() string {
	type ev struct {
		name string
		t    float64
	}
	evs := []ev{{"kernel-start", 0}}
	var unknown []string
	for n, t := range r.Markers {
		if t < 0 {
			unknown = append(unknown, n)
			continue
		}
		evs = append(evs, ev{n, t})
	}
	sort.SliceStable(evs, func(i, j int) bool {
		if evs[i].t != evs[j].t {
			return evs[i].t < evs[j].t
		}
		return evs[i].name == "kernel-start" || (evs[j].name != "kernel-start" && evs[i].name < evs[j].name)
	})
	sort.Strings(unknown)
	var b strings.Builder
	prev := 0.0
	for _, e := range evs {
		fmt.Fprintf(&b, "  %-18s %7.3f s  (+%.3f s)\n", e.name, e.t, e.t-prev)
		prev = e.t
	}
	for _, n := range unknown {
		fmt.Fprintf(&b, "  %-18s   ?     s  (uptime unreadable)\n", n)
	}
	return b.String()
}
