package apply

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// acsFlagBits is how many flag positions pci=config_acs= has (SV..DT, bits 0..6). The
// argument itself is topology.KernelArg's.
const acsFlagBits = 7

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

// ParseConfigACS finds the pci=config_acs= settings on a kernel command line, keyed by
// the address they name; nil when the line has none. The kernel keeps the last
// config_acs= it sees (pci_setup), so a later one replaces an earlier one. Entries
// naming devices by ID or by path, and malformed entries, are left out: they can never
// match a planned port by address.
func ParseConfigACS(cmdline string) map[pci.Address]ACSSetting {
	value, found := configACSValue(cmdline)
	if !found {
		return nil
	}
	out := map[pci.Address]ACSSetting{}
	for _, e := range strings.Split(value, ";") {
		flags, dev, ok := strings.Cut(e, "@")
		if !ok || len(flags) == 0 || len(flags) > acsFlagBits {
			continue
		}
		a, err := pci.ParseAddress(dev)
		if err != nil {
			continue
		}
		var s ACSSetting
		valid := true
		// The rightmost character is bit 0, as __pci_config_acs reads it.
		for i := 0; i < len(flags); i++ {
			bit := pci.ACSBits(1) << (len(flags) - 1 - i)
			switch flags[i] {
			case '1':
				s.Mask |= bit
				s.Flags |= bit
			case '0':
				s.Mask |= bit
			case 'x', 'X':
			default:
				valid = false
			}
		}
		if valid {
			s.Entry = e
			out[a] = s
		}
	}
	return out
}

// configACSValue is the value of the last config_acs= among the line's pci= options.
func configACSValue(cmdline string) (value string, found bool) {
	for _, arg := range strings.Fields(cmdline) {
		arg = strings.Trim(arg, `"`)
		v, ok := strings.CutPrefix(arg, "pci=")
		if !ok {
			continue
		}
		for _, opt := range strings.Split(v, ",") {
			if acs, ok := strings.CutPrefix(opt, "config_acs="); ok {
				value, found = acs, true
			}
		}
	}
	return value, found
}

// ConfigACSArg is the line's pci=config_acs= argument as the kernel takes it (the last
// one), "" when it has none.
func ConfigACSArg(cmdline string) string {
	if v, ok := configACSValue(cmdline); ok {
		return "pci=config_acs=" + v
	}
	return ""
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
