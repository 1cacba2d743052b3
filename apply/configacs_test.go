package apply

import (
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
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
	c := ParseConfigACS("ro quiet " + arg + " intel_iommu=on")
	ga, gb := c.For(nil, a), c.For(nil, b)
	if !ga.Set || !gb.Set || ga.Setting.Mask != isoDT || ga.Setting.Flags != isoDT || gb.Setting.Mask != iso|pci.ACSDT|pci.ACSTB || gb.Setting.Flags != iso {
		t.Errorf("parse: %+v %+v", ga, gb)
	}
	if n := c.Named(); len(n) != 2 || n[a] != "1x111x1@0000:ec:00.0" {
		t.Errorf("named: %v", n)
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
		// The line splits as next_arg splits it: a pci= inside another argument's quoted
		// value is that argument's, and what follows "--" is init's.
		{`pci=config_acs=0000000@0000:ec:00.0 foo="a pci=config_acs=1x111x1@0000:ec:00.0"`, 0x7f, 0, true},
		{"pci=config_acs=1x111x1@0000:ec:00.0 -- pci=config_acs=0000000@0000:ec:00.0", isoDT, isoDT, true},
		{`pci="config_acs=1x111x1@0000:ec:00.0"`, isoDT, isoDT, true},
		// Within the argument the first entry that matches wins (__pci_config_acs stops
		// there), however the port is spelled.
		{"pci=config_acs=0000000@0000:ec:00.0;1x111x1@0000:ec:00.0", 0x7f, 0, true},
		{"pci=config_acs=0000000@ec:00.0;1x111x1@0000:ec:00.0", 0x7f, 0, true},
		{"pci=config_acs=0000000@0:EC:0.0;1x111x1@0000:ec:00.0", 0x7f, 0, true},
		{"pci=config_acs=0000000@0x0:0xec:0x0.0x0;1x111x1@0000:ec:00.0", 0x7f, 0, true},
		// PCI_DEVFN masks the slot to 5 bits and the function to 3; a bus or domain is
		// kept to 32 bits.
		{"pci=config_acs=0000000@0000:ec:20.8;1x111x1@0000:ec:00.0", 0x7f, 0, true},
		{"pci=config_acs=0000000@0000:1000000ec:00.0;1x111x1@0000:ec:00.0", 0x7f, 0, true},
		{"pci=config_acs=0000000@0000:1ec:00.0;1x111x1@0000:ec:00.0", isoDT, isoDT, true},
		// An empty flag string matches and sets nothing: the later entry is not read.
		{"pci=config_acs=@0000:ec:00.0;1x111x1@0000:ec:00.0", 0, 0, true},
		// x past bit 6 adds no bit; a 0 or 1 there is refused, and the reading stops.
		{"pci=config_acs=xxxxxxxx1@0000:ec:00.0", pci.ACSSV, pci.ACSSV, true},
		{"pci=config_acs=11x111x1@0000:ec:00.0", 0, 0, false},
		{"pci=config_acs=11x111x1@01:00.0;1x111x1@0000:ec:00.0", 0, 0, false},
		// A malformed entry before the port's ends the reading for it; after, it does not.
		{"pci=config_acs=1z111x1@01:00.0;1x111x1@0000:ec:00.0", 0, 0, false},
		{"pci=config_acs=1x111x1@0000:ec:00.0;1z111x1@01:00.0", isoDT, isoDT, true},
		{"pci=config_acs=1x111x1@01:00.0z;1x111x1@0000:ec:00.0", 0, 0, false},
		{"pci=config_acs=1x111x1@01:00.0;1x111x1@0000:ec:00.0;junk", isoDT, isoDT, true},
		{"pci=config_acs=1x111x1", 0, 0, false},
		// Without the function, an entry by IDs read first leaves the reading unsure.
		{"pci=config_acs=1x111x1@pci:15b3:197c;1x111x1@0000:ec:00.0", 0, 0, false},
		{"pci=config_acs=1x111x1@0000:ec:00.0;1x111x1@pci:15b3:197c", isoDT, isoDT, true},
	} {
		got := ParseConfigACS(tc.cmdline).For(nil, a)
		if got.Set != tc.found || got.Setting.Mask != tc.mask || got.Setting.Flags != tc.flags {
			t.Errorf("%q: %+v, want mask %s flags %s found %v", tc.cmdline, got, tc.mask, tc.flags, tc.found)
		}
	}
}

// TestConfigACSMatchesFunctions: against the functions of a scanned B300, entries by IDs
// and by path match as pci_dev_str_match matches them, and the first match wins.
func TestConfigACSMatchesFunctions(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	nic, rp := n.Addr("cx-dsp-nic0"), n.Addr("rp0")
	planned := "1x111x1@" + nic.String()
	for _, tc := range []struct {
		arg   string
		entry string // the entry the kernel applies to the NIC port, "" none
	}{
		{planned, planned},
		{"0000000@pci:0:0;" + planned, "0000000@pci:0:0"},
		{"0000000@pci:15b3:197c;" + planned, "0000000@pci:15b3:197c"},
		{"0000000@pci:15b3:197c:0:0;" + planned, "0000000@pci:15b3:197c:0:0"},
		{"0000000@pci:10de:197c;" + planned, planned},
		{"0000000@pci:15b3:197c:15b3:1;" + planned, planned},
		{"0000000@" + rp.String() + "/00.0/00.0/00.0/00.0;" + planned, "0000000@" + rp.String() + "/00.0/00.0/00.0/00.0"},
		{"0000000@" + rp.String() + "/00.0/00.0/00.0/02.0;" + planned, planned},
		{"0000000@" + rp.String() + "/00.0/00.0/00.0;" + planned, planned},
		// An ID entry with a trailing part the kernel cannot step past ends the reading
		// for a function it does not match.
		{"0000000@pci:10de:2901junk;" + planned, ""},
		{"0000000@" + rp.String() + "/0g.0;" + planned, ""},
	} {
		got := ParseConfigACS("pci=config_acs="+tc.arg).For(tree, nic)
		if got.Unsure || got.Set != (tc.entry != "") || got.Setting.Entry != tc.entry {
			t.Errorf("%s: %+v, want entry %q", tc.arg, got, tc.entry)
		}
	}
	// The root port itself: a path of one hop is its own address.
	if got := ParseConfigACS("pci=config_acs=0000000@pci:15b3:197c;1x111x1@"+rp.String()).For(tree, rp); !got.Set || got.Setting.Mask != isoDT {
		t.Errorf("root port: %+v", got)
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
	// A port listed twice, the weak entry first: the kernel applies that one.
	f.Add("pci=config_acs=0000000@0000:ec:00.0;1x111x1@0000:ec:00.0")
	f.Add("pci=config_acs=0000000@0:ec:20.8;1x111x1@0000:ec:00.0")
	f.Add("pci=config_acs=0000000@pci:0:0;1x111x1@0000:ec:00.0")
	f.Add("pci=config_acs=0000000@0000:00:02.0/00.0;1x111x1@0000:ec:00.0")
	f.Add("pci=config_acs=0000000@pci:15b3:197c:0:0;1x111x1@0000:15:02.0/00.0")
	f.Add("pci=config_acs=1@0x0:0x15:0x22.0x8;xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx1@15:2.0")
	a := pci.MustParseAddress("0000:ec:00.0")
	n := pcitest.New(f, pcitest.B300())
	tree, err := pci.Scan(n.Root)
	if err != nil {
		f.Fatal(err)
	}
	ports := []pci.Address{n.Addr("rp0"), n.Addr("cx-dsp-nic0"), n.Addr("gpu-dsp0"), n.Addr("nvme0")}
	f.Fuzz(func(t *testing.T, s string) {
		c := ParseConfigACS(s)
		// Against the scanned tree, whatever the entries name, a reading is never unsure
		// and what it applies is within the seven controls.
		for _, p := range ports {
			if r := c.For(tree, p); r.Set && (r.Setting.Flags&^r.Setting.Mask != 0 || r.Setting.Mask&^0x7f != 0) || r.Unsure && len(s) < maxFlagChars {
				t.Fatalf("%s: %+v", p, r)
			}
		}
		r := c.For(nil, a)
		set := r.Setting
		if r.Set && (set.Flags&^set.Mask != 0 || set.Mask&^0x7f != 0 || r.Unsure) {
			t.Fatalf("%s: %+v", a, r)
		}
		if r.Set {
			// What the kernel applies renders back to an entry it reads the same.
			round := ParseConfigACS(topology.KernelArg([]topology.ACSPort{{Addr: a, Offset: 0x150, Mask: set.Mask, Flags: set.Flags}})).For(nil, a)
			if set.Mask != 0 && (round.Setting.Mask != set.Mask || round.Setting.Flags != set.Flags) {
				t.Fatalf("%s: %+v round-trips to %+v", a, set, round)
			}
		}
		// An argument of plain entries (flags of 0, 1 and x within bits 0..6, each at an
		// address): the first entry at the port's address decides, none when there is none.
		if c == nil {
			return
		}
		first := ""
		for _, e := range strings.Split(c.Value, ";") {
			fl, dev, ok := strings.Cut(e, "@")
			b, err := pci.ParseAddress(dev)
			if !ok || err != nil || len(fl) > 7 || strings.Trim(fl, "01xX") != "" {
				return
			}
			if b == a && first == "" {
				first = e
			}
		}
		if r.Unsure || r.Set != (first != "") || r.Setting.Entry != first {
			t.Fatalf("%q: applies %+v, the first entry for the port is %q", s, r, first)
		}
	})
}
