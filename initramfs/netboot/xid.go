package netboot

import (
	"math/rand/v2"
	"net"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/insomniacslk/dhcp/iana"
)

// TransactionID is a DHCP transaction ID from the Go runtime's generator (math/rand/v2:
// ChaCha8 seeded at process start from the kernel's AT_RANDOM, which never waits). An
// xid only pairs replies with requests (RFC 2131, 4.1: "a random number"); it is no
// secret, so it must not wait for the kernel's random pool, which dhcpv4's own
// GenerateTransactionID does (getrandom(2), up to dhcpv4.RandomTimeout).
func TransactionID() dhcpv4.TransactionID {
	var x dhcpv4.TransactionID
	v := rand.Uint32()
	x[0], x[1], x[2], x[3] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
	return x
}

// requestedOptions are the options a DISCOVER and a REQUEST ask for: dhcpv4's defaults,
// and the host name (option 12), which some servers (ISC dhcpd) send only when the
// client's parameter request list names it (RFC 2132, 9.8).
var requestedOptions = []dhcpv4.OptionCode{
	dhcpv4.OptionSubnetMask, dhcpv4.OptionRouter, dhcpv4.OptionDomainName, dhcpv4.OptionDomainNameServer,
	dhcpv4.OptionHostName,
}

// bootRequest is what dhcpv4.New and NewDiscovery build (RFC 2131, 4.4.1, table 5),
// with the transaction ID given.
func bootRequest(hw net.HardwareAddr, xid dhcpv4.TransactionID, t dhcpv4.MessageType) *dhcpv4.DHCPv4 {
	d := &dhcpv4.DHCPv4{
		OpCode:        dhcpv4.OpcodeBootRequest,
		HWType:        iana.HWTypeEthernet,
		ClientHWAddr:  append(net.HardwareAddr(nil), hw...),
		TransactionID: xid,
		ClientIPAddr:  net.IPv4zero,
		YourIPAddr:    net.IPv4zero,
		ServerIPAddr:  net.IPv4zero,
		GatewayIPAddr: net.IPv4zero,
		Options:       make(dhcpv4.Options),
	}
	dhcpv4.WithRequestedOptions(requestedOptions...)(d)
	dhcpv4.WithMessageType(t)(d)
	dhcpv4.WithOption(dhcpv4.OptMaxMessageSize(nclient4.MaxMessageSize))(d)
	return d
}

// requestFromOffer is dhcpv4.NewRequestFromOffer without the random draw: the REQUEST
// carries the OFFER's transaction ID (RFC 2131, 4.4.1: the client's xid, which the
// server echoed).
func requestFromOffer(offer *dhcpv4.DHCPv4) *dhcpv4.DHCPv4 {
	d := bootRequest(offer.ClientHWAddr, offer.TransactionID, dhcpv4.MessageTypeRequest)
	dhcpv4.WithReply(offer)(d) // a BOOTREQUEST with the OFFER's xid, hardware address and flags
	dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest)(d)
	dhcpv4.WithClientIP(offer.ClientIPAddr)(d)
	dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(offer.YourIPAddr))(d)
	dhcpv4.WithOptionCopied(offer, dhcpv4.OptionServerIdentifier)(d)
	return d
}
