package apply

import (
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// The verify-only check reads back what topology.KernelArg writes.
func TestConfigACSRoundTrip(t *testing.T) {
	a := pci.MustParseAddress("0000:ec:00.0")
	b := pci.MustParseAddress("0001:05:02.0")
	ports := []topology.ACSPort{
		{Addr: a, Offset: 0x150, Mask: isoDT, Flags: isoDT},
		{Addr: b, Offset: 0x150, Mask: iso | pci.ACSDT | pci.ACSTB, Flags: iso}, // TB and DT forced off
		{Addr: pci.MustParseAddress("00:01.0"), Offset: 0},                      // no ACS
	}
	arg := topology.KernelArg(ports)
	if want := "pci=config_acs=1x111x1@0000:ec:00.0;0x11101@0001:05:02.0"; arg != want {
		t.Fatalf("topology.KernelArg = %q, want %q (the parser below assumes this form)", arg, want)
	}
	got := ParseConfigACS("ro quiet " + arg + " intel_iommu=on")
	if len(got) != 2 || got[a].Mask != isoDT || got[a].Flags != isoDT || got[b].Mask != iso|pci.ACSDT|pci.ACSTB || got[b].Flags != iso {
		t.Errorf("parse: %+v", got)
	}
}

func TestParseConfigACS(t *testing.T) {
	a := pci.MustParseAddress("0000:ec:00.0")
	for _, tc := range []struct {
		cmdline     string
		mask, flags pci.ACSBits
		found       bool
	}{
		{"", 0, 0, false},
		{"pci=noaer", 0, 0, false},
		// Short flag strings cover the low bits only; the kernel reads right to left.
		{"pci=config_acs=101@ec:00.0", pci.ACSSV | pci.ACSTB | pci.ACSRR, pci.ACSSV | pci.ACSRR, true},
		{`"pci=noaer,config_acs=1x111x1@0000:ec:00.0;xx1@01:00.0"`, isoDT, isoDT, true},
		// The last config_acs= wins, as in pci_setup.
		{"pci=config_acs=1x111x1@0000:ec:00.0 pci=config_acs=xx111x1@0000:ec:00.0", iso, iso, true},
		{"pci=config_acs=1x111x1@0000:ec:00.0 pci=config_acs=xx111x1@01:00.0", 0, 0, false},
		// Malformed or unmatched entries are not ours.
		{"pci=config_acs=1z111x1@0000:ec:00.0", 0, 0, false},
		{"pci=config_acs=11x111x1@0000:ec:00.0", 0, 0, false},
		{"pci=config_acs=1x111x1@pci:15b3:197c", 0, 0, false},
		{"pci=config_acs=1x111x1", 0, 0, false},
		{"pci=config_acs=@0000:ec:00.0", 0, 0, false},
	} {
		got, ok := ParseConfigACS(tc.cmdline)[a]
		if ok != tc.found || got.Mask != tc.mask || got.Flags != tc.flags {
			t.Errorf("%q: %+v %v, want mask %s flags %s found %v", tc.cmdline, got, ok, tc.mask, tc.flags, tc.found)
		}
	}
}

func TestLockdownAdvice(t *testing.T) {
	for rel, want := range map[string]string{
		"6.1.0-57-amd64": "running 6.1.0-57-amd64, which does not: upgrade the kernel too",
		"6.11.0":         "running 6.11.0, which has it",
		"6.12.9+deb13":   "running 6.12.9+deb13, which has it",
		"7.0":            "which has it",
		"5.15.0-1":       "which does not",
		"weird":          "running weird)",
		"":               "needs Linux 6.11 or newer)",
	} {
		got := LockdownAdvice("pci=config_acs=1x111x1@0000:ec:00.0", rel)
		if !strings.HasPrefix(got, "config writes are locked down; boot with: pci=config_acs=1x111x1@0000:ec:00.0 (pci=config_acs= needs Linux 6.11 or newer") || !strings.Contains(got, want) {
			t.Errorf("%q: %q lacks %q", rel, got, want)
		}
	}
}

func FuzzParseConfigACS(f *testing.F) {
	f.Add("pci=config_acs=1x111x1@0000:ec:00.0;xx111x1@01:00.0")
	f.Add(`"pci=noaer,config_acs=101@ec:00.0" ro`)
	f.Fuzz(func(t *testing.T, s string) {
		for a, set := range ParseConfigACS(s) {
			if set.Flags&^set.Mask != 0 || set.Mask&^0x7f != 0 {
				t.Fatalf("%s: %+v", a, set)
			}
			// What parses must render back to an entry that parses the same.
			round := ParseConfigACS(topology.KernelArg([]topology.ACSPort{{Addr: a, Offset: 0x150, Mask: set.Mask, Flags: set.Flags}}))
			if set.Mask != 0 && round[a].Mask != set.Mask || round[a].Flags != set.Flags {
				t.Fatalf("%s: %+v round-trips to %+v", a, set, round[a])
			}
		}
	})
}
