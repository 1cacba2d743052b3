package initramfs

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/passage-boot/passage/initramfs/rootdev"
)

// Handoff says what `passage boot` does once the manifest is written.
type Handoff string

const (
	HandoffSwitchRoot Handoff = "switch_root"
	HandoffPoweroff   Handoff = "poweroff"
	HandoffShell      Handoff = "shell"
	HandoffHold       Handoff = "hold"
)

// Emergency is passage.emergency=: what a boot does instead of its handoff when the
// verdict fails (see EmergencyOn) or the handoff itself fails, as dracut's rd.emergency=.
type Emergency string

const (
	EmergencyHold     Emergency = "hold"     // stay, with the console's last lines saying why
	EmergencyShell    Emergency = "shell"    // u-root's shell on the console, respawned on exit
	EmergencyReboot   Emergency = "reboot"   // reboot(RESTART): try the boot again
	EmergencyPoweroff Emergency = "poweroff" // reboot(POWER_OFF): out of the fleet until someone looks
)

// EmergencyOn is passage.emergency_on=: which unit verdicts also take the emergency
// action before the handoff. A boot that cannot go on takes it whatever this says: no
// signed manifest was written (the hypervisor has nothing to trust), or the handoff
// failed (no root).
//
// The default is never. A failed unit is the decision working: it stays failed in the
// signed manifest, no consumer (render, the DRA driver, the hook) ever offers it, and
// the other seven units of the node can serve. Holding the whole node for one unit turns
// one bad NIC into eight lost GPUs and a node that never reaches the fleet's monitoring,
// where the failed unit is counted and alerted on (passage_units{status="failed"}).
type EmergencyOn string

const (
	EmergencyOnFailed   EmergencyOn = "failed"   // also a failed unit
	EmergencyOnDegraded EmergencyOn = "degraded" // also a failed or a degraded unit
	EmergencyOnNever    EmergencyOn = "never"    // no unit verdict: only a boot that cannot go on
)

// TPMMode is passage.tpm=.
type TPMMode string

const (
	TPMAuto TPMMode = "auto" // use the TPM when /dev/tpmrm0 or /dev/tpm0 exists
	TPMOn   TPMMode = "on"   // a missing TPM fails the manifest stage's TPM part
	TPMOff  TPMMode = "off"
)

// ATSPolicy is passage.ats=: what a ConnectX-8 function without the ATS capability does
// to its unit.
type ATSPolicy string

const (
	ATSPrefer  ATSPolicy = "prefer"  // unit degraded (no DT)
	ATSRequire ATSPolicy = "require" // unit failed
)

// Emit is passage.emit=.
type Emit string

const (
	EmitOff     Emit = "off"
	EmitConsole Emit = "console"
)

// NetAuto and NetOff are the special values of passage.net=; anything else names an
// interface.
const (
	NetAuto = "auto"
	NetOff  = "off"
)

// RunDir is where every boot writes its results (manifest, log.jsonl, event log).
const RunDir = "/run/passage"

// Out is passage.out=: where the manifest is kept beyond /run. Device empty means /run only.
type Out struct {
	Device string // block device, e.g. /dev/vda1
	Path   string // directory inside the device's filesystem, e.g. /passage
}

func (o Out) String() string {
	if o.Device == "" {
		return "/run"
	}
	return o.Device + ":" + o.Path
}

// Config is the boot stage's configuration, from passage.* kernel arguments. The zero
// value is not meaningful; start from Defaults.
type Config struct {
	Profile      string        // passage.profile=
	Key          string        // passage.key=
	TPM          TPMMode       // passage.tpm=
	ATS          ATSPolicy     // passage.ats=
	Net          string        // passage.net=
	URL          string        // passage.url=
	URLInsecure  bool          // passage.url_insecure=: publish to a plain-http passage.url that is not loopback
	Push         string        // passage.push=
	Out          Out           // passage.out=
	Handoff      Handoff       // passage.handoff=
	Root         string        // passage.root=
	Hostname     string        // passage.hostname=: the node's name, before DHCP's (ChooseHostname)
	RootFSType   string        // passage.rootfstype=
	RootWait     time.Duration // passage.rootwait=: how long switch_root waits for the root device
	Init         string        // passage.init=
	Emit         Emit          // passage.emit=
	StageTimeout time.Duration // passage.stage_timeout=
	NetTimeout   time.Duration // passage.net_timeout=
	PublishFor   time.Duration // passage.publish_for=: how long publish keeps trying (0: 5 tries)
	HostModules  []string      // passage.host_modules=
	Log          string        // passage.log=
	// Erase is passage.erase= (off, auto, require); "" takes the profile's default.
	Erase string
	// Plan is passage.plan=, the digest of the saved plan a signed image was built with
	// (make uki PLAN=); the decision reads it with the image's pci=config_acs=.
	Plan         string
	EraseTimeout time.Duration // passage.erase_timeout=: the erase stage's deadline
	// EraseOverwrite is passage.erase_overwrite=on: Sanitize overwrite is allowed after
	// every other method (hours on a large drive); off by default.
	EraseOverwrite bool

	Emergency   Emergency   // passage.emergency=
	EmergencyOn EmergencyOn // passage.emergency_on=
	// Debug is passage.debug (or passage.debug=on): every stage's whole error (a panic's
	// stack included) on the console, and a waiting stage shown every second.
	Debug bool

	// Cmdline is the kernel command line as read, for the manifest.
	Cmdline string
	// Errors holds one error per unknown or malformed passage.* argument. The boot goes on
	// with the defaults for those; the manifest records them.
	Errors []error
}

// Defaults is the configuration of a boot with no passage.* arguments.
func Defaults() Config {
	return Config{
		Profile:      "b300",
		Key:          "/etc/passage/key",
		TPM:          TPMAuto,
		ATS:          ATSPrefer,
		Net:          NetAuto,
		Handoff:      HandoffHold,
		Init:         "/sbin/init",
		Emit:         EmitOff,
		StageTimeout: 60 * time.Second,
		NetTimeout:   30 * time.Second,
		RootWait:     30 * time.Second,
		// Host-kept roles on B300: management NICs (Intel igb/ixgbe/ice or
		// ConnectX mlx5 on some boards) and the NVSwitch management interface, which the
		// host's fabric manager drives later from the real root. The QEMU stand-in uses
		// e1000e.
		HostModules: []string{"e1000e", "igb"},
		Log:         RunDir + "/log.jsonl",
		// A sanitize of a large drive takes minutes; its own deadline, not the stages'.
		EraseTimeout: 30 * time.Minute,
		Emergency:    EmergencyHold,
		EmergencyOn:  EmergencyOnNever,
	}
}

// ArgError is an unknown or malformed passage.* kernel argument.
type ArgError struct {
	Arg    string // the argument as written, e.g. passage.tpm=maybe
	Reason string
}

func (e *ArgError) Error() string { return fmt.Sprintf("cmdline %q: %s", e.Arg, e.Reason) }

// Arg is one kernel command-line argument after the kernel's quote handling.
type Arg struct {
	Key      string
	Value    string
	HasValue bool
}

// SplitCmdline splits a command line the way the kernel's next_arg (lib/cmdline.c,
// kernel/params.c) does: whitespace separates arguments except inside double quotes, a
// quote may open anywhere, and quotes around the value (or around the whole argument)
// are dropped. Arguments after a bare "--" belong to init and are not returned.
func SplitCmdline(s string) []Arg {
	var out []Arg
	b := []byte(s)
	i := skipSpaces(b, 0)
	for i < len(b) {
		start := i
		inQuote, quoted := false, false
		if b[i] == '"' {
			i++
			start = i
			inQuote, quoted = true, true
		}
		equals := -1
		j := start
		for ; j < len(b); j++ {
			if isSpace(b[j]) && !inQuote {
				break
			}
			if equals < 0 && b[j] == '=' && j > start { // next_arg's equals==0 sentinel
				equals = j
			}
			if b[j] == '"' {
				inQuote = !inQuote
			}
		}
		end := j // exclusive end of this argument
		trimEnd := end
		a := Arg{}
		if equals < 0 {
			if quoted && trimEnd > start && b[trimEnd-1] == '"' {
				trimEnd--
			}
			a.Key = string(b[start:trimEnd])
		} else {
			a.Key = string(b[start:equals])
			a.HasValue = true
			vs := equals + 1
			if vs < end && b[vs] == '"' {
				vs++
				if b[end-1] == '"' && end-1 >= vs {
					trimEnd = end - 1
				}
			}
			if quoted && trimEnd > vs && trimEnd == end && b[trimEnd-1] == '"' {
				trimEnd--
			}
			if trimEnd < vs {
				trimEnd = vs
			}
			a.Value = string(b[vs:trimEnd])
		}
		if a.Key == "--" && !a.HasValue {
			break
		}
		out = append(out, a)
		i = skipSpaces(b, end)
	}
	return out
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'
}

func skipSpaces(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

// paramKey folds '-' into '_' as the kernel's parameq does for parameter names.
func paramKey(k string) string { return strings.ReplaceAll(k, "-", "_") }

type setter func(c *Config, v string) error

func oneOf[T ~string](dst *T, v string, allowed ...T) error {
	for _, a := range allowed {
		if string(a) == v {
			*dst = a
			return nil
		}
	}
	names := make([]string, len(allowed))
	for i, a := range allowed {
		names[i] = string(a)
	}
	return fmt.Errorf("want one of %s", strings.Join(names, "|"))
}

func nonEmpty(dst *string) setter {
	return func(_ *Config, v string) error {
		if v == "" {
			return fmt.Errorf("empty value")
		}
		*dst = v
		return nil
	}
}

func absPath(v string) error {
	if !strings.HasPrefix(v, "/") {
		return fmt.Errorf("want an absolute path")
	}
	return nil
}

func duration(dst *time.Duration, v string) error {
	d, err := time.ParseDuration(v)
	if err != nil {
		return fmt.Errorf("want a duration like 30s: %v", err)
	}
	if d <= 0 || d > 24*time.Hour {
		return fmt.Errorf("want a duration between 0 and 24h")
	}
	*dst = d
	return nil
}

// params maps each passage.* key (after the passage. prefix, '-' folded to '_') to its
// parser. doc.go documents every one of them; TestParamsDocumented keeps the two in step.
var params = map[string]setter{
	// A built-in profile's name, or a profile file in the image by its absolute path
	// (topology.LoadProfile reads it): a relative path would resolve against whatever
	// directory the boot runs in.
	"profile": func(c *Config, v string) error {
		switch {
		case v == "" || strings.ContainsAny(v, " \t"):
			return fmt.Errorf("want a built-in profile name or the absolute path of a profile file")
		case strings.HasPrefix(v, "/"):
			if !strings.HasSuffix(v, ".yaml") && !strings.HasSuffix(v, ".yml") && !strings.HasSuffix(v, ".json") {
				return fmt.Errorf("profile file %s: want a .yaml, .yml or .json file", v)
			}
		case strings.ContainsRune(v, '/') || strings.HasSuffix(v, ".yaml") || strings.HasSuffix(v, ".yml") || strings.HasSuffix(v, ".json"):
			return fmt.Errorf("profile file %s: want an absolute path (the file in the image, e.g. /etc/passage/%s)", v, filepath.Base(v))
		}
		c.Profile = v
		return nil
	},
	"key": func(c *Config, v string) error {
		if err := absPath(v); err != nil {
			return err
		}
		c.Key = v
		return nil
	},
	"tpm": func(c *Config, v string) error { return oneOf(&c.TPM, v, TPMOn, TPMOff, TPMAuto) },
	"ats": func(c *Config, v string) error { return oneOf(&c.ATS, v, ATSRequire, ATSPrefer) },
	"net": func(c *Config, v string) error {
		if v == "" || len(v) > 15 || strings.ContainsAny(v, "/ :") {
			// IFNAMSIZ is 16 with the NUL; '/' and ':' are refused by dev_valid_name.
			return fmt.Errorf("want auto, off or an interface name")
		}
		c.Net = v
		return nil
	},
	"url": func(c *Config, v string) error {
		if !strings.HasPrefix(v, "http://") && !strings.HasPrefix(v, "https://") {
			return fmt.Errorf("want an http:// or https:// URL")
		}
		c.URL = v
		return nil
	},
	"url_insecure": func(c *Config, v string) error {
		switch v {
		case "on", "1":
			c.URLInsecure = true
		case "off", "0":
			c.URLInsecure = false
		default:
			return fmt.Errorf("want on or off")
		}
		return nil
	},
	"push": func(c *Config, v string) error {
		if !strings.HasPrefix(v, "http://") && !strings.HasPrefix(v, "https://") {
			return fmt.Errorf("want the http:// or https:// URL of a Prometheus Pushgateway")
		}
		c.Push = strings.TrimRight(v, "/")
		return nil
	},
	"out": func(c *Config, v string) error {
		if v == "/run" || v == RunDir {
			c.Out = Out{}
			return nil
		}
		dev, path, ok := strings.Cut(v, ":")
		if !ok || !strings.HasPrefix(dev, "/dev/") || len(dev) == len("/dev/") {
			return fmt.Errorf("want /run or <block device>:<path>, e.g. /dev/vda1:/passage")
		}
		if err := absPath(path); err != nil {
			return fmt.Errorf("path %q: %v", path, err)
		}
		c.Out = Out{Device: dev, Path: filepath.Clean(path)}
		return nil
	},
	"handoff": func(c *Config, v string) error {
		return oneOf(&c.Handoff, v, HandoffSwitchRoot, HandoffPoweroff, HandoffShell, HandoffHold)
	},
	"root": func(c *Config, v string) error {
		if _, err := rootdev.Parse(v); err != nil {
			return err
		}
		c.Root = v
		return nil
	},
	"hostname": func(c *Config, v string) error {
		if err := CheckHostname(v); err != nil {
			return fmt.Errorf("want an RFC 1123 host name (letters, digits, hyphens and dots, at most %d bytes): %v", MaxHostname, err)
		}
		c.Hostname = v
		return nil
	},
	"rootwait":   func(c *Config, v string) error { return duration(&c.RootWait, v) },
	"rootfstype": func(c *Config, v string) error { return nonEmpty(&c.RootFSType)(c, v) },
	"init": func(c *Config, v string) error {
		if err := absPath(v); err != nil {
			return err
		}
		c.Init = v
		return nil
	},
	"emit":          func(c *Config, v string) error { return oneOf(&c.Emit, v, EmitConsole, EmitOff) },
	"stage_timeout": func(c *Config, v string) error { return duration(&c.StageTimeout, v) },
	"net_timeout":   func(c *Config, v string) error { return duration(&c.NetTimeout, v) },
	"publish_for":   func(c *Config, v string) error { return duration(&c.PublishFor, v) },
	"erase": func(c *Config, v string) error {
		if v != "off" && v != "auto" && v != "require" {
			return fmt.Errorf("want one of off|auto|require")
		}
		c.Erase = v
		return nil
	},
	"erase_timeout": func(c *Config, v string) error { return duration(&c.EraseTimeout, v) },
	"plan": func(c *Config, v string) error {
		h, ok := strings.CutPrefix(v, "sha256:")
		if _, err := hex.DecodeString(h); !ok || err != nil || len(h) != 2*sha256.Size {
			return fmt.Errorf("want sha256:<64 hex digits>, the digest of the saved plan the image was built with")
		}
		c.Plan = v
		return nil
	},
	"erase_overwrite": func(c *Config, v string) error {
		switch v {
		case "on":
			c.EraseOverwrite = true
		case "off":
			c.EraseOverwrite = false
		default:
			return fmt.Errorf("want on or off")
		}
		return nil
	},
	"host_modules": func(c *Config, v string) error {
		var mods []string
		if v != "" {
			for _, m := range strings.Split(v, ",") {
				if m == "" || strings.ContainsAny(m, "/ ") {
					return fmt.Errorf("want a comma-separated list of module names")
				}
				mods = append(mods, m)
			}
		}
		c.HostModules = mods
		return nil
	},
	"emergency": func(c *Config, v string) error {
		return oneOf(&c.Emergency, v, EmergencyHold, EmergencyShell, EmergencyReboot, EmergencyPoweroff)
	},
	"emergency_on": func(c *Config, v string) error {
		return oneOf(&c.EmergencyOn, v, EmergencyOnFailed, EmergencyOnDegraded, EmergencyOnNever)
	},
	"debug": func(c *Config, v string) error {
		switch v {
		case "on", "1":
			c.Debug = true
		case "off", "0":
			c.Debug = false
		default:
			return fmt.Errorf("want on or off (or passage.debug alone)")
		}
		return nil
	},
	"log": func(c *Config, v string) error {
		if err := absPath(v); err != nil {
			return err
		}
		c.Log = v
		return nil
	},
}

// bare are the switches that may be given without a value, as rd.debug is, and the
// value that means.
var bare = map[string]string{"debug": "on"}

// ParamNames returns the passage.* keys the parser knows, sorted.
func ParamNames() []string {
	names := make([]string, 0, len(params))
	for k := range params {
		names = append(names, "passage."+k)
	}
	sort.Strings(names)
	return names
}

// ParseCmdline returns the configuration a kernel command line asks for. It never fails:
// each unknown or malformed passage.* argument adds an ArgError to Config.Errors and leaves
// that setting at its default. A later argument overrides an earlier one, as for the
// kernel's own parameters.
func ParseCmdline(cmdline string) Config {
	c := Defaults()
	c.Cmdline = cmdline
	for _, a := range SplitCmdline(cmdline) {
		name, ok := strings.CutPrefix(a.Key, "passage.")
		if !ok {
			continue
		}
		written := a.Key
		if a.HasValue {
			written += "=" + a.Value
		}
		if !utf8.ValidString(written) {
			written = strings.ToValidUTF8(written, "\uFFFD")
		}
		set, known := params[paramKey(name)]
		switch {
		case !known:
			c.Errors = append(c.Errors, &ArgError{Arg: written, Reason: "unknown passage argument (known: " + strings.Join(ParamNames(), ", ") + ")"})
		case !a.HasValue && bare[paramKey(name)] != "":
			set(&c, bare[paramKey(name)])
		case !a.HasValue:
			c.Errors = append(c.Errors, &ArgError{Arg: written, Reason: "missing =value"})
		default:
			if err := set(&c, a.Value); err != nil {
				c.Errors = append(c.Errors, &ArgError{Arg: written, Reason: err.Error()})
			}
		}
	}
	if c.Handoff == HandoffSwitchRoot && c.Root == "" {
		c.Errors = append(c.Errors, &ArgError{Arg: "passage.handoff=switch_root", Reason: "needs passage.root=; holding instead"})
		c.Handoff = HandoffHold
	}
	return c
}

// ReadConfig parses root/proc/cmdline. root is "/" on the node and a synthetic tree in
// tests. Only an unreadable /proc/cmdline is an error; argument problems go to
// Config.Errors.
func ReadConfig(root string) (Config, error) {
	p := filepath.Join(root, "proc", "cmdline")
	b, err := os.ReadFile(p)
	if err != nil {
		c := Defaults()
		return c, fmt.Errorf("cmdline %s: %w", p, err)
	}
	return ParseCmdline(strings.TrimRight(string(b), "\n")), nil
}

// ErrorStrings renders Config.Errors for the manifest and the log.
func (c Config) ErrorStrings() []string {
	out := make([]string, len(c.Errors))
	for i, e := range c.Errors {
		out[i] = e.Error()
	}
	return out
}

// SecureURL says why the boot will not publish to passage.url, or nil: a plain-http URL
// to a host that is not loopback is refused unless insecure (passage.url_insecure=1).
// The attestation's event logs travel unsigned: on plain http anyone on the path can
// change them, and while no change can make a boot verified, a box that rewrites an
// event's type can make an approved boot read as an unapproved one and get the node
// evicted. Over https only the node and the control plane see them.
func SecureURL(raw string, insecure bool) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("passage.url %q: %w", raw, err)
	}
	if u.Scheme != "http" || insecure || LoopbackURL(raw) == nil {
		return nil
	}
	return fmt.Errorf("passage.url %s is plain http: anyone on the path could change what the control plane judges; use https, or passage.url_insecure=1 to publish anyway", raw)
}

// LoopbackURL says why passage.url cannot be published to with passage.net=off, or nil
// when it can: its host is an address the kernel keeps on the loopback device (an IP
// literal in 127.0.0.0/8 or ::1, IPv4-mapped included) or the name "localhost". A boot
// with passage.net=off brings up no network, so any other host is reached, if at all,
// through a network someone else configured (the workstation a `boot --root` runs on):
// the boot would publish where its command line said it would not. Other names are
// refused, "*.localhost" too: the name would depend on a resolver. The publish stage's
// dialer holds "localhost" to loopback addresses (stages/boot).
func LoopbackURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("passage.url %q: %w", raw, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("passage.url %q: scheme %q, want http or https", raw, u.Scheme)
	}
	host := u.Hostname()
	if strings.EqualFold(host, "localhost") {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("passage.url host %q is not loopback (127.0.0.0/8, ::1 or localhost) and passage.net=off brings up no network to reach it", host)
}
