// Package qemutest boots the real initramfs on Debian's kernel under QEMU (TCG) with a
// vIOMMU, B300-shaped emulated PCIe switches and a swtpm TPM, and reads back what the
// guest reports over the serial console (the protocol the boot stage implements:
// file blocks, PASSAGE-DONE, PASSAGE-T timeline markers).
package qemutest

import (
	"bufio"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Report is what the guest said on its console.
type Report struct {
	Files   map[string][]byte  // decoded file blocks, by name, size and sha256 verified
	Done    string             // PASSAGE-DONE summary: ok, degraded or failed; "" if never seen
	Markers map[string]float64 // PASSAGE-T events: seconds since kernel start (guest /proc/uptime)
	// HostAt is the host time (since the console's first byte was read) at which each
	// marker, "done" and "first-line" arrived; set only by a live read.
	HostAt map[string]time.Duration
	Errors []error // malformed or corrupted blocks, each naming the file
}

var (
	beginRE  = regexp.MustCompile(`===PASSAGE-FILE-BEGIN (\S+) ([0-9]+) ([0-9a-f]{64})===`)
	endRE    = regexp.MustCompile(`===PASSAGE-FILE-END (\S+)===`)
	doneRE   = regexp.MustCompile(`===PASSAGE-DONE (ok|degraded|failed)===`)
	markerRE = regexp.MustCompile(`PASSAGE-T ([a-z][a-z0-9-]*) ([0-9]+\.[0-9]{3})\b`)
	b64Line  = regexp.MustCompile(`^[A-Za-z0-9+/]+={0,2}$`)
)

// maxFileSize bounds one decoded block: a manifest or log is kilobytes; a runaway guest
// must not make the harness hold gigabytes.
const maxFileSize = 64 << 20

type block struct {
	name string
	size int
	sum  string
	b64  strings.Builder
}

// consoleParser is the line-by-line state machine ParseConsole and the live reader share.
type consoleParser struct {
	rep   *Report
	cur   *block
	start time.Time
	now   func() time.Time
}

func newParser(now func() time.Time) *consoleParser {
	p := &consoleParser{
		rep: &Report{Files: map[string][]byte{}, Markers: map[string]float64{}, HostAt: map[string]time.Duration{}},
		now: now,
	}
	if now != nil {
		p.start = now()
	}
	return p
}

func (p *consoleParser) stamp(key string) {
	if p.now == nil {
		return
	}
	if _, ok := p.rep.HostAt[key]; !ok {
		p.rep.HostAt[key] = p.now().Sub(p.start)
	}
}

// line takes one console line. Kernel messages may interleave with the guest's
// output: inside a block only lines of the base64 alphabet count, and the size and
// sha256 in the BEGIN line catch any damage.
func (p *consoleParser) line(s string) {
	s = strings.TrimRight(s, "\r")
	p.stamp("first-line")
	if m := beginRE.FindStringSubmatch(s); m != nil {
		if p.cur != nil {
			p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: no END before BEGIN of %s", p.cur.name, m[1]))
		}
		size, err := strconv.Atoi(m[2])
		if err != nil || size > maxFileSize {
			p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: bad size %s", m[1], m[2]))
			p.cur = nil
			return
		}
		p.cur = &block{name: m[1], size: size, sum: m[3]}
		return
	}
	if m := endRE.FindStringSubmatch(s); m != nil {
		p.end(m[1])
		return
	}
	if p.cur != nil {
		if t := strings.TrimSpace(s); b64Line.MatchString(t) {
			if p.cur.b64.Len() > maxFileSize*4/3+4 {
				p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: more data than %d bytes", p.cur.name, p.cur.size))
				p.cur = nil
				return
			}
			p.cur.b64.WriteString(t)
		}
		return
	}
	if m := doneRE.FindStringSubmatch(s); m != nil {
		if p.rep.Done == "" {
			p.rep.Done = m[1]
			p.stamp("done")
		}
		return
	}
	if m := markerRE.FindStringSubmatch(s); m != nil {
		if _, ok := p.rep.Markers[m[1]]; !ok {
			v, _ := strconv.ParseFloat(m[2], 64)
			p.rep.Markers[m[1]] = v
			p.stamp(m[1])
		}
	}
}

func (p *consoleParser) end(name string) {
	b := p.cur
	p.cur = nil
	if b == nil {
		p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: END without BEGIN", name))
		return
	}
	if b.name != name {
		p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: END names %s", b.name, name))
		return
	}
	data, err := base64.StdEncoding.DecodeString(b.b64.String())
	if err != nil {
		p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: base64: %w", name, err))
		return
	}
	if len(data) != b.size {
		p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: %d bytes, BEGIN said %d", name, len(data), b.size))
		return
	}
	sum := sha256.Sum256(data)
	if got := hex.EncodeToString(sum[:]); got != b.sum {
		p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: sha256 %s, BEGIN said %s", name, got, b.sum))
		return
	}
	if _, dup := p.rep.Files[name]; dup {
		p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: sent twice", name))
		return
	}
	p.rep.Files[name] = data
}

func (p *consoleParser) finish() *Report {
	if p.cur != nil {
		p.rep.Errors = append(p.rep.Errors, fmt.Errorf("console file %s: no END before the console closed", p.cur.name))
		p.cur = nil
	}
	return p.rep
}

// ParseConsole reads a whole console log. Malformed blocks land in Report.Errors; the
// error return is only for a failed read.
func ParseConsole(r io.Reader) (*Report, error) {
	p := newParser(nil)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		p.line(sc.Text())
	}
	if err := sc.Err(); err != nil {
		return p.finish(), fmt.Errorf("console: %w", err)
	}
	return p.finish(), nil
}

// Timeline renders the boot timeline: kernel start (guest uptime 0) to each marker in
// guest time, in time order.
func (r *Report) Timeline() string {
	type ev struct {
		name string
		t    float64
	}
	evs := []ev{{"kernel-start", 0}}
	for n, t := range r.Markers {
		evs = append(evs, ev{n, t})
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].t < evs[j].t })
	var b strings.Builder
	prev := 0.0
	for _, e := range evs {
		fmt.Fprintf(&b, "  %-18s %7.3f s  (+%.3f s)\n", e.name, e.t, e.t-prev)
		prev = e.t
	}
	return b.String()
}
