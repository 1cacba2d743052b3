package apply

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// ACSSetting is one entry of a pci=config_acs= argument.
type ACSSetting struct {
	Mask, Flags pci.ACSBits
	Entry       string // as the argument spells it ("1x11101@0000:05:00.0")
}

// Plans says whether the entry sets exactly what the plan's port does: the bits its mask
// covers, as topology.KernelArg renders the port.
func (s ACSSetting) Plans(p topology.ACSPort) bool {
	return s.Mask == p.Mask && s.Flags == p.Flags&p.Mask
}

// ConfigACS is a line's pci=config_acs= argument as the kernel reads it. The kernel
// keeps the last config_acs= it sees (pci_setup); for each function with an ACS
// capability, __pci_config_acs (drivers/pci/pci.c, Linux 6.11 and newer) then reads
// the entries in order and applies the first one that matches the function, ending
// the reading there: a later entry naming the same function, however spelled (by
// address, by a path of device.function hops from a root bus, by IDs), is never read.
type ConfigACS struct {
	Value string // after config_acs=
}

// ParseConfigACS finds the pci=config_acs= argument on a kernel command line; nil when
// the line has none.
func ParseConfigACS(cmdline string) *ConfigACS {
	v, ok := configACSValue(cmdline)
	if !ok {
		return nil
	}
	return &ConfigACS{Value: v}
}

// Reading is what the kernel does with the argument for one function.
type Reading struct {
	// Setting is the entry the kernel applies, when Set.
	Setting ACSSetting
	Set     bool
	// Why says, when no entry applies, where the kernel stopped reading (an entry it
	// could not parse, flags it refused) or why passage cannot tell (Unsure); "" when the
	// kernel read every entry and none names the function.
	Why    string
	Unsure bool
}

// maxFlagChars bounds the flag string passage models: __pci_config_acs shifts a C int
// by each character's position, which past 31 is undefined behaviour.
const maxFlagChars = 31

// For reads the argument for the function at a as __pci_config_acs does, matching
// entries as pci_dev_str_match does against the function t holds at a: its address,
// IDs and the bridges above it. Without the function (t nil, or a not in t), an entry
// naming functions by IDs or by a path reached before a match leaves the reading Unsure.
func (c *ConfigACS) For(t *pci.Tree, a pci.Address) Reading {
	if c == nil {
		return Reading{}
	}
	var d *pci.Device
	if t != nil {
		d = t.Lookup(a)
	}
	known := d != nil
	if !known {
		d = &pci.Device{Addr: a}
	}
	p := c.Value
	for p != "" {
		// The flags are what precedes the first '@' left in the argument (strstr),
		// read right to left: the rightmost character is bit 0.
		at := strings.IndexByte(p, '@')
		if at < 0 {
			return Reading{Why: fmt.Sprintf("the kernel stops at %q: no '@' (\"ACS Flags missing\")", p)}
		}
		flags := p[:at]
		if len(flags) > maxFlagChars {
			return Reading{Unsure: true, Why: fmt.Sprintf("the kernel's reading of %q is undefined: more than %d flag characters", flags, maxFlagChars)}
		}
		var s ACSSetting
		for i := len(flags) - 1; i >= 0; i-- {
			// Bits past 15 fall out of the kernel's u16 mask and flags.
			bit := pci.ACSBits(0)
			if shift := len(flags) - 1 - i; shift < 16 {
				bit = 1 << shift
			}
			switch flags[i] {
			case '1':
				s.Mask |= bit
				s.Flags |= bit
			case '0':
				s.Mask |= bit
			case 'x', 'X':
			default:
				return Reading{Why: fmt.Sprintf("the kernel stops at flags %q (\"Invalid ACS flags... Ignoring\")", flags)}
			}
		}
		if s.Mask&^configACSMask != 0 {
			return Reading{Why: fmt.Sprintf("the kernel stops at flags %q: a bit above DT (\"Invalid ACS flags specified\")", flags)}
		}
		spec := p[at+1:]
		m, rest := strMatch(d, known, spec)
		switch m {
		case matchUnsure:
			return Reading{Unsure: true, Why: fmt.Sprintf("entry %q names functions by IDs or by path, and %s is not a function of the scanned tree", p[:len(p)-len(rest)], a)}
		case matchInvalid:
			return Reading{Why: fmt.Sprintf("the kernel stops at %q (\"PCI: %s\")", p[:len(p)-len(rest)], logCantParse)}
		case matched:
			s.Entry = p[:len(p)-len(rest)]
			return Reading{Setting: s, Set: true}
		}
		if rest == "" || rest[0] != ';' && rest[0] != ',' {
			if rest != "" {
				return Reading{Why: fmt.Sprintf("the kernel stops at %q: not an entry separator", rest)}
			}
			break
		}
		p = rest[1:]
	}
	return Reading{}
}

// configACSMask are the controls pci=config_acs= may name (PCI_ACS_SV..PCI_ACS_DT).
const configACSMask = pci.ACSSV | pci.ACSTB | pci.ACSRR | pci.ACSCR | pci.ACSUF | pci.ACSEC | pci.ACSDT

type match int

const (
	noMatch match = iota
	matched
	matchInvalid // pci_dev_str_match's -EINVAL
	matchUnsure  // needs what passage was not given about the function
)

// strMatch is pci_dev_str_match (drivers/pci/pci.c): "pci:VVVV:DDDD[:SSSS:ssss]" names
// functions by IDs (0 matches any), anything else is pci_dev_str_match_path's
// "[DDDD:]BB:DD.F[/DD.F]..." up to the next ';'. rest is where the kernel goes on.
func strMatch(d *pci.Device, known bool, p string) (match, string) {
	if ids, ok := strings.CutPrefix(p, "pci:"); ok {
		v, n, count := kscanf(ids, "%hx:%hx:%hx:%hx%n")
		if n != 4 {
			if v, n, count = kscanf(ids, "%hx:%hx%n"); n != 2 {
				return matchInvalid, ""
			}
			v = append(v[:2], 0, 0)
		}
		rest := ids[count:]
		if !known {
			return matchUnsure, rest
		}
		want := []uint16{d.VendorID, d.DeviceID, d.SubsystemVendor, d.SubsystemDevice}
		for i, id := range v {
			if uint16(id) != 0 && uint16(id) != want[i] {
				return noMatch, rest
			}
		}
		return matched, rest
	}
	end := strings.IndexByte(p, ';')
	if end < 0 {
		end = len(p)
	}
	path, rest := p[:end], p[end:]
	dev := d
	for {
		i := strings.LastIndexByte(path, '/')
		if i < 0 {
			break
		}
		v, n, _ := kscanf(path[i:], "/%x.%x%c")
		if n != 2 {
			return matchInvalid, rest
		}
		if !known {
			return matchUnsure, rest
		}
		if devfn(dev.Addr) != kernelDevfn(v[0], v[1]) {
			return noMatch, rest
		}
		if dev = dev.Parent; dev == nil {
			return noMatch, rest
		}
		path = path[:i]
	}
	v, n, _ := kscanf(path, "%x:%x:%x.%x%c")
	if n != 4 {
		if v, n, _ = kscanf(path, "%x:%x.%x%c"); n != 3 {
			return matchInvalid, rest
		}
		v = append([]uint64{0}, v[:3]...)
	}
	if uint32(v[0]) == uint32(dev.Addr.Domain) && uint32(v[1]) == uint32(dev.Addr.Bus) && devfn(dev.Addr) == kernelDevfn(v[2], v[3]) {
		return matched, rest
	}
	return noMatch, rest
}

func devfn(a pci.Address) uint8 { return a.Device<<3 | a.Function }

// kernelDevfn is PCI_DEVFN (include/uapi/linux/pci.h): the slot and function as the
// kernel masks them, so "20.8" is 00.0.
func kernelDevfn(slot, fn uint64) uint8 { return uint8(slot&0x1f)<<3 | uint8(fn&0x07) }

// kscanf is the kernel's vsscanf (lib/vsprintf.c) for what these formats use: literal
// characters, which must match; %x and %hx (white space skipped, a hex digit first, an
// optional 0x, digits without bound: simple_strntoull, kept to 32 or 16 bits as the C
// assignment keeps them); %c; and %n, which assigns the count read so far without
// counting as a conversion. It returns the values in order (%c's character, %n's count
// as count), how many conversions were assigned, and the %n count.
func kscanf(s, format string) (vals []uint64, n, count int) {
	i := 0
	for f := 0; f < len(format); {
		if format[f] != '%' {
			if i >= len(s) || s[i] != format[f] {
				return vals, n, count
			}
			i, f = i+1, f+1
			continue
		}
		f++
		bits := 32
		if format[f] == 'h' {
			bits, f = 16, f+1
		}
		conv := format[f]
		f++
		if conv == 'n' {
			count = i
			continue
		}
		if i >= len(s) {
			return vals, n, count
		}
		if conv == 'c' {
			vals = append(vals, uint64(s[i]))
			i, n = i+1, n+1
			continue
		}
		for i < len(s) && isKernelSpace(s[i]) {
			i++
		}
		if i >= len(s) || !isHex(s[i]) {
			return vals, n, count
		}
		if s[i] == '0' && i+1 < len(s) && (s[i+1] == 'x' || s[i+1] == 'X') {
			i += 2
		}
		var v uint64
		for ; i < len(s) && isHex(s[i]); i++ {
			v = v<<4 | uint64(hexVal(s[i]))
		}
		vals = append(vals, v&(1<<bits-1))
		n++
	}
	return vals, n, count
}

func isKernelSpace(c byte) bool { return c == ' ' || c >= '\t' && c <= '\r' }

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

func hexVal(c byte) byte {
	switch {
	case c >= 'a':
		return c - 'a' + 10
	case c >= 'A':
		return c - 'A' + 10
	}
	return c - '0'
}

// Named are the entries that name one function by its address ("DDDD:BB:DD.F" or
// "BB:DD.F", as pci.ParseAddress reads it), each address with its first entry: the
// functions an image built for another topology names that this node may lack.
func (c *ConfigACS) Named() map[pci.Address]string {
	out := map[pci.Address]string{}
	if c == nil {
		return out
	}
	for _, e := range strings.Split(c.Value, ";") {
		_, dev, ok := strings.Cut(e, "@")
		if a, err := pci.ParseAddress(dev); ok && err == nil {
			if _, seen := out[a]; !seen {
				out[a] = e
			}
		}
	}
	return out
}

// configACSValue is the value of the last config_acs= among the line's pci= options.
// The line is split as the kernel's parse_args splits it (next_arg: a quoted stretch is
// one argument, nothing after "--" is a parameter), so a pci= inside another argument's
// quoted value is not taken for one; pci_setup then splits the option list on ','.
func configACSValue(cmdline string) (value string, found bool) {
	for _, arg := range initramfs.SplitCmdline(cmdline) {
		if arg.Key != "pci" || !arg.HasValue {
			continue
		}
		for _, opt := range strings.Split(arg.Value, ",") {
			if acs, ok := strings.CutPrefix(opt, "config_acs="); ok {
				value, found = acs, true
			}
		}
	}
	return value, found
}

// Arg is the argument as the kernel takes it (the line's last), "" without one.
func (c *ConfigACS) Arg() string {
	if c == nil {
		return ""
	}
	return "pci=config_acs=" + c.Value
}

// kernelHasConfigACS says whether a kernel release ("6.1.0-57-amd64") is 6.11 or newer,
// and whether the release could be read at all. It only sharpens advice: whether a
// kernel applied the argument is judged by reading the ports back.
func kernelHasConfigACS(release string) (has, known bool) {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return false, false
	}
	major, err1 := strconv.Atoi(parts[0])
	minorDigits := parts[1]
	if i := strings.IndexFunc(minorDigits, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		minorDigits = minorDigits[:i]
	}
	minor, err2 := strconv.Atoi(minorDigits)
	if err1 != nil || err2 != nil {
		return false, false
	}
	return major > 6 || major == 6 && minor >= 11, true
}

// The kernel's own words about pci=config_acs= (drivers/pci/pci.c, __pci_config_acs):
// pci_info "Configured ACS to %#06x" for each port it set, and pr_info_once "PCI: Can't
// parse ACS command line parameter" when it gave up on the argument.
const (
	logConfigured = "Configured ACS to "
	logCantParse  = "Can't parse ACS command line parameter"
)

// KernelACSLog is what the kernel log says it did with pci=config_acs=.
type KernelACSLog struct {
	// Read says a kernel log was read (false: none in the tree, or unreadable).
	Read bool
	// Refused says the kernel gave up parsing the argument.
	Refused bool
	// Configured is each port the kernel says it set, with the value.
	Configured map[pci.Address]pci.ACSBits
}

// ParseKernelACSLog reads the kernel log lines ("pci 0000:05:00.0: Configured ACS to
// 0x005d"), prefixed or not with /dev/kmsg's "level,seq,usec,flags;".
func ParseKernelACSLog(lines []string) KernelACSLog {
	l := KernelACSLog{Read: lines != nil, Configured: map[pci.Address]pci.ACSBits{}}
	for _, line := range lines {
		if _, msg, ok := strings.Cut(line, ";"); ok && strings.Count(line[:len(line)-len(msg)], ",") >= 3 {
			line = msg
		}
		// Only the kernel's own words count: passage mirrors its console, which quotes
		// them, into the same log.
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "PCI: "+logCantParse) {
			l.Refused = true
			continue
		}
		head, val, ok := strings.Cut(line, ": "+logConfigured)
		f := strings.Fields(head)
		if !ok || len(f) != 2 || f[0] != "pci" {
			continue
		}
		a, err := pci.ParseAddress(f[1])
		v, verr := strconv.ParseUint(strings.TrimSpace(val), 0, 16)
		if err == nil && verr == nil {
			l.Configured[a] = pci.ACSBits(v)
		}
	}
	return l
}

// KernelSays explains a port the kernel was asked to set and did not, from its log and
// release: refused, ignored by a kernel before 6.11, or not configured.
func (l KernelACSLog) KernelSays(a pci.Address, release string) string {
	switch has, known := kernelHasConfigACS(release); {
	case l.Refused:
		return fmt.Sprintf("the kernel refused the argument (%q): a multi-entry argument needs the upstream fix \"PCI/ACS: Fix pci=config_acs= parameter\"", "PCI: "+logCantParse)
	case known && !has:
		return fmt.Sprintf("Linux %s ignores pci=config_acs= (6.11 and newer program it)", release)
	case l.Read && len(l.Configured) == 0:
		return "the kernel configured no port from the argument (its log has no \"" + logConfigured + "\" line)"
	case l.Read:
		if v, ok := l.Configured[a]; ok {
			return fmt.Sprintf("the kernel says it configured 0x%04x, and something changed it since", uint16(v))
		}
		return "the kernel configured other ports, not this one"
	}
	return "the kernel did not apply it"
}

// LockdownAdvice is what an operator must do when config writes are refused: arg is the
// refused ports' plan as a kernel argument, release the running kernel's.
func LockdownAdvice(arg, release string) string {
	s := "config writes are locked down; boot with: " + arg + " (pci=config_acs= needs Linux 6.11 or newer"
	switch has, known := kernelHasConfigACS(release); {
	case !known && release == "":
	case !known:
		s += fmt.Sprintf("; running %s", release)
	case has:
		s += fmt.Sprintf("; running %s, which has it", release)
	default:
		s += fmt.Sprintf("; running %s, which does not: upgrade the kernel too", release)
	}
	return s + ")"
}
