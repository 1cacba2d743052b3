package topology

import (
	"bufio"
	"bytes"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/pci"
)

// NVSMIGPU is one GPU of `nvidia-smi -q`: the NVIDIA driver's own reading of where it
// is and which baseboard module it sits in, the one source that knows the Module ID
// (FM's physicalId) while the GPU is bound to nvidia; on vfio-pci NVML reads none
// (NVLINK.md §4).
type NVSMIGPU struct {
	Addr pci.Address // "GPU 00000000:1B:00.0", the section's title; its PCI "Bus Id" agrees
	// Module is "Module Id" (Platform Info; "Module ID" in some drivers' output); 0
	// when the driver says N/A or gives none.
	Module int
	Line   int // the section title's line, for messages
}

// MaxNVSMI bounds the nvidia-smi -q text read: eight B300s' full output is some 100 KiB.
const MaxNVSMI = 8 << 20

// ParseNVSMI reads the GPUs of `nvidia-smi -q` text (the driver's human-readable
// report; the XML of -x is not read). Each GPU is a section titled "GPU
// <domain:bus:dev.fn>" at the left margin; within it "Bus Id" (under PCI) and "Module
// Id" are read, keyed by their names whatever their indentation. A section whose Bus Id
// differs from its title, a value that is not one, a Module Id given twice, or fewer or
// more sections than "Attached GPUs" counts (a truncated capture) is refused naming
// the line. No GPU is an error: the text is not nvidia-smi -q's.
func ParseNVSMI(b []byte) ([]NVSMIGPU, error) {
	if len(b) > MaxNVSMI {
		return nil, fmt.Errorf("nvidia-smi -q: %d bytes, more than %d", len(b), MaxNVSMI)
	}
	var gpus []NVSMIGPU
	attached, attachedLine := -1, 0
	moduleLine := 0
	s := bufio.NewScanner(bytes.NewReader(b))
	s.Buffer(make([]byte, 0, 4096), MaxNVSMI)
	for n := 1; s.Scan(); n++ {
		line := strings.TrimRight(s.Text(), " \t\r")
		if rest, ok := strings.CutPrefix(line, "GPU "); ok && !strings.Contains(rest, " ") {
			a, err := nvsmiBusID(rest)
			if err != nil {
				return nil, fmt.Errorf("nvidia-smi -q line %d: %w", n, err)
			}
			gpus = append(gpus, NVSMIGPU{Addr: a, Line: n})
			moduleLine = 0
			continue
		}
		key, value, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		switch {
		case strings.EqualFold(key, "Attached GPUs") && line[0] != ' ':
			v, err := strconv.Atoi(value)
			if err != nil || v < 0 {
				return nil, fmt.Errorf("nvidia-smi -q line %d: Attached GPUs %q: not a count", n, printable(value))
			}
			attached, attachedLine = v, n
		case len(gpus) == 0:
		case strings.EqualFold(key, "Bus Id"):
			a, err := nvsmiBusID(value)
			if err != nil {
				return nil, fmt.Errorf("nvidia-smi -q line %d: Bus Id: %w", n, err)
			}
			if g := gpus[len(gpus)-1]; a != g.Addr {
				return nil, fmt.Errorf("nvidia-smi -q line %d: Bus Id %s in the section of GPU %s (line %d)", n, a, g.Addr, g.Line)
			}
		case strings.EqualFold(key, "Module Id"):
			g := &gpus[len(gpus)-1]
			if moduleLine != 0 {
				return nil, fmt.Errorf("nvidia-smi -q line %d: GPU %s: a second Module Id (the first on line %d)", n, g.Addr, moduleLine)
			}
			moduleLine = n
			if value == "N/A" {
				continue
			}
			m, err := strconv.Atoi(value)
			if err != nil || m < 0 {
				return nil, fmt.Errorf("nvidia-smi -q line %d: GPU %s: Module Id %q: not a number", n, g.Addr, printable(value))
			}
			g.Module = m
		}
	}
	if err := s.Err(); err != nil {
		return nil, fmt.Errorf("nvidia-smi -q: %w", err)
	}
	if len(gpus) == 0 {
		return nil, fmt.Errorf("nvidia-smi -q: no GPU section (\"GPU 00000000:1B:00.0\"): not nvidia-smi -q's output")
	}
	if attached >= 0 && attached != len(gpus) {
		return nil, fmt.Errorf("nvidia-smi -q: line %d says %d GPUs attached, %d sections follow (a truncated capture?)", attachedLine, attached, len(gpus))
	}
	return gpus, nil
}

// nvsmiBusID reads the driver's bus ID, "00000000:1B:00.0" (a 32-bit domain): PCI
// domains above 0xffff are refused, as pci.Address keeps 16 bits.
func nvsmiBusID(s string) (pci.Address, error) {
	dom, rest, ok := strings.Cut(s, ":")
	if !ok || len(dom) == 0 || len(dom) > 8 {
		return pci.Address{}, fmt.Errorf("bus id %q: want DDDDDDDD:BB:DD.F", printable(s))
	}
	d, err := strconv.ParseUint(dom, 16, 32)
	if err != nil || d > 0xffff {
		return pci.Address{}, fmt.Errorf("bus id %q: domain not a 16-bit PCI domain", printable(s))
	}
	return pci.ParseAddress(fmt.Sprintf("%04x:%s", d, strings.ToLower(rest)))
}

// printable is s with what is not printable ASCII escaped, bounded, for messages about
// outside text.
func printable(s string) string {
	if len(s) > 64 {
		s = s[:64] + "..."
	}
	q := strconv.QuoteToASCII(s)
	return q[1 : len(q)-1]
}

// ModulesStanza is a SKU profile's modules: stanza (Profile.Modules) for the GPUs that
// have a Module ID, each keyed by its address, in address order; unknown names those
// that have none (the stanza gives them none: Module ID 0, never guessed). A Module ID
// two GPUs share, or an address two sections give, is refused: the map would send one
// GPU's partition to another.
func ModulesStanza(gpus []NVSMIGPU, source string) (stanza []byte, unknown []pci.Address, err error) {
	byAddr := map[pci.Address]NVSMIGPU{}
	byModule := map[int]NVSMIGPU{}
	for _, g := range gpus {
		if o, dup := byAddr[g.Addr]; dup {
			return nil, nil, fmt.Errorf("GPU %s: two sections (lines %d and %d)", g.Addr, o.Line, g.Line)
		}
		byAddr[g.Addr] = g
		if g.Module == 0 {
			unknown = append(unknown, g.Addr)
			continue
		}
		if o, dup := byModule[g.Module]; dup {
			return nil, nil, fmt.Errorf("modules: Module ID %d: GPUs %s (line %d) and %s (line %d)", g.Module, o.Addr, o.Line, g.Addr, g.Line)
		}
		byModule[g.Module] = g
	}
	known := make([]NVSMIGPU, 0, len(byModule))
	for _, g := range byModule {
		known = append(known, g)
	}
	slices.SortFunc(known, func(a, b NVSMIGPU) int {
		switch {
		case a.Addr.Less(b.Addr):
			return -1
		case b.Addr.Less(a.Addr):
			return 1
		}
		return 0
	})
	slices.SortFunc(unknown, func(a, b pci.Address) int {
		switch {
		case a.Less(b):
			return -1
		case b.Less(a):
			return 1
		}
		return 0
	})
	var out bytes.Buffer
	fmt.Fprintf(&out, "# GPU Module IDs (Fabric Manager's physicalId) as the NVIDIA driver reported them:\n# %s\n", printable(source))
	for _, a := range unknown {
		fmt.Fprintf(&out, "# GPU %s: no Module ID reported (left out: Module ID 0, unknown)\n", a)
	}
	if len(known) == 0 {
		out.WriteString("modules: {}\n")
		return out.Bytes(), unknown, nil
	}
	out.WriteString("modules:\n")
	for _, g := range known {
		fmt.Fprintf(&out, "  %q: %d\n", g.Addr.String(), g.Module)
	}
	return out.Bytes(), unknown, nil
}
