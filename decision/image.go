package decision

import (
	"encoding/hex"
	"fmt"
	"slices"
	"strings"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// PlanArg names, on the kernel command line, the digest of the saved plan (`passage plan
// -o F`) a signed boot image was built with (`make uki PLAN=F`): the image's
// pci=config_acs= is that plan's kernel argument.
const PlanArg = "passage.plan"

// ImagePlan is the ACS plan the kernel command line carries, and how this node's own
// plan compares with it. The kernel programs that argument before passage runs (Linux
// 6.11+), which a locked-down kernel (Secure Boot) leaves as the only way to set ACS.
type ImagePlan struct {
	// Digest is PlanArg's value ("sha256:<hex>"), "" when the line has none.
	Digest string `json:"digest,omitempty"`
	// ConfigACS is the pci=config_acs= argument ("" when the line has none).
	ConfigACS string `json:"config_acs,omitempty"`
	// Matched says this node plans exactly the ports and settings the argument sets.
	Matched bool `json:"matched"`
	// Differences name each port where the two plans differ.
	Differences []string `json:"differences,omitempty"`
	// Kernel is what the kernel log says it did with the argument: "configured N
	// ports", "refused", "no port configured", or "" without a log.
	Kernel string `json:"kernel,omitempty"`

	acs  *apply.ConfigACS
	tree *pci.Tree
	log  apply.KernelACSLog
}

// CommandLineSize is the x86 kernel's COMMAND_LINE_SIZE (arch/x86/include/asm/setup.h),
// the terminating NUL included: the kernel keeps at most CommandLineSize-1 bytes of the
// line the loader gives it (the boot protocol's cmdline_size, arch/x86/boot/header.S,
// is COMMAND_LINE_SIZE-1) and drops the rest without a word.
const CommandLineSize = 2048

// KernelKeeps is the longest command line the kernel keeps: a line of this length may be
// what is left of a longer one, and the boot cannot tell which.
const KernelKeeps = CommandLineSize - 1

// MaxCmdline is the longest command line passage signs: one byte short of what the kernel
// keeps, so that the line a node boots with is always one the boot can tell is whole.
const MaxCmdline = KernelKeeps - 1

// reading is the kernel's reading of the argument for the port at a.
func (ip *ImagePlan) reading(a pci.Address) apply.Reading {
	return ip.acs.For(ip.tree, a)
}

// parsePlanDigest returns the last passage.plan= value on the line (the kernel's own
// rule for a repeated argument), and whether it is a well-formed sha256 digest. The line
// is split as the kernel splits it (initramfs.SplitCmdline, next_arg).
func parsePlanDigest(cmdline string) (string, bool) {
	v := ""
	for _, a := range initramfs.SplitCmdline(cmdline) {
		if a.Key == PlanArg && a.HasValue {
			v = a.Value
		}
	}
	h, ok := strings.CutPrefix(v, "sha256:")
	if _, err := hex.DecodeString(h); !ok || err != nil || len(h) != 64 {
		return v, false
	}
	return v, true
}

// imagePlan reads the argument and the plan digest off the command line and compares the
// argument, as the kernel reads it for each port of tree, with ports, this node's plan;
// nil when the line carries neither.
func imagePlan(live Live, tree *pci.Tree, ports []topology.ACSPort) *ImagePlan {
	acs := apply.ParseConfigACS(live.Cmdline)
	digest, ok := parsePlanDigest(live.Cmdline)
	if acs == nil && digest == "" {
		return nil
	}
	ip := &ImagePlan{Digest: digest, acs: acs, tree: tree, log: apply.ParseKernelACSLog(live.KernelLog)}
	if len(live.Cmdline) >= KernelKeeps {
		// A line at the limit may be what is left of a longer one: the arguments past it
		// (passage.plan= comes last in every image make uki builds) are gone.
		ip.Differences = append(ip.Differences, fmt.Sprintf("the command line is %d bytes, as long as the kernel keeps (%d, COMMAND_LINE_SIZE %d): it may have been cut off", len(live.Cmdline), KernelKeeps, CommandLineSize))
	}
	if !ok && digest != "" {
		ip.Differences = append(ip.Differences, fmt.Sprintf("%s=%q is not a sha256:<hex> digest", PlanArg, digest))
	}
	if acs == nil {
		ip.Differences = append(ip.Differences, "the command line carries "+PlanArg+"= but no pci=config_acs=")
	}
	seen := map[pci.Address]bool{}
	for _, p := range ports {
		if p.Offset == 0 || p.Mask == 0 {
			continue
		}
		seen[p.Addr] = true
		switch r := ip.reading(p.Addr); {
		case !r.Set && r.Why != "":
			ip.Differences = append(ip.Differences, fmt.Sprintf("acs %s (%s): this node plans %s, the image nothing: %s",
				p.Addr, p.Position, topology.ConfigACSFlags(p.Mask, p.Flags), r.Why))
		case !r.Set:
			ip.Differences = append(ip.Differences, fmt.Sprintf("acs %s (%s): this node plans %s, the image nothing",
				p.Addr, p.Position, topology.ConfigACSFlags(p.Mask, p.Flags)))
		case !r.Setting.Plans(p):
			ip.Differences = append(ip.Differences, fmt.Sprintf("acs %s (%s): this node plans %s, the image %s (the kernel applies the first entry that matches a port)",
				p.Addr, p.Position, topology.ConfigACSFlags(p.Mask, p.Flags), r.Setting.Entry))
		}
	}
	ip.ConfigACS = acs.Arg()
	var extra []string
	if tree != nil {
		for _, d := range tree.Devices {
			if seen[d.Addr] || d.ACS == nil {
				continue
			}
			if r := ip.reading(d.Addr); r.Set {
				seen[d.Addr] = true
				extra = append(extra, fmt.Sprintf("acs %s: the image sets %s, which this node's plan does not hold", d.Addr, r.Setting.Entry))
			}
		}
	}
	for a, e := range acs.Named() {
		if !seen[a] && (tree == nil || tree.Lookup(a) == nil || tree.Lookup(a).ACS == nil) {
			extra = append(extra, fmt.Sprintf("acs %s: the image plans %s, which this node's plan does not hold", a, e))
		}
	}
	slices.Sort(extra)
	ip.Differences = append(ip.Differences, extra...)
	ip.Matched = len(ip.Differences) == 0
	switch l := ip.log; {
	case !l.Read:
	case l.Refused:
		ip.Kernel = "refused"
	case len(l.Configured) == 0:
		ip.Kernel = "no port configured"
	default:
		ip.Kernel = fmt.Sprintf("configured %d ports", len(l.Configured))
	}
	return ip
}

// lockedPort judges a port of a live unit that a locked-down kernel leaves as it is
// although the plan wants another value: the port stays at p.Current. ok is false when
// the line carries no argument (the caller gives the lockdown advice instead).
func (ip *ImagePlan) lockedPort(p topology.ACSPort, release string) (s topology.Status, why string, ok bool) {
	if ip == nil || ip.acs == nil {
		return "", "", false
	}
	r := ip.reading(p.Addr)
	e := r.Setting
	if !r.Set || !e.Plans(p) {
		image := "has no entry for it"
		switch {
		case r.Set:
			image = "sets " + e.Entry + " (the first entry that matches it, the one the kernel applies)"
		case r.Why != "":
			image = "has no entry the kernel applies to it (" + r.Why + ")"
		}
		return topology.StatusFailed, fmt.Sprintf("acs %s (%s): the image's pci=config_acs= %s, this node plans %s@%s and a locked-down kernel takes no other (ACSCtl reads 0x%04x): the image was planned for another topology",
			p.Addr, p.Position, image, topology.ConfigACSFlags(p.Mask, p.Flags), p.Addr, uint16(p.Current)), true
	}
	s = topology.StatusDegraded
	if want := p.Flags & pci.ACSIsolation; p.Current&want != want {
		s = topology.StatusFailed
	}
	return s, fmt.Sprintf("acs %s (%s): mismatch: pci=config_acs=%s asks ACSCtl 0x%04x, reads 0x%04x: %s",
		p.Addr, p.Position, e.Entry, uint16(p.Target()), uint16(p.Current), ip.log.KernelSays(p.Addr, release)), true
}

// Summary is one line on the image's plan and this node, for the console and plan.
func (ip *ImagePlan) Summary() string {
	digest := ip.Digest
	if digest == "" {
		digest = "no " + PlanArg + "="
	}
	s := fmt.Sprintf("image plan %s: this node matches it", digest)
	if !ip.Matched {
		s = fmt.Sprintf("image plan %s: this node differs at %d ports", digest, len(ip.Differences))
	}
	if ip.Kernel != "" {
		s += "; kernel: " + ip.Kernel
	}
	return s
}
