// Package netboot brings up the management NIC of a node being provisioned (link up,
// DHCPv4 lease, address and default route) and publishes the signed manifest envelope to
// an HTTP endpoint. Everything is bounded: a node without a network still finishes its
// boot, and the failure is in the boot's report and log (the manifest is written before
// the network is brought up).
package netboot

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/vishvananda/netlink"
)

// Iface is a network interface backed by a PCI function.
type Iface struct {
	Name string // /sys/class/net/<Name>
	BDF  string // basename of /sys/class/net/<Name>/device, e.g. 0000:00:02.0
}

// Candidates lists the interfaces under root/sys/class/net that sit on a PCI function
// (the "device" link resolves to a PCI address), sorted by name. Loopback, bridges and
// other virtual links have no device and are left out. root is "/" on the node.
func Candidates(root string) ([]Iface, error) {
	dir := filepath.Join(root, "sys", "class", "net")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("netboot %s: %w", dir, err)
	}
	var out []Iface
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name(), "device"))
		if err != nil {
			continue
		}
		bdf := filepath.Base(target)
		if !isBDF(bdf) {
			continue
		}
		out = append(out, Iface{Name: e.Name(), BDF: bdf})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// isBDF accepts the sysfs spelling dddd:bb:dd.f.
func isBDF(s string) bool {
	var d, b, dev, fn int
	n, err := fmt.Sscanf(s, "%04x:%02x:%02x.%1d", &d, &b, &dev, &fn)
	return err == nil && n == 4 && len(s) == 12
}

// Lease is what DHCP gave an interface.
type Lease struct {
	Iface   string     `json:"iface"`
	MAC     string     `json:"mac"`
	Addr    *net.IPNet `json:"-"`
	CIDR    string     `json:"addr"`
	Router  net.IP     `json:"router,omitempty"`
	Server  net.IP     `json:"server,omitempty"`
	LeaseS  int        `json:"lease_s,omitempty"`
	Elapsed string     `json:"elapsed"`
	// CarrierWait is how long Up waited for carrier after setting the link up: what is
	// left of the PHY's negotiation when the link was set up earlier (LinkUp).
	CarrierWait string `json:"carrier_wait,omitempty"`
	// Hostname is the server's option 12 (RFC 2132, 3.14) as sent, NULs trimmed: the
	// node's name when no kernel argument gives one (initramfs.ChooseHostname decides).
	Hostname string `json:"hostname,omitempty"`
}

// DHCPPolicy bounds one interface's DHCP exchange. nclient4 doubles the wait after each
// unanswered try, so a message costs at most Timeout*(2^Tries-1); the context caps it too.
type DHCPPolicy struct {
	Timeout time.Duration // first wait for a reply
	Tries   int           // sends per message (DISCOVER, then REQUEST)
	// XID gives the exchange's transaction ID; nil is TransactionID, which never waits
	// for the kernel's random pool (xid.go).
	XID func() dhcpv4.TransactionID
	// Waiting is told what the exchange waits on (carrier, an OFFER, an ACK) until the
	// returned func is called: stages.Result.Wait, so an abandoned network stage names
	// it. Nil: not told.
	Waiting func(what string) (done func())
}

func (p DHCPPolicy) wait(what string) func() {
	if p.Waiting == nil {
		return func() {}
	}
	return p.Waiting(what)
}

// DefaultDHCP gives up on a silent network after 1+2+4 = 7 s per message.
var DefaultDHCP = DHCPPolicy{Timeout: time.Second, Tries: 3}

// Acquire runs DISCOVER/OFFER/REQUEST/ACK on client and returns the lease it got. The
// messages are built here, not by dhcpv4.NewDiscovery and NewRequestFromOffer: those
// draw the transaction ID from getrandom(2) before any modifier can set it, and block
// until the kernel's random pool is ready (xid.go).
func Acquire(ctx context.Context, client *nclient4.Client, iface string, p DHCPPolicy) (Lease, error) {
	start := time.Now()
	xid := p.XID
	if xid == nil {
		xid = TransactionID
	}
	discover := bootRequest(client.InterfaceAddr(), xid(), dhcpv4.MessageTypeDiscover)
	done := p.wait(fmt.Sprintf("a DHCP OFFER on %s (xid %s)", iface, discover.TransactionID))
	offer, err := client.SendAndRead(ctx, client.RemoteAddr(), discover, nclient4.IsMessageType(dhcpv4.MessageTypeOffer))
	done()
	if err != nil {
		return Lease{}, fmt.Errorf("dhcp %s: no OFFER for DISCOVER %s: %w", iface, discover.TransactionID, err)
	}
	request := requestFromOffer(offer)
	done = p.wait(fmt.Sprintf("a DHCP ACK on %s from %v (xid %s)", iface, offer.ServerIdentifier(), request.TransactionID))
	ack, err := client.SendAndRead(ctx, client.RemoteAddr(), request, nclient4.IsAll(
		nclient4.IsCorrectServer(offer.ServerIdentifier()),
		nclient4.IsMessageType(dhcpv4.MessageTypeAck, dhcpv4.MessageTypeNak)))
	done()
	if err != nil {
		return Lease{}, fmt.Errorf("dhcp %s: no ACK for REQUEST %s: %w", iface, request.TransactionID, err)
	}
	if ack.MessageType() == dhcpv4.MessageTypeNak {
		return Lease{}, fmt.Errorf("dhcp %s: %w", iface, &nclient4.ErrNak{Offer: offer, Nak: ack})
	}
	le, err := leaseFromACK(iface, ack)
	if err != nil {
		return Lease{}, err
	}
	le.MAC = client.InterfaceAddr().String()
	le.Elapsed = time.Since(start).Round(time.Millisecond).String()
	return le, nil
}

func leaseFromACK(iface string, ack *dhcpv4.DHCPv4) (Lease, error) {
	if ack == nil {
		return Lease{}, fmt.Errorf("dhcp %s: no ACK", iface)
	}
	ip := ack.YourIPAddr.To4()
	if ip == nil || ip.IsUnspecified() {
		return Lease{}, fmt.Errorf("dhcp %s: ACK from %v has no address", iface, ack.ServerIPAddr)
	}
	mask := ack.SubnetMask()
	if mask == nil {
		// RFC 2131 leaves the mask optional; fall back to the classful one as dhclient does.
		mask = ip.DefaultMask()
	}
	le := Lease{Iface: iface, Addr: &net.IPNet{IP: ip, Mask: mask}}
	le.CIDR = le.Addr.String()
	if r := ack.Router(); len(r) > 0 {
		le.Router = r[0]
	}
	le.Server = ack.ServerIdentifier()
	if d := ack.IPAddressLeaseTime(0); d > 0 {
		le.LeaseS = int(d.Seconds())
	}
	le.Hostname = ack.HostName()
	return le, nil
}

// LinkUp sets iface administratively up (IFF_UP) and returns without waiting for
// carrier: the PHY starts autonegotiation then, and an e1000e takes about 2 s to report
// carrier, so a caller that sets the link up early overlaps that wait with other work.
// Setting a link that is already up again is a no-op, which is why Up may repeat it.
func LinkUp(iface string) error {
	_, err := linkUp(iface)
	return err
}

func linkUp(iface string) (netlink.Link, error) {
	link, err := netlink.LinkByName(iface)
	if err != nil {
		return nil, fmt.Errorf("net %s: %w", iface, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return nil, fmt.Errorf("net %s: link up: %w", iface, err)
	}
	return link, nil
}

// Up brings iface up, waits for carrier, leases an address with DHCPv4 and configures it
// (address and default route). ctx bounds the whole of it.
func Up(ctx context.Context, iface string, p DHCPPolicy) (Lease, error) {
	link, err := linkUp(iface)
	if err != nil {
		return Lease{}, err
	}
	waitStart := time.Now()
	done := p.wait("carrier on " + iface)
	err = waitCarrier(ctx, iface)
	done()
	if err != nil {
		return Lease{}, err
	}
	carrierWait := time.Since(waitStart).Round(time.Millisecond).String()
	client, err := nclient4.New(iface, nclient4.WithTimeout(p.Timeout), nclient4.WithRetry(p.Tries))
	if err != nil {
		return Lease{}, fmt.Errorf("dhcp %s: %w", iface, err)
	}
	defer client.Close()
	le, err := Acquire(ctx, client, iface, p)
	if err != nil {
		return Lease{}, err
	}
	le.CarrierWait = carrierWait
	if err := netlink.AddrReplace(link, &netlink.Addr{IPNet: le.Addr}); err != nil {
		return le, fmt.Errorf("net %s: add %s: %w", iface, le.CIDR, err)
	}
	if le.Router != nil {
		r := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: le.Router}
		if err := netlink.RouteReplace(r); err != nil {
			return le, fmt.Errorf("net %s: default route via %s: %w", iface, le.Router, err)
		}
	}
	return le, nil
}

// waitCarrier polls the link's operational state: DHCP packets sent before the PHY
// negotiates are lost, and e1000e takes a second or two.
func waitCarrier(ctx context.Context, iface string) error {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		link, err := netlink.LinkByName(iface)
		if err != nil {
			return fmt.Errorf("net %s: %w", iface, err)
		}
		a := link.Attrs()
		if a.OperState == netlink.OperUp || a.OperState == netlink.OperUnknown && a.RawFlags&uint32(net.FlagRunning) != 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("net %s: no carrier (operstate %s): %w", iface, a.OperState, ctx.Err())
		case <-t.C:
		}
	}
}

// UpAny tries each interface in turn and returns the leases it got; the error joins every
// failure. One lease is enough for the node to be reachable.
func UpAny(ctx context.Context, ifaces []string, p DHCPPolicy) ([]Lease, error) {
	if len(ifaces) == 0 {
		return nil, errors.New("net: no interface to bring up")
	}
	var leases []Lease
	var errs []error
	for _, n := range ifaces {
		le, err := Up(ctx, n, p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		leases = append(leases, le)
	}
	return leases, errors.Join(errs...)
}

// Names returns the interface names.
func Names(ifs []Iface) []string {
	out := make([]string, len(ifs))
	for i, f := range ifs {
		out[i] = f.Name
	}
	return out
}

// Describe is a one-line summary of a lease for the console.
func (l Lease) Describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s: %s", l.Iface, l.MAC, l.CIDR)
	if l.Router != nil {
		fmt.Fprintf(&b, " via %s", l.Router)
	}
	var notes []string
	if l.Server != nil {
		notes = append(notes, fmt.Sprintf("server %s, %s", l.Server, l.Elapsed))
	}
	if l.Hostname != "" {
		notes = append(notes, fmt.Sprintf("host name %q", l.Hostname))
	}
	if l.CarrierWait != "" {
		notes = append(notes, "carrier wait "+l.CarrierWait)
	}
	if len(notes) > 0 {
		fmt.Fprintf(&b, " (%s)", strings.Join(notes, ", "))
	}
	return b.String()
}
