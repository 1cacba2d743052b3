package apply

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/pci"
)

// acsFlagBits is how many flag positions pci=config_acs= has (SV..DT, bits 0..6). The
// argument itself is topology.KernelArg's.
const acsFlagBits = 7

// acsSetting is one entry of a pci=config_acs= argument.
type acsSetting struct {
	Mask, Flags pci.ACSBits
	Entry       string
}

// parseConfigACS finds the pci=config_acs= settings on a kernel command line, keyed by
// the address they name. The kernel keeps the last config_acs= it sees (pci_setup), so
// a later one replaces an earlier one. Entries naming devices by ID or by path, and
// malformed entries, are ignored: they can never match a planned port by address, and
// the port is then written as if the argument were absent.
func parseConfigACS(cmdline string) map[pci.Address]acsSetting {
	var value string
	found := false
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
	if !found {
		return nil
	}
	out := map[pci.Address]acsSetting{}
	for _, e := range strings.Split(value, ";") {
		flags, dev, ok := strings.Cut(e, "@")
		if !ok || len(flags) == 0 || len(flags) > acsFlagBits {
			continue
		}
		a, err := pci.ParseAddress(dev)
		if err != nil {
			continue
		}
		var s acsSetting
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

// kernelHasConfigACS says whether a kernel release ("6.1.0-57-amd64") is 6.11 or newer,
// and whether the release could be read at all.
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
