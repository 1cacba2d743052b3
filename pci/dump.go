package pci

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// maxDumpLine bounds one line of a dump; lspci's own lines are under 200 bytes, and the
// -vvv text around the hex never reaches this.
const maxDumpLine = 64 << 10

// MaxDumpSize bounds a whole dump. lspci -vvvxxxx of a big node (thousands of functions
// with their 4096 bytes each) is a few MB; a larger input is no lspci dump.
const MaxDumpSize = 64 << 20

// maxDumpFunctions bounds the functions of one dump: 65536 is a whole PCI domain (256
// buses of 256 functions), beyond any node, and each function held costs memory.
const maxDumpFunctions = 1 << 16

// maxDumpDamage is how many damaged hex lines of one function are named one by one; the
// rest are counted.
const maxDumpDamage = 4

// errTooLarge is what boundedReader returns past MaxDumpSize.
var errTooLarge = fmt.Errorf("larger than %d MiB: not an lspci dump", MaxDumpSize>>20)

// boundedReader reads at most left bytes of r, and fails when r holds more.
type boundedReader struct {
	r    io.Reader
	left int64
}

func (b *boundedReader) Read(p []byte) (int, error) {
	if b.left <= 0 {
		var one [1]byte
		for range 100 { // as bufio gives up on a reader that returns nothing
			n, err := b.r.Read(one[:])
			switch {
			case n > 0:
				return 0, errTooLarge
			case err != nil:
				return 0, err
			}
		}
		return 0, io.ErrNoProgress
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	return n, err
}

// dumpFn is one function of a dump while it is read.
type dumpFn struct {
	d      *Device
	data   []byte // 0xff where no line set a byte: lspci -F reads a gap the same
	n      int    // one past the highest offset set: lspci's dd->len
	next   int    // where the next hex line should start: the bytes so far are contiguous
	hex    bool   // a hex line was seen: the -v text before the hex is over
	damage int    // damaged lines
	first  string // the first damage, for CapsUnknown
	gapStd bool   // bytes below 0x100 missing or unreadable
	gapExt bool   // bytes from 0x100 missing or unreadable
}

func (f *dumpFn) damaged(line int, format string, args ...any) {
	f.damage++
	if f.damage > maxDumpDamage {
		return
	}
	p := fmt.Sprintf("dump line %d: ", line) + fmt.Sprintf(format, args...)
	if f.first == "" {
		f.first = p
	}
	f.d.Problems = append(f.d.Problems, p)
}

// gap records that bytes [from, to) are missing.
func (f *dumpFn) gap(from, to int) {
	if from < ConventionalSize {
		f.gapStd = true
	}
	if to > ConventionalSize {
		f.gapExt = true
	}
}

func (f *dumpFn) set(off int, v byte) {
	if off >= len(f.data) {
		size := ConventionalSize
		if off >= ConventionalSize {
			size = ExtendedSize
		}
		grown := make([]byte, size)
		n := copy(grown, f.data)
		for i := n; i < size; i++ {
			grown[i] = 0xff
		}
		f.data = grown
	}
	f.data[off] = v
	if off >= f.n {
		f.n = off + 1
	}
}

// ParseDump reads pciutils' dump format, the output of lspci -x, -xxx or -xxxx (with or
// without -v text around the hex), as lspci -F reads it (lib/dump.c): a line starting
// "BB:DD.F " or "DDDD:BB:DD.F " opens a function, "OO: xx xx ..." lines fill its config
// space at offset OO, an empty line closes it, and anything else is ignored. The tree is
// rebuilt from the bridges' bus numbers (NewTree), the way lspci -t does for a dump.
//
// A dump holds no sysfs data: NUMANode and IOMMUGroup are -1, Driver is empty.
//
// Input that is no dump is an error: more than MaxDumpSize bytes, a line longer than
// 64 KiB, a read error, no function line at all (empty input, garbage), function lines
// without any hex (lspci without -x), more than 65536 functions. A dump that is one but
// damaged is read, and says where: lspci writes each function's hex as lines of 16 bytes
// at offsets 0, 0x10, 0x20 ... up to a blank line, so a hex line at another offset than
// the one due (lines missing, repeated or shifted), a byte or a line inside the hex that
// is not hex, and a block that stops short are problems of that function, naming the
// dump line; hex lines outside any function (the head of the dump cut off, a blank line
// inside a block) are a problem of the tree. The rest of the dump is usable and kept:
// Tree.Err reports the damage. Bytes a damaged function's lines leave out read 0xff, as
// lspci -F reads them; where they fall below 0x100 the function's CapsUnknown is set,
// from 0x100 its ExtCapsUnknown.
func ParseDump(r io.Reader) (*Tree, error) {
	sc := bufio.NewScanner(&boundedReader{r: r, left: MaxDumpSize})
	sc.Buffer(make([]byte, 4096), maxDumpLine)
	var (
		fns      []*dumpFn
		cur      *dumpFn
		skipping bool // inside the block of a function skipped (listed again, not representable)
		seen     = map[Address]bool{}
		tree     = &Tree{}
		line     int
		fnLines  int // lines that open a function, kept or skipped
		hexLines int // hex lines inside a function's block

		outFrom, outN int // a run of hex lines outside any function
	)
	flushOutside := func() {
		switch {
		case outN == 1:
			tree.Problems = append(tree.Problems, fmt.Sprintf("dump line %d: hex line outside any function, ignored (the dump cut, or a blank line inside a function's block?)", outFrom))
		case outN > 1:
			tree.Problems = append(tree.Problems, fmt.Sprintf("dump lines %d-%d: %d hex lines outside any function, ignored (the dump cut, or a blank line inside a function's block?)", outFrom, outFrom+outN-1, outN))
		}
		outN = 0
	}
	for sc.Scan() {
		line++
		s := strings.TrimSuffix(sc.Text(), "\r")
		off, rest, isHexLine := dumpHexLine(s)
		if cur == nil && !skipping && isHexLine {
			if outN == 0 {
				outFrom = line
			}
			outN++
			continue
		}
		flushOutside()
		if s == "" {
			cur, skipping = nil, false
			continue
		}
		if a, isDev, ok := dumpDeviceLine(s); isDev {
			fnLines++
			cur, skipping = nil, true
			switch {
			case !ok:
				tree.Problems = append(tree.Problems, fmt.Sprintf("dump line %d: function %q not representable, skipped", line, strings.Fields(s)[0]))
			case seen[a]:
				tree.Problems = append(tree.Problems, fmt.Sprintf("%s: listed again at line %d, second copy ignored", a, line))
			case len(fns) == maxDumpFunctions:
				return nil, fmt.Errorf("pci dump: line %d: more than %d functions: not a node's dump", line, maxDumpFunctions)
			default:
				seen[a] = true
				cur, skipping = &dumpFn{d: &Device{Addr: a, NUMANode: -1, IOMMUGroup: -1}}, false
				fns = append(fns, cur)
			}
			continue
		}
		if skipping {
			if isHexLine {
				hexLines++
			}
			continue
		}
		if cur == nil {
			continue // text between functions, as lspci -F ignores it
		}
		if !isHexLine {
			if cur.hex {
				cur.damaged(line, "not a hex line inside the config space hex: %.40q", s)
			}
			continue
		}
		cur.hex = true
		hexLines++
		if off != cur.next {
			cur.damaged(line, "offset 0x%x where 0x%x was due", off, cur.next)
			if off > cur.next {
				cur.gap(cur.next, off)
			}
		}
		for len(rest) >= 2 && isHex(rest[0]) && isHex(rest[1]) && (len(rest) == 2 || rest[2] == ' ') {
			if off >= ExtendedSize {
				cur.damaged(line, "offset 0x%x past 4096 bytes", off)
				rest = ""
				break
			}
			v, _ := strconv.ParseUint(rest[:2], 16, 8)
			cur.set(off, byte(v))
			off++
			rest = rest[2:]
			if len(rest) > 0 {
				rest = rest[1:]
			}
		}
		if f := strings.Fields(rest); len(f) > 0 {
			cur.damaged(line, "%q is not a hex byte", f[0])
		}
		cur.next = off
	}
	flushOutside()
	if err := sc.Err(); err != nil {
		switch {
		case errors.Is(err, errTooLarge):
			return nil, fmt.Errorf("pci dump: %w", err)
		case errors.Is(err, bufio.ErrTooLong):
			return nil, fmt.Errorf("pci dump: line %d longer than %d bytes", line+1, maxDumpLine)
		}
		return nil, fmt.Errorf("pci dump: line %d: %w", line+1, err)
	}
	switch {
	case fnLines == 0:
		return nil, errors.New("pci dump: no PCI function in it (not lspci -x output?)")
	case hexLines == 0:
		return nil, fmt.Errorf("pci dump: %d functions listed but no config space in hex (lspci without -x? capture with lspci -xxxx)", fnLines)
	}
	devs := make([]*Device, 0, len(fns))
	for _, f := range fns {
		d := f.d
		d.Config = Config(f.data[:f.n])
		d.decodeConfig()
		for i, p := range d.Problems {
			if p == problemNotRoot {
				d.Problems[i] = problemDump64
			}
		}
		if d.CapsUnknown == problemNotRoot {
			d.CapsUnknown = problemDump64
		}
		if d.ExtCapsUnknown == problemNotRoot {
			d.ExtCapsUnknown = problemDump64
		}
		if f.damage > maxDumpDamage {
			d.problem("dump: %d more damaged hex lines", f.damage-maxDumpDamage)
		}
		if f.gapStd && d.CapsUnknown == "" {
			d.CapsUnknown = f.first
		}
		if (f.gapExt || f.gapStd && !d.ExpressKnown()) && d.ExtCapsUnknown == "" {
			d.ExtCapsUnknown = f.first
		}
		if d.Express != nil && len(d.Config) == ConventionalSize {
			// lspci -xxx stops at 256 bytes, where an Express function's ACS, ATS and
			// SR-IOV capabilities are not.
			d.problem(problemDump256)
			if d.ExtCapsUnknown == "" {
				d.ExtCapsUnknown = problemDump256
			}
		}
		devs = append(devs, d)
	}
	t := NewTree(devs)
	t.Problems = append(tree.Problems, t.Problems...)
	t.NoGroups = DumpNoGroups
	return t, nil
}

// DumpNoGroups is Tree.NoGroups of a dump.
const DumpNoGroups = "an lspci dump carries config space only, no IOMMU groups"

// The problems of a dump that holds less config space than lspci -xxxx writes.
const (
	problemDump64  = "dump holds only 64 bytes of config space (lspci -x; capture with -xxxx)"
	problemDump256 = "dump holds only 256 bytes of config space of a PCI Express function: its extended capabilities (ACS, ATS, SR-IOV) are not in it (lspci -xxx; capture with -xxxx)"
)

// ReadDump is ParseDump on a file; a file larger than MaxDumpSize is refused unread.
func ReadDump(name string) (*Tree, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("pci dump: %w", err)
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Mode().IsRegular() && st.Size() > MaxDumpSize {
		return nil, fmt.Errorf("%s: pci dump: %w", name, errTooLarge)
	}
	t, err := ParseDump(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return t, nil
}

func isHex(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

// matchMask is lib/dump.c's dump_validate: '#' is a hex digit, anything else itself.
func matchMask(s, mask string) bool {
	if len(s) < len(mask) {
		return false
	}
	for i := 0; i < len(mask); i++ {
		if mask[i] == '#' {
			if !isHex(s[i]) {
				return false
			}
		} else if s[i] != mask[i] {
			return false
		}
	}
	return true
}

// dumpDeviceLine recognises the line that opens a function. lspci accepts 4 to 6 domain
// digits (domains above 0xffff exist on some hosts, but Address holds 16 bits, so only
// those that fit are taken).
func dumpDeviceLine(s string) (a Address, isDev, ok bool) {
	var bdf string
	switch {
	case matchMask(s, "##:##.# "):
		bdf = s[:7]
	case matchMask(s, "####:##:##.# "):
		bdf = s[:12]
	case matchMask(s, "#####:##:##.# "):
		if s[0] != '0' {
			return a, true, false
		}
		bdf = s[1:13]
	case matchMask(s, "######:##:##.# "):
		if s[:2] != "00" {
			return a, true, false
		}
		bdf = s[2:14]
	default:
		return a, false, false
	}
	a, err := ParseAddress(bdf)
	return a, true, err == nil
}

// dumpHexLine splits "OO: xx xx ..." or "OOO: xx ..." into the offset and the bytes.
func dumpHexLine(s string) (int, string, bool) {
	var n int
	switch {
	case matchMask(s, "##: "):
		n = 2
	case matchMask(s, "###: "):
		n = 3
	default:
		return 0, "", false
	}
	off, err := strconv.ParseUint(s[:n], 16, 16)
	if err != nil {
		return 0, "", false
	}
	return int(off), s[n+2:], true
}
