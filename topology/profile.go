package topology

import (
	"bytes"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/passage-boot/passage/pci"
)

// Profile is a platform's role rules and the facts PCIe cannot show (NVLink), loaded from
// YAML or JSON. Operators write their own for server models the embedded ones do not
// know, and test them offline against a snapshot.
type Profile struct {
	Name        string `yaml:"name" json:"name"`
	Description string `yaml:"description,omitempty" json:"description,omitempty"`
	// UnlabeledIsError makes a function that no rule matches an error, for platforms
	// whose every function is known.
	UnlabeledIsError bool `yaml:"unlabeled_is_error,omitempty" json:"unlabeled_is_error,omitempty"`
	// NVLinks is the number of NVLinks between two GPUs (18 on HGX B200/B300); 0 means
	// GPUs talk over PCIe and the matrix shows the PCIe distance.
	NVLinks int `yaml:"nvlinks,omitempty" json:"nvlinks,omitempty"`
	// Erase is the platform's default for passage.erase= (off, auto, require; "" is
	// off): whether a unit's NVMe is erased and its functions reset before passthrough.
	Erase string `yaml:"erase,omitempty" json:"erase,omitempty"`
	// Slots fixes unit IDs by address: the key is the address of the GPU or of any bridge
	// above it (usually the root port), the value the unit ID, reserved whether or not
	// the slot holds a readable GPU. GPUs it does not name are numbered by the position
	// of their root port (PROFILES.md, Unit IDs).
	Slots map[string]int `yaml:"slots,omitempty" json:"slots,omitempty"`
	// Modules gives GPUs their Module ID (1..N: the baseboard strapping nvidia-smi -q
	// shows as "Module Id", FM's physicalId), keyed as Slots is: the address of the GPU or
	// of any bridge above it. Fabric Manager names partition members by Module ID, which
	// follows neither PCI order nor unit IDs, and NVML cannot read it once a GPU is on
	// vfio-pci, so it is declared here and signed in the manifest. A GPU it does not name
	// has Module ID 0: unknown, never guessed (PROFILES.md, Module IDs).
	Modules map[string]int `yaml:"modules,omitempty" json:"modules,omitempty"`
	// NVLinkPartitions is the platform's NVLink partition layout: each set of Module IDs
	// that Fabric Manager can activate as one partition. It is the layout only: FM's
	// partition IDs are read from FM at run time.
	NVLinkPartitions [][]int `yaml:"nvlink_partitions,omitempty" json:"nvlink_partitions,omitempty"`
	Rules            []Rule  `yaml:"rules" json:"rules"`

	slots   map[pci.Address]int
	modules map[pci.Address]int
}

// Rule gives Role to every function that Match accepts.
type Rule struct {
	Name  string `yaml:"name" json:"name"`
	Role  Role   `yaml:"role" json:"role"`
	Match Match  `yaml:"match" json:"match"`
}

// Match is a predicate on one function. Every field set must hold. IDs are hex (YAML
// 0x10de or the string "10de"); a list means any of.
type Match struct {
	Vendor          IDs  `yaml:"vendor,omitempty" json:"vendor,omitempty"`
	Device          IDs  `yaml:"device,omitempty" json:"device,omitempty"`
	SubsystemVendor IDs  `yaml:"subsystem_vendor,omitempty" json:"subsystem_vendor,omitempty"`
	SubsystemDevice IDs  `yaml:"subsystem_device,omitempty" json:"subsystem_device,omitempty"`
	Class           *Hex `yaml:"class,omitempty" json:"class,omitempty"`
	// ClassMask selects the class bits compared (default 0xffffff: base, sub, prog-if).
	ClassMask *Hex `yaml:"class_mask,omitempty" json:"class_mask,omitempty"`
	// PortType is the Express port type: root, upstream, downstream, endpoint,
	// legacy-endpoint, pcie-to-pci, pci-to-pcie, rciep, rcec.
	PortType []string `yaml:"port_type,omitempty" json:"port_type,omitempty"`
	Bridge   *bool    `yaml:"bridge,omitempty" json:"bridge,omitempty"`
	// DeviceNumber and Function are the address's device (slot) and function numbers
	// (decimal): the same ID at two slots of one bus can play two roles.
	DeviceNumber []int `yaml:"device_number,omitempty" json:"device_number,omitempty"`
	Function     []int `yaml:"function,omitempty" json:"function,omitempty"`

	// Position. Below: every entry matches some bridge above the function. NotBelow: no
	// entry matches any bridge above it. Parent: matches the bridge directly above.
	// Sibling: matches another function on the same bus. Depth counts the bridges above.
	Below     []Match `yaml:"below,omitempty" json:"below,omitempty"`
	NotBelow  []Match `yaml:"not_below,omitempty" json:"not_below,omitempty"`
	Parent    *Match  `yaml:"parent,omitempty" json:"parent,omitempty"`
	Sibling   *Match  `yaml:"sibling,omitempty" json:"sibling,omitempty"`
	NoSibling *Match  `yaml:"no_sibling,omitempty" json:"no_sibling,omitempty"`
	DepthMin  *int    `yaml:"depth_min,omitempty" json:"depth_min,omitempty"`
	DepthMax  *int    `yaml:"depth_max,omitempty" json:"depth_max,omitempty"`
	// Not must not match the function itself.
	Not *Match `yaml:"not,omitempty" json:"not,omitempty"`
	// VPD is a condition on the function's Vital Product Data (sysfs vpd, read where
	// config space advertises it): a function whose VPD could not be read fails it.
	VPD *VPDMatch `yaml:"vpd,omitempty" json:"vpd,omitempty"`
}

// VPDMatch holds when the function's VPD-R keyword Keyword (two characters, as lspci -vvv
// shows it in brackets: PN, SN, V0..VZ) has the value Equals, or has Field as one of its
// colon-separated fields. Field is for the vendor keywords that pack several key=value
// fields into one, as ConnectX's VA does ("MLX:MN=MLNX:CSKU=V2:...:SMDL=SW_MNG"): a field
// must equal it whole, so "SMDL=SW_MNG" matches neither "SMDL=SW_MNG_X" nor the same
// bytes in a serial number.
type VPDMatch struct {
	Keyword string `yaml:"keyword" json:"keyword"`
	Equals  string `yaml:"equals,omitempty" json:"equals,omitempty"`
	Field   string `yaml:"field,omitempty" json:"field,omitempty"`
}

func (v *VPDMatch) check() error {
	if len(v.Keyword) != 2 || !isVPDKeyChar(v.Keyword[0]) || !isVPDKeyChar(v.Keyword[1]) {
		return fmt.Errorf("vpd: keyword %q: want two letters or digits (PN, SN, VA)", v.Keyword)
	}
	if (v.Equals == "") == (v.Field == "") {
		return fmt.Errorf("vpd %s: give exactly one of equals and field", v.Keyword)
	}
	if strings.Contains(v.Field, ":") {
		return fmt.Errorf("vpd %s: field %q holds a colon; a field is what lies between two", v.Keyword, v.Field)
	}
	return nil
}

func isVPDKeyChar(c byte) bool { return c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }

func (v *VPDMatch) matches(vpd *pci.VPD) bool {
	if vpd == nil {
		return false
	}
	val, ok := vpd.Keywords[v.Keyword]
	if !ok {
		return false
	}
	if v.Equals != "" {
		return val == v.Equals
	}
	for _, f := range strings.Split(val, ":") {
		if f == v.Field {
			return true
		}
	}
	return false
}

// Hex is a number written in hex: 0x10de in YAML, or "10de" / "0x10de" as a string
// (JSON has no hex literals).
type Hex uint32

func (h *Hex) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return fmt.Errorf("line %d: want a hex number, got a %s", n.Line, kindName(n.Kind))
	}
	s := strings.TrimPrefix(strings.ToLower(strings.TrimSpace(n.Value)), "0x")
	if n.Tag == "!!int" && !strings.HasPrefix(strings.ToLower(n.Value), "0x") {
		// A bare decimal-looking YAML int (class 030200, device 2901) is still meant as
		// hex: every PCI ID is written in hex, as lspci -n prints it.
		s = n.Value
	}
	v, err := strconv.ParseUint(s, 16, 32)
	if err != nil {
		return fmt.Errorf("line %d: %q is not a hex number", n.Line, n.Value)
	}
	*h = Hex(v)
	return nil
}

// UnmarshalJSON reads what MarshalJSON writes: the number as a hex string ("0x10de").
func (h *Hex) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("want a hex number as a string, got %s", b)
	}
	v, err := strconv.ParseUint(strings.TrimPrefix(strings.ToLower(s), "0x"), 16, 32)
	if err != nil {
		return fmt.Errorf("%q is not a hex number", s)
	}
	*h = Hex(v)
	return nil
}

// IDs is one hex ID or a list of them.
type IDs []uint16

// UnmarshalJSON reads what MarshalJSON writes: a list of hex strings.
func (ids *IDs) UnmarshalJSON(b []byte) error {
	var hs []Hex
	if err := json.Unmarshal(b, &hs); err != nil {
		return err
	}
	for _, h := range hs {
		if h > 0xffff {
			return fmt.Errorf("ID %#x is wider than 16 bits", uint32(h))
		}
		*ids = append(*ids, uint16(h))
	}
	return nil
}

func (ids *IDs) UnmarshalYAML(n *yaml.Node) error {
	var nodes []*yaml.Node
	switch n.Kind {
	case yaml.ScalarNode:
		nodes = []*yaml.Node{n}
	case yaml.SequenceNode:
		nodes = n.Content
	default:
		return fmt.Errorf("line %d: want an ID or a list of IDs", n.Line)
	}
	for _, e := range nodes {
		var h Hex
		if err := h.UnmarshalYAML(e); err != nil {
			return err
		}
		if h > 0xffff {
			return fmt.Errorf("line %d: ID %#x is wider than 16 bits", e.Line, uint32(h))
		}
		*ids = append(*ids, uint16(h))
	}
	return nil
}

func kindName(k yaml.Kind) string {
	switch k {
	case yaml.SequenceNode:
		return "list"
	case yaml.MappingNode:
		return "mapping"
	}
	return "node"
}

var portTypes = map[string]pci.PortType{
	"endpoint":        pci.PortEndpoint,
	"legacy-endpoint": pci.PortLegacyEndpoint,
	"root":            pci.PortRootPort,
	"upstream":        pci.PortUpstream,
	"downstream":      pci.PortDownstream,
	"pcie-to-pci":     pci.PortPCIeToPCI,
	"pci-to-pcie":     pci.PortPCIToPCIe,
	"rciep":           pci.PortRCiEP,
	"rcec":            pci.PortRCEC,
}

var knownRoles = map[Role]bool{
	RoleGPU: true, RoleGPUNIC: true, RoleDataDirect: true, RoleGPUNVMe: true, RoleMgmtNIC: true,
	RoleNVSwitchMgmt: true, RoleSwitchPort: true, RolePlaceholder: true, RoleHostOther: true,
}

// The built-in profiles are written in YAML (profiles/*.yaml, with their comments) and
// embedded as the JSON of what they parse to (profiles/*.json, written by
// `go test ./topology -run TestBuiltinJSON -update`; the test fails while one is stale):
// decoding the JSON costs a few per cent of decoding the YAML, which was about 2 ms of
// every plan, apply and boot.
//
//go:embed profiles/*.yaml profiles/*.json
var builtin embed.FS

// Builtins lists the embedded profiles' names.
func Builtins() []string {
	ents, _ := builtin.ReadDir("profiles")
	var out []string
	for _, e := range ents {
		if name, ok := strings.CutSuffix(e.Name(), ".yaml"); ok {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

// Builtin returns an embedded profile by name (b300, b200, qemu).
func Builtin(name string) (*Profile, error) {
	b, err := builtin.ReadFile(path.Join("profiles", name+".json"))
	if err != nil {
		return nil, fmt.Errorf("profile %q: no such built-in profile (have %s)", name, strings.Join(Builtins(), ", "))
	}
	return parseBuiltinJSON(name+".yaml", b)
}

// parseBuiltinJSON reads a built-in profile's embedded JSON, as strictly as ParseProfile
// reads the YAML it was made from.
func parseBuiltinJSON(source string, b []byte) (*Profile, error) {
	var p Profile
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return nil, fmt.Errorf("profile %s (embedded JSON): %w", source, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("profile %s (embedded JSON): more than one document", source)
	}
	if err := p.check(); err != nil {
		return nil, fmt.Errorf("profile %s: %w", source, err)
	}
	return &p, nil
}

// MaxProfileSize bounds a profile: a real one is a few KB. LoadProfile refuses a larger
// file before reading it, ParseProfile larger input (decoding YAML costs several times
// its size in memory).
const MaxProfileSize = 1 << 20

var errProfileSize = fmt.Errorf("larger than 1 MiB (%d bytes), the most a profile may hold; a real one is a few KB", MaxProfileSize)

// ProfileIsFile tells whether LoadProfile takes nameOrFile as a file's path (it has a
// slash or a .yaml/.yml/.json suffix) rather than a built-in profile's name.
func ProfileIsFile(nameOrFile string) bool {
	return strings.ContainsRune(nameOrFile, '/') || strings.HasSuffix(nameOrFile, ".yaml") ||
		strings.HasSuffix(nameOrFile, ".yml") || strings.HasSuffix(nameOrFile, ".json")
}

// LoadProfile takes a built-in name or a file path (anything with a slash or a
// .yaml/.yml/.json suffix is a path). A file larger than MaxProfileSize is refused from
// its size, and whatever stat cannot size (a pipe, a device) is read only up to it.
func LoadProfile(nameOrFile string) (*Profile, error) {
	if !ProfileIsFile(nameOrFile) {
		return Builtin(nameOrFile)
	}
	b, err := readProfile(nameOrFile)
	if err != nil {
		return nil, fmt.Errorf("profile %s: %w", nameOrFile, err)
	}
	return ParseProfile(nameOrFile, b)
}

func readProfile(name string) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() > MaxProfileSize {
		return nil, fmt.Errorf("%d bytes: %w", st.Size(), errProfileSize)
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxProfileSize+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxProfileSize {
		return nil, errProfileSize
	}
	return b, nil
}

// ParseProfile decodes YAML or JSON (JSON is read as the YAML it is a subset of) and
// checks it: input beyond MaxProfileSize, a second YAML document, unknown fields,
// unknown roles and port types, duplicate rule names, bad slot addresses, rules that
// name neither a vendor nor a class (nor bridge: true), and bad module IDs or partition
// sets are errors naming the source.
func ParseProfile(source string, b []byte) (*Profile, error) {
	if len(b) > MaxProfileSize {
		return nil, fmt.Errorf("profile %s: %d bytes: %w", source, len(b), errProfileSize)
	}
	var p Profile
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&p); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("profile %s: empty", source)
		}
		return nil, fmt.Errorf("profile %s: %w", source, err)
	}
	// A second document would be ignored, and whoever wrote it meant something by it.
	var more yaml.Node
	if err := dec.Decode(&more); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("profile %s: more than one YAML document", source)
	}
	if err := p.check(); err != nil {
		return nil, fmt.Errorf("profile %s: %w", source, err)
	}
	return &p, nil
}

func (p *Profile) check() error {
	if p.Name == "" {
		return fmt.Errorf("no name")
	}
	if len(p.Rules) == 0 {
		return fmt.Errorf("no rules")
	}
	switch p.Erase {
	case "", "off", "auto", "require":
	default:
		return fmt.Errorf("erase %q: want off, auto or require", p.Erase)
	}
	seen := map[string]bool{}
	for i, r := range p.Rules {
		if r.Name == "" {
			return fmt.Errorf("rule %d: no name", i+1)
		}
		if seen[r.Name] {
			return fmt.Errorf("rule %q: name used twice", r.Name)
		}
		seen[r.Name] = true
		if !knownRoles[r.Role] {
			return fmt.Errorf("rule %q: unknown role %q", r.Name, r.Role)
		}
		if err := r.Match.check(); err != nil {
			return fmt.Errorf("rule %q: %w", r.Name, err)
		}
	}
	p.slots = map[pci.Address]int{}
	used := map[int]string{}
	for s, id := range p.Slots {
		a, err := pci.ParseAddress(s)
		if err != nil {
			return fmt.Errorf("slots: %w", err)
		}
		if id < 0 {
			return fmt.Errorf("slots: %s: negative unit %d", s, id)
		}
		if o, dup := used[id]; dup {
			return fmt.Errorf("slots: unit %d given to both %s and %s", id, o, s)
		}
		used[id] = s
		p.slots[a] = id
	}
	if err := p.checkModules(); err != nil {
		return err
	}
	// Checked last, so that the errors above come first. A rule that names neither a
	// vendor nor a class matches whatever its other conditions allow (with none, every
	// function: root ports, switch ports, the management NIC). "bridge: true" names what
	// it matches too (a type 1 header), and no passthrough role on a bridge survives
	// labelling.
	for _, r := range p.Rules {
		m := r.Match
		if m.Class != nil && m.ClassMask != nil && uint32(*m.ClassMask)&0xff0000 != 0xff0000 {
			// A class compared without its base class byte names no class at all
			// (class_mask 0 matches every function).
			return fmt.Errorf("rule %q: class_mask %#06x does not compare the base class (0xff0000); a rule must say what it matches", r.Name, uint32(*m.ClassMask))
		}
		if len(m.Vendor) == 0 && m.Class == nil && (m.Bridge == nil || !*m.Bridge) {
			return fmt.Errorf("rule %q: names neither a vendor nor a class (nor bridge: true); a rule must say what it matches", r.Name)
		}
	}
	return nil
}

// checkModules checks modules and nvlink_partitions: Module IDs from 1, each given to one
// address; partitions that are non-empty sets of Module IDs no larger than the largest
// declared (when any is), each listed once.
func (p *Profile) checkModules() error {
	p.modules = map[pci.Address]int{}
	keys := make([]string, 0, len(p.Modules))
	for s := range p.Modules {
		keys = append(keys, s)
	}
	sort.Strings(keys) // so that which of two keys an error names does not vary
	used := map[int]string{}
	given := map[pci.Address]string{}
	top := 0
	for _, s := range keys {
		id := p.Modules[s]
		a, err := pci.ParseAddress(s)
		if err != nil {
			return fmt.Errorf("modules: %w", err)
		}
		if id < 1 {
			return fmt.Errorf("modules: %s: Module ID %d: Module IDs start at 1", s, id)
		}
		if o, dup := used[id]; dup {
			return fmt.Errorf("modules: Module ID %d given to both %s and %s", id, o, s)
		}
		if o, dup := given[a]; dup {
			return fmt.Errorf("modules: %s and %s are one address", o, s)
		}
		used[id], given[a] = s, s
		p.modules[a] = id
		top = max(top, id)
	}
	seen := map[string]int{}
	for i, set := range p.NVLinkPartitions {
		if len(set) == 0 {
			return fmt.Errorf("nvlink_partitions[%d]: empty", i)
		}
		sorted := append([]int(nil), set...)
		sort.Ints(sorted)
		for k, id := range sorted {
			switch {
			case id < 1:
				return fmt.Errorf("nvlink_partitions[%d]: Module ID %d: Module IDs start at 1", i, id)
			case top > 0 && id > top:
				return fmt.Errorf("nvlink_partitions[%d]: Module ID %d: modules declares none above %d", i, id, top)
			case k > 0 && id == sorted[k-1]:
				return fmt.Errorf("nvlink_partitions[%d]: Module ID %d given twice", i, id)
			}
		}
		key := fmt.Sprint(sorted)
		if j, dup := seen[key]; dup {
			return fmt.Errorf("nvlink_partitions[%d]: the same set as nvlink_partitions[%d]", i, j)
		}
		seen[key] = i
	}
	return nil
}

func (m *Match) check() error {
	for _, t := range m.PortType {
		if _, ok := portTypes[t]; !ok {
			return fmt.Errorf("unknown port_type %q", t)
		}
	}
	if m.ClassMask != nil && m.Class == nil {
		return fmt.Errorf("class_mask without class")
	}
	if m.VPD != nil {
		if err := m.VPD.check(); err != nil {
			return err
		}
	}
	for _, sub := range m.subs() {
		if err := sub.check(); err != nil {
			return err
		}
	}
	return nil
}

// UsesVPD says whether a rule's match, or a match nested in one, has a vpd condition:
// then a function's role may depend on VPD, and one whose VPD could not be read may not
// have the role it would have had.
func (p *Profile) UsesVPD() bool {
	var uses func(m *Match) bool
	uses = func(m *Match) bool {
		if m.VPD != nil {
			return true
		}
		for _, sub := range m.subs() {
			if uses(sub) {
				return true
			}
		}
		return false
	}
	for i := range p.Rules {
		if uses(&p.Rules[i].Match) {
			return true
		}
	}
	return false
}

func (m *Match) subs() []*Match {
	var out []*Match
	for i := range m.Below {
		out = append(out, &m.Below[i])
	}
	for i := range m.NotBelow {
		out = append(out, &m.NotBelow[i])
	}
	for _, s := range []*Match{m.Parent, m.Sibling, m.NoSibling, m.Not} {
		if s != nil {
			out = append(out, s)
		}
	}
	return out
}

func anyInt(set []int, v int) bool {
	if len(set) == 0 {
		return true
	}
	for _, x := range set {
		if x == v {
			return true
		}
	}
	return false
}

func anyID(ids IDs, v uint16) bool {
	if len(ids) == 0 {
		return true
	}
	for _, id := range ids {
		if id == v {
			return true
		}
	}
	return false
}

// Matches says whether d satisfies every condition of m.
func (m *Match) Matches(d *pci.Device) bool {
	if !anyID(m.Vendor, d.VendorID) || !anyID(m.Device, d.DeviceID) ||
		!anyID(m.SubsystemVendor, d.SubsystemVendor) || !anyID(m.SubsystemDevice, d.SubsystemDevice) {
		return false
	}
	if m.Class != nil {
		mask := uint32(0xffffff)
		if m.ClassMask != nil {
			mask = uint32(*m.ClassMask)
		}
		if d.Class&mask != uint32(*m.Class)&mask {
			return false
		}
	}
	if len(m.PortType) > 0 {
		t, ok := d.PortType()
		hit := false
		for _, name := range m.PortType {
			if ok && portTypes[name] == t {
				hit = true
			}
		}
		if !hit {
			return false
		}
	}
	if m.Bridge != nil && d.IsBridge() != *m.Bridge {
		return false
	}
	if !anyInt(m.DeviceNumber, int(d.Addr.Device)) || !anyInt(m.Function, int(d.Addr.Function)) {
		return false
	}
	anc := d.Ancestors()
	if m.DepthMin != nil && len(anc) < *m.DepthMin {
		return false
	}
	if m.DepthMax != nil && len(anc) > *m.DepthMax {
		return false
	}
	if m.Parent != nil && (d.Parent == nil || !m.Parent.Matches(d.Parent)) {
		return false
	}
	for i := range m.Below {
		if !anyMatches(&m.Below[i], anc) {
			return false
		}
	}
	for i := range m.NotBelow {
		if anyMatches(&m.NotBelow[i], anc) {
			return false
		}
	}
	if m.Sibling != nil && !anyMatches(m.Sibling, siblings(d)) {
		return false
	}
	if m.NoSibling != nil && anyMatches(m.NoSibling, siblings(d)) {
		return false
	}
	if m.Not != nil && m.Not.Matches(d) {
		return false
	}
	if m.VPD != nil && !m.VPD.matches(d.VPD) {
		return false
	}
	return true
}

func anyMatches(m *Match, ds []*pci.Device) bool {
	for _, d := range ds {
		if m.Matches(d) {
			return true
		}
	}
	return false
}

// siblings are the other functions on d's bus below the same bridge. Functions on a
// root bus have none here: pci.Device does not link root-bus neighbours.
func siblings(d *pci.Device) []*pci.Device {
	var out []*pci.Device
	if d.Parent != nil {
		for _, s := range d.Parent.Children {
			if s != d {
				out = append(out, s)
			}
		}
	}
	return out
}

// MarshalJSON writes the number as ParseProfile reads it back: "0x10de". (JSON has no
// hex literals, and a bare number would be read back as hex digits.)
func (h Hex) MarshalJSON() ([]byte, error) { return []byte(fmt.Sprintf(`"0x%x"`, uint32(h))), nil }

// MarshalJSON writes the IDs as ParseProfile reads them back: ["0x10de"].
func (ids IDs) MarshalJSON() ([]byte, error) {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = fmt.Sprintf(`"0x%04x"`, id)
	}
	return []byte("[" + strings.Join(parts, ",") + "]"), nil
}
