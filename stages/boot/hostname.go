package boot

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/stages"
)

// hostnameFile is where the kernel's hostname reads and writes (kernel/utsname_sysctl.c:
// the same field sethostname(2) sets).
const hostnameFile = "proc/sys/kernel/hostname"

// kernelHostname is the kernel's hostname as <Root>/proc/sys/kernel/hostname reads, ""
// when it cannot be read (a synthetic tree without one).
func (b *Boot) kernelHostname() string {
	s, err := os.ReadFile(b.path(hostnameFile))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(s))
}

// HostnameFromDHCP says whether the node's name can come only from DHCP: no
// passage.hostname=, the kernel has none of its own, and the network stage will run. The
// network stage then runs before the manifest (Stages), so that the name the DHCP server
// gives is the one signed.
func (b *Boot) HostnameFromDHCP() bool {
	if b.Config.Net == initramfs.NetOff {
		return false
	}
	return initramfs.ChooseHostname(b.Config.Hostname, b.kernelHostname(), nil).Name == ""
}

// dhcpNames are the leases' option 12, in the order the network stage got them.
func (b *Boot) dhcpNames() []initramfs.DHCPName {
	b.mu.Lock()
	leases := b.Leases
	b.mu.Unlock()
	out := make([]initramfs.DHCPName, 0, len(leases))
	for _, l := range leases {
		server := "unknown"
		if l.Server != nil {
			server = l.Server.String()
		}
		out = append(out, initramfs.DHCPName{Iface: l.Iface, Server: server, Name: l.Hostname})
	}
	return out
}

// setHostname sets the kernel's hostname: sethostname(2) on the live root, where the OS
// after switch_root keeps it (the UTS namespace is the kernel's, not the initramfs's);
// in a tree given with --root, its proc/sys/kernel/hostname file.
func (b *Boot) setHostname(name string) error {
	if b.SetHostname != nil {
		return b.SetHostname(name)
	}
	if b.Root == "/" {
		return unix.Sethostname([]byte(name))
	}
	dir, err := Beneath(b.Root, filepath.Dir(hostnameFile))
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, filepath.Base(hostnameFile)), []byte(name+"\n"), 0o644)
}

// hostname gives the node its name before the manifest signs it (ChooseHostname: the
// kernel argument, then a name the kernel already has, then DHCP option 12 from the
// network stage, which then ran first). A node with none is degraded and says so: the
// manifest signs an empty hostname, never the kernel's "(none)", and the fleet's
// consumers (passage-dra's pool, passage-control's record, the kubelet's Node) have no
// name to give it.
func (b *Boot) hostname(_ context.Context, _ *stages.State, r *stages.Result) error {
	cur := b.kernelHostname()
	h := initramfs.ChooseHostname(b.Config.Hostname, cur, b.dhcpNames())
	for _, n := range h.Notes {
		r.Findingf("%s", n)
	}
	if h.Name == "" {
		if b.DryRun && b.Config.Net != initramfs.NetOff {
			r.Findingf("dry run: %s; a boot would take DHCP option 12 from the network stage, before the manifest", h.Missing)
			return nil
		}
		r.Degrade("no hostname: %s; the manifest signs none (not %q): give passage.hostname= (iPXE: ${hostname}) or DHCP option 12", h.Missing, initramfs.NoHostname)
		return nil
	}
	if !h.Set {
		r.Findingf("hostname %s (%s)", h.Name, h.Source)
		return nil
	}
	if b.DryRun {
		r.Findingf("dry run: would set the hostname %s (%s)", h.Name, h.Source)
		return nil
	}
	if err := b.setHostname(h.Name); err != nil {
		return fmt.Errorf("sethostname %s (%s): %w", h.Name, h.Source, err)
	}
	// Read back, as every write of the boot is: the manifest signs what the kernel says.
	if got := b.kernelHostname(); got != h.Name {
		return fmt.Errorf("sethostname %s (%s): the kernel's hostname reads %q", h.Name, h.Source, got)
	}
	was := cur
	if was == "" {
		was = initramfs.NoHostname
	}
	r.Changef("hostname %s (%s; was %s)", h.Name, h.Source, was)
	return nil
}
