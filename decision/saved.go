package decision

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// SavedVersion is the version of the saved-plan format.
const SavedVersion = 4 // 2 added erase_policy, 3 for, 4 each port's mask and flags

// Saved is a decision written down by `passage plan --out F`, for `passage apply --plan
// F`: as with a saved Terraform plan, apply decides again on the node as it is now, with
// the saved profile and policy, and executes only when the new decision is the saved
// one, port for port and unit for unit; otherwise it refuses and names the difference.
type Saved struct {
	Version int `json:"version"`
	// Profile is the profile as the plan used it (ParseProfile reads it back).
	Profile   json.RawMessage           `json:"profile"`
	ATS       firmware.Policy           `json:"ats_policy"`
	Erase     erase.Policy              `json:"erase_policy"`
	For       Command                   `json:"for"` // the command the plan predicts
	Live      Live                      `json:"live"`
	Verdicts  []Verdict                 `json:"verdicts"`
	ACS       []SavedPort               `json:"acs"`
	KernelArg string                    `json:"kernel_arg"`
	Bind      []pci.Address             `json:"bind"`
	Groups    map[topology.UnitID][]int `json:"iommu_groups"` // unit -> its functions' groups, in function order
}

// SavedPort is one port of the ACS plan as saved.
type SavedPort struct {
	Addr    pci.Address     `json:"addr"`
	Unit    topology.UnitID `json:"unit"`
	Offset  int             `json:"offset"`
	Current pci.ACSBits     `json:"current"`
	Target  pci.ACSBits     `json:"target"`
	// Mask and Flags are the port's pci=config_acs= entry (topology.ACSPort's): ImageArgs
	// rebuilds the image's argument from them rather than trusting kernel_arg's text.
	Mask  pci.ACSBits `json:"mask"`
	Flags pci.ACSBits `json:"flags"`
	Skip  string      `json:"skip,omitempty"`
}

// Save writes the decision down.
func (d *Decision) Save() (*Saved, error) {
	prof, err := json.Marshal(d.Profile)
	if err != nil {
		return nil, fmt.Errorf("saved plan: profile: %w", err)
	}
	s := &Saved{Version: SavedVersion, Profile: prof, ATS: d.Input.ATS, Erase: d.Input.Erase, For: d.For, Live: d.Live, Verdicts: d.Decided(),
		KernelArg: d.KernelArg, ACS: []SavedPort{}, Bind: []pci.Address{}, Groups: map[topology.UnitID][]int{}}
	for _, p := range d.ACS {
		sp := SavedPort{Addr: p.Addr, Unit: p.Unit, Offset: p.Offset, Skip: p.Skip}
		if p.Offset != 0 {
			sp.Current, sp.Target, sp.Mask, sp.Flags = p.Current, p.Target(), p.Mask, p.Flags
		}
		s.ACS = append(s.ACS, sp)
	}
	for _, u := range d.Units() {
		var gs []int
		for _, f := range u.Functions() {
			gs = append(gs, f.IOMMUGroup)
			if u.Status != topology.StatusFailed {
				s.Bind = append(s.Bind, f.Addr)
			}
		}
		s.Groups[u.ID] = gs
	}
	return s, nil
}

// Write writes the saved plan as JSON.
func (s *Saved) Write(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(s)
}

// MaxSaved bounds a saved plan read from a file: a node's plan is tens of kilobytes.
const MaxSaved = 16 << 20

// ReadSaved reads a saved plan.
func ReadSaved(r io.Reader) (*Saved, error) {
	b, err := io.ReadAll(io.LimitReader(r, MaxSaved+1))
	if err != nil {
		return nil, fmt.Errorf("saved plan: %w", err)
	}
	if len(b) > MaxSaved {
		return nil, fmt.Errorf("saved plan: larger than %d bytes", MaxSaved)
	}
	var s Saved
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("saved plan: %w", err)
	}
	if s.Version != SavedVersion {
		return nil, fmt.Errorf("saved plan: version %d, this passage reads %d", s.Version, SavedVersion)
	}
	if len(s.Profile) == 0 {
		return nil, errors.New("saved plan: no profile")
	}
	// One entry a port: Decide plans each port once (a port on several units' paths is
	// one port with Shared units), and the kernel applies only the first pci=config_acs=
	// entry that matches a port (__pci_config_acs), so a second entry for it, rebuilt
	// into an image, would say one thing to the kernel and another to whoever reads the
	// plan.
	at := map[pci.Address]int{}
	for i, p := range s.ACS {
		if j, ok := at[p.Addr]; ok {
			return nil, fmt.Errorf("saved plan: acs %s listed twice (acs[%d] and acs[%d]): a plan holds one entry a port, and the kernel would apply only the first: refused, the plan was edited", p.Addr, j, i)
		}
		at[p.Addr] = i
	}
	return &s, nil
}

// LoadProfile is the saved profile.
func (s *Saved) LoadProfile() (*topology.Profile, error) {
	return topology.ParseProfile("saved plan", s.Profile)
}

// Diff names every way the decision d differs from the saved one: an empty result means
// d is the saved decision, and executing d executes exactly the saved plan.
func (s *Saved) Diff(d *Decision) []string {
	now, err := d.Save()
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	diff := func(what string, was, is any) {
		a, _ := json.Marshal(was)
		b, _ := json.Marshal(is)
		if string(a) != string(b) {
			out = append(out, fmt.Sprintf("%s: planned %s, now %s", what, a, b))
		}
	}
	diff("profile", s.Profile, now.Profile)
	diff("ats policy", s.ATS, now.ATS)
	diff("erase policy", s.Erase, now.Erase)
	diff("command", s.For, now.For)
	diff("lockdown", s.Live.Lockdown, now.Live.Lockdown)
	diff("kernel command line", s.Live.Cmdline, now.Live.Cmdline)
	verdicts := func(vs []Verdict) map[topology.UnitID]Verdict {
		m := map[topology.UnitID]Verdict{}
		for _, v := range vs {
			m[v.Unit] = v
		}
		return m
	}
	was, is := verdicts(s.Verdicts), verdicts(now.Verdicts)
	ids := []topology.UnitID{}
	for id := range was {
		ids = append(ids, id)
	}
	for id := range is {
		if _, ok := was[id]; !ok {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	for _, id := range ids {
		w, ok1 := was[id]
		n, ok2 := is[id]
		switch {
		case !ok1:
			out = append(out, fmt.Sprintf("%s: not in the plan, now %s", id, n.Status))
		case !ok2:
			out = append(out, fmt.Sprintf("%s: planned %s, now gone", id, w.Status))
		default:
			diff(id.String(), w, n)
			diff(fmt.Sprintf("%s iommu groups", id), s.Groups[id], now.Groups[id])
		}
	}
	ports := func(ps []SavedPort) map[pci.Address]SavedPort {
		m := map[pci.Address]SavedPort{}
		for _, p := range ps {
			m[p.Addr] = p
		}
		return m
	}
	wp, np := ports(s.ACS), ports(now.ACS)
	for _, p := range s.ACS {
		diff("acs "+p.Addr.String(), p, np[p.Addr])
	}
	for _, p := range now.ACS {
		if _, ok := wp[p.Addr]; !ok {
			diff("acs "+p.Addr.String(), nil, p)
		}
	}
	diff("kernel argument", s.KernelArg, now.KernelArg)
	diff("bind set", s.Bind, now.Bind)
	return out
}

// PlanDigest is how a boot image names the saved plan it carries: the sha256 of the
// file's bytes, as `sha256sum` prints it.
func PlanDigest(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// configACSBits are the flag positions a pci=config_acs= entry has (bit 6, DT, down to
// bit 0, SV): a mask or flag outside them would be dropped from the entry silently.
const configACSBits pci.ACSBits = 1<<7 - 1

// ImageArgs are the kernel arguments a signed boot image carries for the saved plan in
// b (`make uki PLAN=F`): the plan's pci=config_acs=, which Linux 6.11+ programs before
// passage runs, and PlanArg naming the plan, which the node records in its manifest.
//
// The argument is rebuilt from the plan's ports by topology.KernelArg, the function that
// made kernel_arg, so nothing but flags and addresses reaches the image: the operator's
// db key signs this line, and a plan edited to carry another separator (\r, \v, NUL,
// U+00A0 all split arguments in the kernel) or another pci= option would otherwise ride
// along. A plan whose kernel_arg is not the rebuilt argument was edited, or written by
// another passage: it is refused. A plan with nothing to set is refused too: the image
// would carry no ACS at all.
func ImageArgs(b []byte) (string, error) {
	s, err := ReadSaved(bytes.NewReader(b))
	if err != nil {
		return "", err
	}
	ports := make([]topology.ACSPort, 0, len(s.ACS))
	for _, p := range s.ACS {
		// Decide writes no port a failed unit alone holds (Skip), and leaves it out of
		// the argument: so does the rebuild.
		if p.Offset == 0 || p.Skip != "" {
			continue
		}
		if p.Mask&^configACSBits != 0 || p.Flags&^p.Mask != 0 {
			return "", fmt.Errorf("saved plan: acs %s: mask 0x%04x, flags 0x%04x: not a pci=config_acs= entry (flags within a mask of bits 0..6)", p.Addr, uint16(p.Mask), uint16(p.Flags))
		}
		ports = append(ports, topology.ACSPort{Addr: p.Addr, Offset: p.Offset, Mask: p.Mask, Flags: p.Flags})
	}
	arg := topology.KernelArg(ports)
	if arg == "" {
		return "", errors.New("saved plan: no pci=config_acs= (no unit's ports are to be set): nothing to bake into an image")
	}
	if s.KernelArg != arg {
		return "", fmt.Errorf("saved plan: kernel_arg %q is not the argument its acs ports make (%q): refused, the plan was edited", s.KernelArg, arg)
	}
	return arg + " " + PlanArg + "=" + PlanDigest(b), nil
}

// ImageCmdline is the whole command line a signed boot image carries for the saved plan
// in b: base, the image's other arguments (make uki's UKI_CMDLINE), then ImageArgs, last
// so that theirs are the values the kernel and the boot keep. It returns ImageArgs' part.
// A line longer than MaxCmdline is refused: past KernelKeeps the kernel would drop its
// tail, the plan's passage.plan= first and then pci=config_acs= entries, without a word,
// and the node would boot with less isolation than the image says it carries; at exactly
// KernelKeeps the boot cannot tell the line from a cut one and never matches it.
func ImageCmdline(b []byte, base string) (string, error) {
	args, err := ImageArgs(b)
	if err != nil {
		return "", err
	}
	line := args
	if base != "" {
		line = base + " " + args
	}
	if len(line) > MaxCmdline {
		parts := fmt.Sprintf("its other arguments %d, the plan's %d, a space between", len(base), len(args))
		if base == "" {
			parts = "the plan's arguments alone"
		}
		return "", fmt.Errorf("the image's command line would be %d bytes (%s): at most %d sign (the kernel keeps %d, x86 COMMAND_LINE_SIZE %d less its NUL, and a line that long cannot be told from a cut one, %s= lost first): refused",
			len(line), parts, MaxCmdline, KernelKeeps, CommandLineSize, PlanArg)
	}
	return args, nil
}
