package kubevirthook

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"libvirt.org/go/libvirtxml"

	"github.com/passage-boot/passage/topology"
)

// QEMU's physical address width for a CPU model that does not take the host's: a named
// model, or libvirt's host-model, which names one (phys-bits defaults to 40,
// target/i386/cpu.c). host-passthrough is QEMU's "host" CPU, whose host-phys-bits is on:
// the guest gets the host's width.
const namedModelWidth = 40

// checkGuestWidth refuses a domain whose guest cannot map every BAR of the units the
// plan gives it: OVMF's 64-bit window follows the guest's physical address width
// (topology.MMIO), and what virt-launcher keeps of a domain between its calls
// (KubeVirt's api.DomainSpec) holds neither libvirt's <maxphysaddr> nor
// <qemu:commandline>, so the hook sets no width: it reads the one the domain's CPU mode
// gives and refuses before the guest starts, rather than let the tenant find a GPU with
// "BAR0 is 0M". hostBits is the node's own width (0: unknown, not checked).
func checkGuestWidth(d *libvirtxml.Domain, g *topology.Guest, hostBits int) error {
	if hostBits == 0 || g == nil || len(g.Units) == 0 {
		return nil
	}
	m := g.MMIO()
	mode, width := "none", namedModelWidth
	if d.CPU != nil && d.CPU.Mode != "" {
		mode = d.CPU.Mode
	}
	how := "QEMU's default for a named CPU model; spec.domain.cpu.model: host-passthrough gives the host's " + strconv.Itoa(hostBits)
	if mode == "host-passthrough" || mode == "maximum" {
		width, how = hostBits, "the host's"
	}
	if err := m.CheckWidth(width, len(g.Units)); err != nil {
		return fmt.Errorf("%w (cpu mode %s: %s)", err, mode, how)
	}
	return nil
}

// HostPhysBits reads the node's physical address width from cpuinfo ("address sizes :
// 52 bits physical, 57 bits virtual"), as the kernel reports x86_phys_bits.
func HostPhysBits(cpuinfo string) (int, error) {
	f, err := os.Open(cpuinfo)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || strings.TrimSpace(k) != "address sizes" {
			continue
		}
		bits, _, _ := strings.Cut(strings.TrimSpace(v), " bits physical")
		n, err := strconv.Atoi(bits)
		if err != nil || n < 32 || n > 64 {
			return 0, fmt.Errorf("%s: address sizes %q: not a physical width", cpuinfo, strings.TrimSpace(v))
		}
		return n, nil
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("%s: %w", cpuinfo, err)
	}
	return 0, fmt.Errorf("%s: no address sizes line", cpuinfo)
}
