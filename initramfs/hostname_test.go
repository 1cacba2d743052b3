package initramfs

import (
	"errors"
	"strings"
	"testing"
)

func TestCheckHostname(t *testing.T) {
	long63 := strings.Repeat("a", 63)
	for _, tc := range []struct {
		name string
		bad  string // "" = a host name; else a word the error must hold
	}{
		{"b300-r07-n3", ""},
		{"B300-R07-N3", ""}, // case-insensitive: folded by ChooseHostname
		{"node7.dc1.example.com", ""},
		{"7node", ""}, // RFC 1123 allows a leading digit (RFC 952 did not)
		{"a", ""},
		{long63, ""},
		{long63[:60] + ".abc", ""}, // 64 bytes: the kernel's limit
		{"", "empty"},
		{long63 + "a", "at most"}, // also over 64
		{long63[:61] + ".abc", "64"},
		{"-node", "hyphen"},
		{"node-", "hyphen"},
		{"node..dc1", "empty label"},
		{".node", "empty label"},
		{"node.", "empty label"},
		{"node_7", `"_"`},
		{"node 7", `" "`},
		{"nöde", "letter, digit or hyphen"},
		{"(none)", `"("`},
		{"node\n7", "letter, digit or hyphen"},
		{"10.0.2.15", "IP address"},
		{"::1", "IP address"},
	} {
		err := CheckHostname(tc.name)
		switch {
		case tc.bad == "" && err != nil:
			t.Errorf("CheckHostname(%q) = %v, want a host name", tc.name, err)
		case tc.bad != "" && err == nil:
			t.Errorf("CheckHostname(%q) = nil, want an error with %q", tc.name, tc.bad)
		case tc.bad != "" && !strings.Contains(err.Error(), tc.bad):
			t.Errorf("CheckHostname(%q) = %v, want it to say %q", tc.name, err, tc.bad)
		}
	}
}

// TestParseCmdlineHostname: passage.hostname= takes an RFC 1123 host name as written;
// anything else is an ArgError that says what a host name is, and the boot goes on
// without one (to DHCP).
func TestParseCmdlineHostname(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		bad      bool
	}{
		{"passage.hostname=b300-r07-n3", "b300-r07-n3", false},
		{"passage.hostname=B300-R07-N3", "B300-R07-N3", false},
		{`passage.hostname="node7.dc1"`, "node7.dc1", false},
		{"passage.hostname=a passage.hostname=b", "b", false},
		{"passage.hostname=", "", true},
		{"passage.hostname", "", true},
		{"passage.hostname=(none)", "", true},
		{"passage.hostname=node_7", "", true},
		{`passage.hostname="node 7"`, "", true},
		{"passage.hostname=" + strings.Repeat("n", 65), "", true},
		{"passage.hostname=good passage.hostname=-bad", "good", true},
	} {
		c := ParseCmdline(tc.in)
		if c.Hostname != tc.want {
			t.Errorf("%s: Hostname %q, want %q", tc.in, c.Hostname, tc.want)
		}
		if got := len(c.Errors) > 0; got != tc.bad {
			t.Errorf("%s: errors %v, want an error: %v", tc.in, c.Errors, tc.bad)
		}
		for _, e := range c.Errors {
			var ae *ArgError
			if !errors.As(e, &ae) || !strings.HasPrefix(ae.Arg, "passage.hostname") ||
				!strings.Contains(ae.Reason, "RFC 1123 host name") && !strings.Contains(ae.Reason, "missing =value") {
				t.Errorf("%s: error %v, want one naming the argument and what a host name is", tc.in, e)
			}
		}
	}
}

// TestChooseHostname: the kernel argument first, then a name the kernel already has,
// then the first lease's DHCP option 12 that is a host name; folded to lower case; set
// only when the kernel reads something else; with none, where none was found.
func TestChooseHostname(t *testing.T) {
	dhcp := func(names ...string) []DHCPName {
		var out []DHCPName
		for i, n := range names {
			out = append(out, DHCPName{Iface: "eth" + string(rune('0'+i)), Server: "10.0.2.2", Name: n})
		}
		return out
	}
	for _, tc := range []struct {
		name, arg, current string
		leases             []DHCPName
		want               Hostname
		notes              []string // a word each note must hold, in order
		missing            string   // a word Missing must hold
	}{
		{name: "argument", arg: "b300-r07-n3", current: "(none)",
			want: Hostname{Name: "b300-r07-n3", Source: HostnameArgument, Set: true}},
		{name: "argument over DHCP", arg: "b300-r07-n3", current: "(none)", leases: dhcp("from-dhcp"),
			want: Hostname{Name: "b300-r07-n3", Source: HostnameArgument, Set: true}, notes: []string{`"from-dhcp" on eth0 (server 10.0.2.2) not taken: passage.hostname= comes first`}},
		{name: "argument over the kernel's", arg: "b300-r07-n3", current: "old-name",
			want: Hostname{Name: "b300-r07-n3", Source: HostnameArgument, Set: true}},
		{name: "argument already set", arg: "b300-r07-n3", current: "b300-r07-n3",
			want: Hostname{Name: "b300-r07-n3", Source: HostnameArgument}},
		{name: "argument folded", arg: "B300-R07-N3", current: "(none)",
			want: Hostname{Name: "b300-r07-n3", Source: HostnameArgument, Set: true}, notes: []string{"lower case"}},
		{name: "bad argument (a Config not from ParseCmdline) falls to DHCP", arg: "bad_name", current: "(none)", leases: dhcp("from-dhcp"),
			want: Hostname{Name: "from-dhcp", Source: HostnameDHCP, Set: true}, notes: []string{`passage.hostname="bad_name" passed over`}},
		{name: "kernel's", current: "b300-r07-n3", leases: dhcp("from-dhcp"),
			want: Hostname{Name: "b300-r07-n3", Source: HostnameKernel}, notes: []string{"kernel comes first"}},
		{name: "kernel's in upper case", current: "B300-R07-N3",
			want: Hostname{Name: "b300-r07-n3", Source: HostnameKernel, Set: true}, notes: []string{"lower case"}},
		{name: "kernel's not a host name", current: "node_7", leases: dhcp("from-dhcp"),
			want: Hostname{Name: "from-dhcp", Source: HostnameDHCP, Set: true}, notes: []string{`the kernel's hostname "node_7" passed over`}},
		{name: "DHCP", current: "(none)", leases: dhcp("from-dhcp"),
			want: Hostname{Name: "from-dhcp", Source: HostnameDHCP, Set: true}},
		{name: "DHCP, empty kernel file", current: "", leases: dhcp("from-dhcp"),
			want: Hostname{Name: "from-dhcp", Source: HostnameDHCP, Set: true}},
		{name: "DHCP: the first lease with a name", current: "(none)", leases: dhcp("", "second", "third"),
			want: Hostname{Name: "second", Source: HostnameDHCP, Set: true}, notes: []string{`"third" on eth2 (server 10.0.2.2) not taken: eth1's came first`}},
		{name: "DHCP: a bad name passed over", current: "(none)", leases: dhcp("bad name", "good"),
			want: Hostname{Name: "good", Source: HostnameDHCP, Set: true}, notes: []string{`"bad name" on eth0 (server 10.0.2.2) passed over`}},
		{name: "DHCP: same name twice", current: "(none)", leases: dhcp("node", "NODE"),
			want: Hostname{Name: "node", Source: HostnameDHCP, Set: true}},
		{name: "none: no lease", current: "(none)", missing: "the kernel's hostname is (none), and no DHCP lease"},
		{name: "none: no option 12", current: "(none)", leases: dhcp(""),
			missing: "no DHCP option 12: eth0 (server 10.0.2.2) sent none"},
		{name: "none: only a bad option 12", current: "", leases: dhcp("(none)"),
			notes: []string{`"(none)" on eth0`}, missing: "eth0 (server 10.0.2.2) sent no host name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ChooseHostname(tc.arg, tc.current, tc.leases)
			if got.Name != tc.want.Name || got.Source != tc.want.Source || got.Set != tc.want.Set {
				t.Errorf("ChooseHostname = %+v, want %+v", got, tc.want)
			}
			if len(got.Notes) != len(tc.notes) {
				t.Fatalf("notes %q, want %d holding %q", got.Notes, len(tc.notes), tc.notes)
			}
			for i, n := range tc.notes {
				if !strings.Contains(got.Notes[i], n) {
					t.Errorf("note %q, want it to hold %q", got.Notes[i], n)
				}
			}
			if (got.Name == "") != (got.Missing != "") || !strings.Contains(got.Missing, tc.missing) {
				t.Errorf("Missing %q with name %q, want %q", got.Missing, got.Name, tc.missing)
			}
		})
	}
}

// FuzzHostname: a passage.hostname= value is either refused with an ArgError or taken
// as written, and a taken one is a name the kernel takes (at most 64 bytes, only
// letters, digits, hyphens and dots) that ChooseHostname sets in lower case and
// CheckHostname accepts again: no value reaches sethostname that the manifest could not
// sign as a Kubernetes name.
func FuzzHostname(f *testing.F) {
	for _, s := range []string{"b300-r07-n3", "B300.dc1", "(none)", "-a", "a-", "a..b", "10.0.2.15", `"x y"`, "", "é", strings.Repeat("a", 64), strings.Repeat("a", 65)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		c := ParseCmdline("passage.hostname=" + v)
		if c.Hostname == "" {
			if len(c.Errors) == 0 {
				t.Fatalf("passage.hostname=%q: no host name and no error", v)
			}
			return
		}
		if len(c.Hostname) > MaxHostname || strings.Trim(c.Hostname, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.") != "" {
			t.Fatalf("passage.hostname=%q taken as %q", v, c.Hostname)
		}
		h := ChooseHostname(c.Hostname, NoHostname, nil)
		if h.Name != strings.ToLower(c.Hostname) || h.Source != HostnameArgument || !h.Set {
			t.Fatalf("ChooseHostname(%q) = %+v", c.Hostname, h)
		}
		if err := CheckHostname(h.Name); err != nil {
			t.Fatalf("chosen %q: %v", h.Name, err)
		}
		if ChooseHostname(c.Hostname, h.Name, nil).Set {
			t.Fatalf("%q set again over itself", h.Name)
		}
	})
}
