package initramfs

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestSplitCmdline(t *testing.T) {
	tests := []struct {
		in   string
		want []Arg
	}{
		{"", nil},
		{"  ro  quiet ", []Arg{{Key: "ro"}, {Key: "quiet"}}},
		{"console=ttyS0 root=/dev/sda1", []Arg{{"console", "ttyS0", true}, {"root", "/dev/sda1", true}}},
		{`passage.url="http://x/a b" next`, []Arg{{"passage.url", "http://x/a b", true}, {Key: "next"}}},
		{`"passage.url=http://x/a b" next`, []Arg{{"passage.url", "http://x/a b", true}, {Key: "next"}}},
		{`a=b=c`, []Arg{{"a", "b=c", true}}},
		{`a=`, []Arg{{"a", "", true}}},
		{`a="`, []Arg{{"a", "", true}}},
		{`a=x"y z"`, []Arg{{"a", `x"y z"`, true}}},
		{"a\tb\nc", []Arg{{Key: "a"}, {Key: "b"}, {Key: "c"}}},
		{"a -- passage.tpm=on", []Arg{{Key: "a"}}},
		{"a --=x b", []Arg{{Key: "a"}, {"--", "x", true}, {Key: "b"}}},
		{`"unterminated b`, []Arg{{Key: "unterminated b"}}},
	}
	for _, tt := range tests {
		got := SplitCmdline(tt.in)
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("SplitCmdline(%q) = %#v, want %#v", tt.in, got, tt.want)
		}
	}
}

func TestParseCmdline(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		check   func(c Config) bool
		errArgs []string // the Arg of each expected ArgError, in order
	}{
		{"defaults", "console=ttyS0 quiet", func(c Config) bool {
			d := Defaults()
			d.Cmdline = c.Cmdline
			return reflect.DeepEqual(c, d)
		}, nil},
		{"profile file by absolute path", "passage.profile=/etc/passage/site.yaml", func(c Config) bool {
			return c.Profile == "/etc/passage/site.yaml"
		}, nil},
		// The README once said a file was taken; only a bare NAME.yaml was, resolved
		// against the boot's working directory. A file is named by its path in the image.
		{"profile file not absolute", "passage.profile=site.yaml passage.profile=etc/site.yaml passage.profile=/etc/site.txt", func(c Config) bool {
			return c.Profile == Defaults().Profile
		}, []string{"passage.profile=site.yaml", "passage.profile=etc/site.yaml", "passage.profile=/etc/site.txt"}},
		{"erase", "passage.erase=require passage.erase_timeout=2h passage.erase_overwrite=on", func(c Config) bool {
			return c.Erase == "require" && c.EraseTimeout == 2*time.Hour && c.EraseOverwrite
		}, nil},
		{"erase words refused", "passage.erase=maybe passage.erase_overwrite=yes", func(c Config) bool {
			return c.Erase == "" && !c.EraseOverwrite
		}, []string{"passage.erase=maybe", "passage.erase_overwrite=yes"}},
		{"all set", `passage.profile=qemu passage.key=/k passage.tpm=off passage.ats=require passage.net=eth0 ` +
			`passage.url=http://10.0.2.2:8080/m passage.out=/dev/vda1:/passage/ passage.handoff=switch_root passage.root=/dev/sda2 ` +
			`passage.rootfstype=ext4 passage.init=/lib/systemd/systemd passage.emit=console passage.stage_timeout=5s ` +
			`passage.net_timeout=1m passage.host_modules=e1000e,mlx5_core passage.log=/run/x.jsonl`,
			func(c Config) bool {
				return c.Profile == "qemu" && c.Key == "/k" && c.TPM == TPMOff && c.ATS == ATSRequire && c.Net == "eth0" &&
					c.URL == "http://10.0.2.2:8080/m" && c.Out == (Out{"/dev/vda1", "/passage"}) &&
					c.Handoff == HandoffSwitchRoot && c.Root == "/dev/sda2" && c.RootFSType == "ext4" &&
					c.Init == "/lib/systemd/systemd" && c.Emit == EmitConsole && c.StageTimeout == 5*time.Second &&
					c.NetTimeout == time.Minute && reflect.DeepEqual(c.HostModules, []string{"e1000e", "mlx5_core"}) &&
					c.Log == "/run/x.jsonl"
			}, nil},
		{"dash equals underscore", "passage.stage-timeout=3s passage.host-modules=", func(c Config) bool {
			return c.StageTimeout == 3*time.Second && len(c.HostModules) == 0
		}, nil},
		{"later wins", "passage.handoff=shell passage.handoff=poweroff", func(c Config) bool { return c.Handoff == HandoffPoweroff }, nil},
		{"unknown and malformed keep defaults",
			"passage.tmp=on passage.tpm=maybe passage.url passage.out=/dev/vda1 passage.stage_timeout=-1s passage.emit=serial",
			func(c Config) bool {
				d := Defaults()
				return c.TPM == d.TPM && c.URL == "" && c.Out == d.Out && c.StageTimeout == d.StageTimeout && c.Emit == d.Emit
			},
			[]string{"passage.tmp=on", "passage.tpm=maybe", "passage.url", "passage.out=/dev/vda1", "passage.stage_timeout=-1s", "passage.emit=serial"}},
		{"switch_root needs root", "passage.handoff=switch_root", func(c Config) bool { return c.Handoff == HandoffHold },
			[]string{"passage.handoff=switch_root"}},
		{"out to run", "passage.out=/dev/vda1:/p passage.out=/run", func(c Config) bool { return c.Out == Out{} }, nil},
		{"after -- is init's", "passage.tpm=on -- passage.tpm=bogus", func(c Config) bool { return c.TPM == TPMOn }, nil},
		{"quoted url", `passage.url="http://h/p?a=1 b"`, func(c Config) bool { return c.URL == "http://h/p?a=1 b" }, nil},
		{"emergency", "passage.emergency=poweroff passage.emergency_on=degraded passage.debug", func(c Config) bool {
			return c.Emergency == EmergencyPoweroff && c.EmergencyOn == EmergencyOnDegraded && c.Debug
		}, nil},
		{"emergency defaults: hold, a failed unit hands off, no debug", "passage.debug=off", func(c Config) bool {
			return c.Emergency == EmergencyHold && c.EmergencyOn == EmergencyOnNever && !c.Debug
		}, nil},
		{"emergency words refused", "passage.emergency=panic passage.emergency_on=always passage.debug=yes passage.tpm", func(c Config) bool {
			return c.Emergency == EmergencyHold && c.EmergencyOn == EmergencyOnNever && !c.Debug
		}, []string{"passage.emergency=panic", "passage.emergency_on=always", "passage.debug=yes", "passage.tpm"}},
		{"relative key", "passage.key=key", func(c Config) bool { return c.Key == Defaults().Key }, []string{"passage.key=key"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := ParseCmdline(tt.in)
			if !tt.check(c) {
				t.Errorf("ParseCmdline(%q) = %+v", tt.in, c)
			}
			var got []string
			for _, e := range c.Errors {
				var ae *ArgError
				if !errors.As(e, &ae) {
					t.Fatalf("error %v is not an *ArgError", e)
				}
				if ae.Reason == "" {
					t.Errorf("error %v has no reason", e)
				}
				got = append(got, ae.Arg)
			}
			if !reflect.DeepEqual(got, tt.errArgs) {
				t.Errorf("errors for %q = %q, want %q", tt.in, got, tt.errArgs)
			}
		})
	}
}

func TestParseCmdlineErrorNamesArgument(t *testing.T) {
	c := ParseCmdline("passage.tpm=maybe")
	if len(c.Errors) != 1 {
		t.Fatalf("errors = %v", c.Errors)
	}
	msg := c.Errors[0].Error()
	if !strings.Contains(msg, "passage.tpm=maybe") || !strings.Contains(msg, "on|off|auto") {
		t.Errorf("error %q does not name the argument and the allowed values", msg)
	}
	if got := c.ErrorStrings(); len(got) != 1 || got[0] != msg {
		t.Errorf("ErrorStrings = %q", got)
	}
}

func TestReadConfig(t *testing.T) {
	root := t.TempDir()
	if _, err := ReadConfig(root); err == nil || !strings.Contains(err.Error(), "cmdline") {
		t.Errorf("missing /proc/cmdline: err = %v", err)
	}
	if err := os.MkdirAll(filepath.Join(root, "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "proc", "cmdline"), []byte("console=ttyS0 passage.profile=qemu passage.emit=console\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := ReadConfig(root)
	if err != nil {
		t.Fatal(err)
	}
	if c.Profile != "qemu" || c.Emit != EmitConsole || c.Cmdline != "console=ttyS0 passage.profile=qemu passage.emit=console" {
		t.Errorf("ReadConfig = %+v", c)
	}
}

// TestParamsDocumented keeps doc.go's table in step with the parser.
func TestParamsDocumented(t *testing.T) {
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range ParamNames() {
		if !strings.Contains(string(doc), "//\t"+n+"=") {
			t.Errorf("%s is not in doc.go's table", n)
		}
	}
}

func FuzzParseCmdline(f *testing.F) {
	for _, s := range []string{
		"console=ttyS0 passage.profile=qemu passage.emit=console passage.handoff=poweroff",
		`passage.url="http://10.0.2.2/x y" "passage.out=/dev/vda1:/p"`,
		"passage.tpm passage.=x passage.net=a/b -- passage.x",
		`"`, `a="`, `=`, "passage.stage_timeout=9999999h",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		c := ParseCmdline(s)
		for _, e := range c.Errors {
			if e.Error() == "" {
				t.Fatal("empty error")
			}
		}
		if c.Handoff == HandoffSwitchRoot && c.Root == "" {
			t.Fatal("switch_root without root")
		}
		if c.StageTimeout <= 0 || c.NetTimeout <= 0 {
			t.Fatalf("timeouts %v %v", c.StageTimeout, c.NetTimeout)
		}
		for _, a := range SplitCmdline(s) {
			if strings.ContainsAny(a.Key, " \t\n") && !strings.Contains(s, `"`) {
				t.Fatalf("key %q has whitespace without quotes in %q", a.Key, s)
			}
		}
	})
}

// TestLoopbackURL: with passage.net=off the boot publishes only to a host the loopback
// device answers for: an address in 127.0.0.0/8 or ::1 (IPv4-mapped included), or the
// name localhost; anything else is refused naming the host and why.
func TestLoopbackURL(t *testing.T) {
	for _, tc := range []struct {
		url string
		ok  bool
	}{
		{"http://127.0.0.1:8080/passage", true},
		{"https://127.3.4.5/", true},
		{"http://[::1]:9/x", true},
		{"http://[::ffff:127.0.0.1]/", true},
		{"http://localhost:8443/p", true},
		{"http://LocalHost/", true},
		{"http://10.0.2.2/passage", false},
		{"http://[::2]/", false},
		{"http://0.0.0.0/", false},
		{"http://control.example/", false},
		{"http://a.localhost/", false},
		{"http://localhost.example/", false},
		{"http://127.0.0.1.nip.io/", false},
		{"http://[fe80::1%25lo]/", false},
		{"ftp://127.0.0.1/", false},
	} {
		err := LoopbackURL(tc.url)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v, want ok %v", tc.url, err, tc.ok)
		}
		if err != nil && tc.ok == false && !strings.Contains(tc.url, "ftp") && !strings.Contains(err.Error(), "is not loopback (127.0.0.0/8, ::1 or localhost) and passage.net=off brings up no network") {
			t.Errorf("%s: %v does not say why", tc.url, err)
		}
	}
}

// TestSecureURL: the boot publishes over https anywhere, over plain http to loopback
// (a verifier on the node itself), and to any other host only when told it may.
func TestSecureURL(t *testing.T) {
	for _, tc := range []struct {
		url      string
		insecure bool
		ok       bool
	}{
		{"https://control.example/", false, true},
		{"http://127.0.0.1:8080/m", false, true},
		{"http://localhost/m", false, true},
		{"http://10.0.2.100/m", false, false},
		{"http://10.0.2.100/m", true, true},
	} {
		err := SecureURL(tc.url, tc.insecure)
		if (err == nil) != tc.ok || (err != nil && !strings.Contains(err.Error(), "passage.url_insecure=1")) {
			t.Errorf("%s insecure=%v: %v", tc.url, tc.insecure, err)
		}
	}
	if c := ParseCmdline("passage.url=http://10.0.2.100/m passage.url_insecure=1"); !c.URLInsecure {
		t.Error("passage.url_insecure=1 not taken")
	}
}
