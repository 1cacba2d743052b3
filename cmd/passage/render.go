package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// cmdRender writes a guest for the chosen units. From a MANIFEST it reads the verified
// manifest and nothing else (no sysfs, no snapshot): what a hypervisor builds a VM from.
// Without, it decides on a tree as plan does: planning output for a node not yet booted,
// said so on stderr. Both give the renderer the same input (hypervisor.Input), so the
// two print the same bytes for the same node. A unit that is not ready is refused (exit
// 1, reason on stderr, nothing on stdout); --allow-degraded admits degraded ones and
// names them.
func cmdRender(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("render", stderr)
	var f planFlags
	f.register(fs)
	var vf verifyFlags
	vf.register(fs)
	var manifestFile string
	deprecatedFlag(fs, "manifest", "the MANIFEST argument", func(v string) error { manifestFile = v; return nil })
	format := fs.String("format", "qemu", "qemu (arguments), libvirt (a complete <domain>), libvirt-devices (the <devices> fragment) or nccl-xml (NCCL_TOPO_FILE)")
	allowDegraded := fs.Bool("allow-degraded", false, "admit degraded units (named on stderr and in the domain's <description>)")
	var dom topology.DomainOptions
	fs.StringVar(&dom.Type, "domain-type", "kvm", "libvirt domain type: kvm, or qemu where there is no KVM")
	fs.StringVar(&dom.Name, "name", "", "libvirt domain name (default passage-<units>)")
	fs.IntVar(&dom.VCPUs, "vcpus", 8, "libvirt domain vCPUs (split across NUMA cells with --numa)")
	fs.IntVar(&dom.MemoryMiB, "memory", 32768, "libvirt domain memory in MiB (split across NUMA cells with --numa)")
	physBits := fs.Int("phys-bits", 0, "the guest's physical address width (libvirt <maxphysaddr mode='emulate'>, QEMU -cpu phys-bits); 0 takes the width the units' BARs need, a narrower one is refused")
	pos, code, ok := parseFlags(fs, args, stdout)
	if !ok {
		return code
	}
	if manifestFile != "" {
		pos = append([]string{manifestFile}, pos...)
	}
	switch len(pos) {
	case 0:
	case 1:
		manifestFile = pos[0]
	default:
		fmt.Fprintf(stderr, "passage render: one MANIFEST, not %q\n", pos)
		return 2
	}
	units := f.units.units()
	var err error
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })

	if *physBits < 0 || *physBits > 64 {
		fmt.Fprintf(stderr, "passage render: --phys-bits %d: want 0 (the width needed) or a width up to 64\n", *physBits)
		return 2
	}
	in := hypervisor.Input{Units: units, NUMA: f.numa, AllowDegraded: *allowDegraded, PhysBits: *physBits}
	if manifestFile != "" {
		for _, name := range []string{"root", "snapshot", "lspci-dump", "profile", "ats", "cmdline"} {
			if set[name] {
				fmt.Fprintf(stderr, "passage render: --%s reads a tree; a MANIFEST renders from the manifest alone\n", name)
				return 2
			}
		}
		ver, signer, code := vf.verify("render", manifestFile, stderr)
		if ver == nil {
			return code
		}
		fmt.Fprintf(stderr, "passage render: %s: signed by %s\n", pr(manifestFile), pr(signer))
		in.HostCPUs, err = hypervisor.HostCPUs(ver.Manifest)
		if err == nil {
			in.Sources, err = hypervisor.Sources(ver.Manifest)
		}
		if err != nil {
			fmt.Fprintf(stderr, "passage render: %s: REFUSED: %v\n", manifestFile, err)
			return 1
		}
	} else {
		for _, name := range []string{"pub", "key", "tpm-pub", "min-generation", "boot-id"} {
			if set[name] {
				fmt.Fprintf(stderr, "passage render: --%s checks a manifest; give the MANIFEST\n", name)
				return 2
			}
		}
		// The verdicts admit units here; the decision's own guest plan (its --unit) is
		// not what is rendered.
		f.units = unitList{all: true}
		d, err := f.decide(fs)
		if err == nil && d.LabelErr != nil {
			// A guest must not be rendered from a labelling the rules disagree on.
			err = d.LabelErr
		}
		if err != nil {
			return exitFor(stderr, err)
		}
		fmt.Fprintln(stderr, "passage render: planning output, decided on a tree: no manifest was verified; a hypervisor renders from a MANIFEST")
		in.Sources = topology.SourcesOf(d.Units())
		if f.src.snapshot == "" && f.src.dump == "" {
			// The node's CPUs per NUMA node, as the boot records them in the manifest.
			if in.HostCPUs, err = pci.NodeCPUs(f.src.root); err != nil {
				return exitFor(stderr, errUsage{err})
			}
		}
	}
	if dom.Name == "" {
		dom.Name = "passage"
		for _, id := range unitsOrAll(in) {
			dom.Name += "-" + id.String()
		}
	}
	r, err := hypervisor.Render(in, *format, dom)
	if err != nil {
		var refused *hypervisor.Refused
		if errors.As(err, &refused) {
			from := "tree"
			if manifestFile != "" {
				from = manifestFile
			}
			fmt.Fprintf(stderr, "passage render: %s: REFUSED: %v\n", from, refused.Err)
			return 1
		}
		fmt.Fprintf(stderr, "passage render: %v\n", err)
		return 2
	}
	if note := r.DegradedNote(); note != "" {
		fmt.Fprintf(stderr, "passage render: --allow-degraded: %s\n", note)
	}
	if *format == hypervisor.FormatQEMU || *format == hypervisor.FormatLibvirt {
		fmt.Fprintf(stderr, "passage render: the guest's 64-bit BARs need %s of MMIO: a %d-bit physical address width (rendered: %d)\n",
			topology.Bytes(r.MMIO.Prefetchable64), r.MMIO.Width, r.PhysBits)
		if len(r.MMIO.Unknown) > 0 {
			fmt.Fprintf(stderr, "passage render: BAR sizes unknown for %s: the width is a lower bound\n", strings.Join(r.MMIO.Unknown, ", "))
		}
	}
	if in.Units == nil {
		if left := hypervisor.LeftOut(in, r.Guest); left != "" {
			fmt.Fprintf(stderr, "passage render: --unit all leaves out %s\n", left)
		}
	}
	if _, err := stdout.Write(r.Out); err != nil {
		fmt.Fprintf(stderr, "passage render: %v\n", err)
		return 1
	}
	return 0
}

// unitsOrAll are the units asked for, or with --unit all those the verdicts admit.
func unitsOrAll(in hypervisor.Input) []topology.UnitID {
	if in.Units != nil {
		return in.Units
	}
	ids, _, _ := topology.Admit(in.Sources, nil, in.AllowDegraded)
	return ids
}
