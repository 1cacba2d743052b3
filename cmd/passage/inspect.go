package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pciids"
	"github.com/passage-boot/passage/topology"
)

func cmdInspect(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("inspect", stderr)
	var src treeSource
	src.register(fs)
	var names namesFlag
	names.register(fs)
	asJSON := fs.Bool("json", false, `print {"devices":[...],"units":[...]} as JSON instead of the tree`)
	profile := fs.String("profile", "b300", "built-in profile ("+strings.Join(topology.Builtins(), ", ")+") or a YAML/JSON file, for roles and units in --json")
	if code, ok := parseNoArgs(fs, args, stdout); !ok {
		return code
	}
	tree, err := src.load(fs)
	if err != nil {
		fmt.Fprintf(stderr, "passage inspect: %v\n", err)
		return 2
	}
	db, err := names.open(tree)
	if err != nil {
		fmt.Fprintf(stderr, "passage inspect: %v\n", err)
		return 2
	}
	where := "marked ! above"
	if *asJSON {
		prof, err := topology.LoadProfile(*profile)
		if err != nil {
			fmt.Fprintf(stderr, "passage inspect: %v\n", err)
			return 2
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(inspectJSON(tree, prof, db)); err != nil {
			fmt.Fprintf(stderr, "passage inspect: %v\n", err)
			return 2
		}
		where = `in "problems"`
	} else {
		writeTree(stdout, tree, db)
	}
	return treeStatus(tree, stderr, where)
}

// treeStatus is inspect's exit status for a tree it has shown: 1, with a line on stderr,
// when reading it left problems (a function's config space truncated, not answering or
// malformed; a damaged dump; a function that vanished), so that a script never takes a
// partial or garbled tree for a clean one; 0 otherwise.
func treeStatus(t *pci.Tree, stderr io.Writer, where string) int {
	n := len(t.Problems)
	for _, d := range t.Devices {
		n += len(d.Problems)
	}
	if n == 0 {
		return 0
	}
	s := "s"
	if n == 1 {
		s = ""
	}
	fmt.Fprintf(stderr, "passage inspect: %d problem%s reading the PCI tree (%s)\n", n, s, where)
	return 1
}

// treeSource is where a command reads the PCI tree from: a sysfs root, a snapshot, or
// an lspci dump.
type treeSource struct{ root, snapshot, dump string }

func (s *treeSource) register(fs *flag.FlagSet) {
	fs.StringVar(&s.root, "root", "/", "scan the sysfs tree under `DIR`")
	fs.StringVar(&s.snapshot, "snapshot", "", "read a passage snapshot `FILE` (tar.gz) instead of sysfs")
	fs.StringVar(&s.dump, "lspci-dump", "", "read an lspci -xxxx (or -vvvxxxx) dump `FILE` instead of sysfs")
}

func (s *treeSource) load(fs *flag.FlagSet) (*pci.Tree, error) {
	set := 0
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "root" || f.Name == "snapshot" || f.Name == "lspci-dump" {
			set++
		}
	})
	switch {
	case set > 1:
		return nil, fmt.Errorf("--root, --snapshot and --lspci-dump exclude each other")
	case s.snapshot != "":
		return pci.ReadSnapshot(s.snapshot)
	case s.dump != "":
		return pci.ReadDump(s.dump)
	}
	return pci.Scan(s.root)
}

// writeTree draws the tree the way lspci -tvnn does (one root bus per "-[DDDD:BB]-"
// line, "+-"/"\-" branches, a bridge's bus range in brackets), one function per line
// so the link, ACS and ATS fit beside it.
func writeTree(w io.Writer, t *pci.Tree, db *pciids.DB) {
	type busKey struct {
		domain uint16
		bus    uint8
	}
	var buses []busKey
	byBus := map[busKey][]*pci.Device{}
	for _, d := range t.Roots {
		k := busKey{d.Addr.Domain, d.Addr.Bus}
		if _, ok := byBus[k]; !ok {
			buses = append(buses, k)
		}
		byBus[k] = append(byBus[k], d)
	}
	for _, k := range buses {
		fmt.Fprintf(w, "-[%04x:%02x]-\n", k.domain, k.bus)
		writeLevel(w, byBus[k], " ", db)
	}
	for _, p := range t.Problems {
		fmt.Fprintf(w, "! %s\n", p)
	}
}

func writeLevel(w io.Writer, devs []*pci.Device, indent string, db *pciids.DB) {
	for i, d := range devs {
		branch, next := "+-", "| "
		if i == len(devs)-1 {
			branch, next = `\-`, "  "
		}
		fmt.Fprintf(w, "%s%s%s\n", indent, branch, describe(d, db))
		for _, p := range d.Problems {
			fmt.Fprintf(w, "%s%s  ! %s\n", indent, next, p)
		}
		writeLevel(w, d.Children, indent+next, db)
	}
}

// describe is one function's line: address, bus range, class, names and IDs as lspci
// -nn prints them, then the Express port type and link, ACS, ATS and what sysfs adds.
func describe(d *pci.Device, db *pciids.DB) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s", d.Addr)
	if d.IsBridge() {
		if d.SecondaryBus == d.SubordinateBus {
			fmt.Fprintf(&b, "-[%02x]", d.SecondaryBus)
		} else {
			fmt.Fprintf(&b, "-[%02x-%02x]", d.SecondaryBus, d.SubordinateBus)
		}
	}
	fmt.Fprintf(&b, "  [%04x]: %s", d.Class>>8, db.Label(d.VendorID, d.DeviceID))
	if d.SubsystemVendor != 0 || d.SubsystemDevice != 0 {
		fmt.Fprintf(&b, " (sub %04x:%04x)", d.SubsystemVendor, d.SubsystemDevice)
	}
	if !d.ExpressKnown() {
		// The capability list could not be read: no Express capability found is not
		// conventional PCI (the problem lines below say why).
		b.WriteString("  Express unknown")
	}
	if e := d.Express; e != nil {
		fmt.Fprintf(&b, "  %s", e.Type)
		if e.HasLink {
			fmt.Fprintf(&b, "  LnkSta %s x%d", e.Speed, e.Width)
			if e.Speed != e.MaxSpeed || e.Width != e.MaxWidth {
				fmt.Fprintf(&b, " (LnkCap %s x%d)", e.MaxSpeed, e.MaxWidth)
			}
		}
	}
	// Extended capabilities not read (ExtCapsUnknown) are unknown, not absent.
	extUnknown := d.ExtCapsUnknown != ""
	if a := d.ACS; a != nil {
		fmt.Fprintf(&b, "  ACSCtl %s (cap %s)", a.Ctl&0x7f, a.Cap)
	} else if extUnknown && d.IsBridge() {
		b.WriteString("  ACS unknown")
	}
	switch {
	case d.ATS != nil:
		en := "-"
		if d.ATS.Enable {
			en = "+"
		}
		fmt.Fprintf(&b, "  ATS Enable%s", en)
	case d.IsBridge():
	case extUnknown && (d.Express != nil || !d.ExpressKnown()):
		b.WriteString("  ATS unknown")
	case d.Express != nil:
		b.WriteString("  ATS none")
	}
	if d.NUMANode >= 0 {
		fmt.Fprintf(&b, "  numa %d", d.NUMANode)
	}
	if d.IOMMUGroup >= 0 {
		fmt.Fprintf(&b, "  group %d", d.IOMMUGroup)
	}
	if d.Driver != "" {
		fmt.Fprintf(&b, "  driver %s", d.Driver)
	}
	if d.DriverOverride != "" {
		fmt.Fprintf(&b, "  override %s", d.DriverOverride)
	}
	return b.String()
}

// labelledDevice is pci's JSON view of a function plus what topology says of it.
type labelledDevice struct {
	pci.DeviceJSON
	deviceNames
	Role string           `json:"role"`
	Unit *topology.UnitID `json:"unit"` // null for functions that belong to no unit
}

type inspectDoc struct {
	Devices  []labelledDevice    `json:"devices"`
	Units    []topology.UnitJSON `json:"units"`
	Problems []string            `json:"problems"`
}

// inspectJSON labels the tree with the profile. A labelling error (conflicting rules,
// unlabeled functions a profile forbids) is reported in problems, not fatal: inspect
// shows what is there.
func inspectJSON(tree *pci.Tree, prof *topology.Profile, db *pciids.DB) inspectDoc {
	d, err := decision.Decide(decision.Input{Tree: tree, Profile: prof})
	tj := tree.JSON()
	doc := inspectDoc{Units: []topology.UnitJSON{}, Problems: append([]string{}, tj.Problems...)}
	if d == nil {
		doc.Problems = append(doc.Problems, err.Error())
		for i := range tree.Devices {
			doc.Devices = append(doc.Devices, labelledDevice{DeviceJSON: tj.Devices[i], deviceNames: namesOf(db, tree.Devices[i]), Role: string(topology.RoleUnlabeled)})
		}
		return doc
	}
	labels, lerr := d.Labels, d.LabelErr
	doc.Units = d.UnitsJSON(d.Decided())
	doc.Problems = append(doc.Problems, labels.Problems...)
	if lerr != nil {
		doc.Problems = append(doc.Problems, lerr.Error())
	}
	for i, d := range tree.Devices {
		ld := labelledDevice{DeviceJSON: tj.Devices[i], deviceNames: namesOf(db, d), Role: string(labels.RoleOf(d.Addr))}
		if id, ok := labels.UnitOf(d.Addr); ok {
			ld.Unit = &id
		}
		doc.Devices = append(doc.Devices, ld)
	}
	return doc
}
