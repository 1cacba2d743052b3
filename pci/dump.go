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

// ParseDump reads pciutils' dump format, the output of lspci -x, -xxx or -xxxx (with or
// without -v text around the hex), as lspci -F reads it (lib/dump.c): a line starting
// "BB:DD.F " or "DDDD:BB:DD.F " opens a function, "OO: xx xx ..." lines fill its config
// space at offset OO, an empty line closes it, and anything else is ignored. The tree is
// rebuilt from the bridges' bus numbers (NewTree), the way lspci -t does for a dump.
//
// A dump holds no sysfs data: NUMANode and IOMMUGroup are -1, Driver is empty. What is
// wrong with one function (a short dump, a bad capability list) is in its Problems; an
// unreadable input is an error naming the line.
func ParseDump(r io.Reader) (*Tree, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), maxDumpLine)
	type fnData struct {
		d    *Device
		data []byte
		n    int // bytes seen: lspci's dd->len, one past the highest offset filled
	}
	var (
		fns  []*fnData
		cur  *fnData
		seen = map[Address]bool{}
		tree = &Tree{}
		line int
	)
	for sc.Scan() {
		line++
		s := strings.TrimSuffix(sc.Text(), "\r")
		if s == "" {
			cur = nil
			continue
		}
		if a, isDev, ok := dumpDeviceLine(s); isDev {
			if !ok {
				tree.Problems = append(tree.Problems, fmt.Sprintf("dump line %d: function %q not representable, skipped", line, strings.Fields(s)[0]))
				cur = nil
				continue
			}
			if seen[a] {
				tree.Problems = append(tree.Problems, fmt.Sprintf("%s: listed again at line %d, second copy ignored", a, line))
				cur = nil
				continue
			}
			seen[a] = true
			cur = &fnData{d: &Device{Addr: a, NUMANode: -1, IOMMUGroup: -1}, data: make([]byte, ConventionalSize)}
			fns = append(fns, cur)
			continue
		}
		if cur == nil {
			continue
		}
		off, rest, ok := dumpHexLine(s)
		if !ok {
			continue
		}
		for len(rest) >= 2 && isHex(rest[0]) && isHex(rest[1]) && (len(rest) == 2 || rest[2] == ' ') {
			if off >= ExtendedSize {
				cur.d.problem("dump line %d: offset 0x%x past 4096 bytes", line, off)
				break
			}
			if off >= len(cur.data) {
				grown := make([]byte, ExtendedSize)
				copy(grown, cur.data)
				cur.data = grown
			}
			v, _ := strconv.ParseUint(rest[:2], 16, 8)
			cur.data[off] = byte(v)
			off++
			if off > cur.n {
				cur.n = off
			}
			rest = rest[2:]
			if len(rest) > 0 {
				rest = rest[1:]
			}
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("pci dump: line %d longer than %d bytes", line+1, maxDumpLine)
		}
		return nil, fmt.Errorf("pci dump: line %d: %w", line+1, err)
	}
	devs := make([]*Device, 0, len(fns))
	for _, f := range fns {
		d := f.d
		d.Config = Config(f.data[:f.n])
		d.decodeConfig()
		for i, p := range d.Problems {
			if p == problemNotRoot {
				d.Problems[i] = "dump holds only 64 bytes of config space (lspci -x; capture with -xxxx)"
			}
		}
		devs = append(devs, d)
	}
	t := NewTree(devs)
	t.Problems = append(tree.Problems, t.Problems...)
	return t, nil
}

// ReadDump is ParseDump on a file.
func ReadDump(name string) (*Tree, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("pci dump: %w", err)
	}
	defer f.Close()
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
