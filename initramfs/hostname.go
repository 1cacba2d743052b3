package initramfs

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

// MaxHostname is the longest host name the kernel keeps: __NEW_UTS_LEN
// (include/uapi/linux/utsname.h); sethostname(2) refuses a longer one with EINVAL.
const MaxHostname = 64

// NoHostname is what the kernel's hostname reads before anything sets one: the default
// of CONFIG_DEFAULT_HOSTNAME (init/Kconfig), Debian's too. It is no node's name, and the
// manifest never signs it (manifest.ReadNode reads it as "").
const NoHostname = "(none)"

// CheckHostname says why name is not a host name the node can take, or nil: an RFC 1123
// (section 2.1) host name, labels of 1 to 63 letters, digits and hyphens, neither
// starting nor ending with a hyphen, joined by dots, at most MaxHostname bytes (the
// kernel's limit, tighter than DNS's 253), and not an IPv4 address in dotted form (RFC
// 1123 asks software to tell the two apart). Upper case is a host name too (DNS names
// are case-insensitive); ChooseHostname folds it.
func CheckHostname(name string) error {
	switch {
	case name == "":
		return errors.New("empty")
	case len(name) > MaxHostname:
		return fmt.Errorf("%d bytes, the kernel keeps at most %d", len(name), MaxHostname)
	case net.ParseIP(name) != nil:
		return errors.New("an IP address, not a host name")
	}
	for _, l := range strings.Split(name, ".") {
		if l == "" {
			return errors.New("an empty label (leading, trailing or doubled dot)")
		}
		if len(l) > 63 {
			return fmt.Errorf("label %q is %d characters, at most 63", l, len(l))
		}
		if l[0] == '-' || l[len(l)-1] == '-' {
			return fmt.Errorf("label %q starts or ends with a hyphen", l)
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-') {
				return fmt.Errorf("%q is not a letter, digit or hyphen (RFC 1123 host names have no other characters)", string(rune(c)))
			}
		}
	}
	return nil
}

// HostnameSource says where the node's name came from.
type HostnameSource string

const (
	// HostnameArgument is passage.hostname=: per machine from the boot loader (iPXE's
	// ${hostname}, a UKI's command line).
	HostnameArgument HostnameSource = "passage.hostname="
	// HostnameKernel is a name the kernel already had when passage started: the kernel's
	// own hostname= argument (Linux 5.19+) or a CONFIG_DEFAULT_HOSTNAME other than (none).
	HostnameKernel HostnameSource = "kernel"
	// HostnameDHCP is option 12 of a DHCP lease (RFC 2132, 3.14) the network stage got.
	HostnameDHCP HostnameSource = "DHCP option 12"
)

// DHCPName is the host name option of one lease, as the server sent it.
type DHCPName struct {
	Iface  string // the interface that got the lease
	Server string // the server that gave it
	Name   string // option 12, "" when the server sent none
}

// Hostname is the node's name, as ChooseHostname decides it.
type Hostname struct {
	Name   string         // lower case; "" when there is none
	Source HostnameSource // "" with no name
	// Set says the kernel's hostname must be set to Name: it reads something else.
	Set bool
	// Notes say what was passed over and why (a name in another case, a DHCP name
	// that is not a host name, a second lease with another name).
	Notes []string
	// Missing says, when there is no name, where none was found.
	Missing string
}

// ChooseHostname decides the node's name: passage.hostname= first (arg, "" when not
// given), then the name the kernel already has (current, as /proc/sys/kernel/hostname
// reads; NoHostname and "" are none), then the first lease's DHCP option 12 that is a
// host name, in the order the network stage got them (the management NIC first). The
// kernel argument wins because it is the operator's word for this machine, written
// where the boot loader (iPXE, a signed UKI's measured command line) puts it, while
// anyone on the provisioning network can answer DHCP.
//
// The name is folded to lower case: DNS names are case-insensitive, the kubelet
// registers its Node under the lower-case hostname, and passage-dra's pool and
// passage-control's record are named after the manifest's hostname, which must match it
// (Kubernetes names are lower-case RFC 1123 subdomains).
func ChooseHostname(arg, current string, dhcp []DHCPName) Hostname {
	var h Hostname
	take := func(name string, src HostnameSource) Hostname {
		h.Name, h.Source = strings.ToLower(name), src
		if h.Name != name {
			h.Notes = append(h.Notes, fmt.Sprintf("%s %q folded to lower case (DNS names are case-insensitive; Kubernetes names the node in lower case)", src, name))
		}
		h.Set = current != h.Name
		for _, d := range dhcp {
			if d.Name != "" && !strings.EqualFold(d.Name, h.Name) && src != HostnameDHCP {
				h.Notes = append(h.Notes, fmt.Sprintf("DHCP option 12 %q on %s (server %s) not taken: %s comes first", d.Name, d.Iface, d.Server, src))
			}
		}
		return h
	}
	if arg != "" {
		// ParseCmdline took only a host name; checked again for a Config built otherwise.
		if err := CheckHostname(arg); err != nil {
			h.Notes = append(h.Notes, fmt.Sprintf("passage.hostname=%q passed over: %v", arg, err))
		} else {
			return take(arg, HostnameArgument)
		}
	}
	if current != "" && current != NoHostname {
		if err := CheckHostname(current); err != nil {
			h.Notes = append(h.Notes, fmt.Sprintf("the kernel's hostname %q passed over: %v", current, err))
		} else {
			return take(current, HostnameKernel)
		}
	}
	var seen []string
	for i, d := range dhcp {
		if d.Name == "" {
			seen = append(seen, fmt.Sprintf("%s (server %s) sent none", d.Iface, d.Server))
			continue
		}
		if err := CheckHostname(d.Name); err != nil {
			h.Notes = append(h.Notes, fmt.Sprintf("DHCP option 12 %q on %s (server %s) passed over: %v", d.Name, d.Iface, d.Server, err))
			seen = append(seen, fmt.Sprintf("%s (server %s) sent no host name", d.Iface, d.Server))
			continue
		}
		h = take(d.Name, HostnameDHCP)
		for _, o := range dhcp[i+1:] {
			if o.Name != "" && !strings.EqualFold(o.Name, d.Name) {
				h.Notes = append(h.Notes, fmt.Sprintf("DHCP option 12 %q on %s (server %s) not taken: %s's came first", o.Name, o.Iface, o.Server, d.Iface))
			}
		}
		return h
	}
	why := "no DHCP lease"
	if len(seen) > 0 {
		why = "no DHCP option 12: " + strings.Join(seen, ", ")
	}
	h.Missing = fmt.Sprintf("no passage.hostname=, the kernel's hostname is %s, and %s", orNoHostname(current), why)
	return h
}

func orNoHostname(s string) string {
	if s == "" {
		return NoHostname
	}
	return s
}
