package topology

import (
	"fmt"
	"strings"

	"github.com/passage-boot/passage/pci"
)

// Path types between two devices, as nvidia-smi topo -m and NCCL name them (NCCL's
// PATH_PIX ... PATH_SYS in src/graph/topo.h), best first.
const (
	PIX  = "PIX"  // through one PCIe switch
	PXB  = "PXB"  // through several switches, no host bridge
	PHB  = "PHB"  // through a host bridge
	NODE = "NODE" // between host bridges of one NUMA node
	SYS  = "SYS"  // between NUMA nodes
)

// place is where an endpoint sits for distance purposes, the way NCCL reduces a sysfs
// path: a switch is one node named by its upstream port (the downstream port below it
// is folded in), a root port is folded into its host bridge.
type place struct {
	host     string   // the host bridge (root bus), or a guest expander
	numa     int      // -1 when unknown
	switches []string // switch nodes above the endpoint, nearest first
}

func hostPlace(d *pci.Device) place {
	p := place{numa: d.NUMANode}
	top := d
	for _, a := range d.Ancestors() {
		top = a
		t, ok := a.PortType()
		if ok && t == pci.PortUpstream || !ok && a.Parent != nil {
			// A conventional bridge below the root is a hop of its own, as in NCCL's
			// level-by-level walk.
			p.switches = append(p.switches, a.Addr.String())
		}
	}
	p.host = fmt.Sprintf("%04x:%02x", top.Addr.Domain, top.Addr.Bus)
	return p
}

// distance is the path type between two endpoints.
func distance(a, b place) string {
	if a.host != b.host {
		if a.numa == b.numa || a.numa < 0 || b.numa < 0 {
			return NODE
		}
		return SYS
	}
	best := -1
	for i, s := range a.switches {
		for j, o := range b.switches {
			if s == o && (best < 0 || i+j < best) {
				best = i + j
			}
		}
	}
	switch {
	case best < 0:
		return PHB
	case best == 0:
		return PIX
	}
	return PXB
}

// Matrix is a distance matrix over GPUs and NICs, laid out like nvidia-smi topo -m.
type Matrix struct {
	Names []string      `json:"names"` // GPU0.., NIC0..
	Addrs []pci.Address `json:"addrs"`
	NUMA  []int         `json:"numa"`
	Cells [][]string    `json:"cells"` // Cells[i][j]; "X" on the diagonal
}

// At returns the entry between two addresses, or "" when either is not in the matrix.
func (m *Matrix) At(a, b pci.Address) string {
	i, j := m.index(a), m.index(b)
	if i < 0 || j < 0 {
		return ""
	}
	return m.Cells[i][j]
}

func (m *Matrix) index(a pci.Address) int {
	for i, x := range m.Addrs {
		if x == a {
			return i
		}
	}
	return -1
}

type matrixEntry struct {
	name string
	addr pci.Address
	gpu  bool
	at   place
}

func buildMatrix(es []matrixEntry, nvlinks int) *Matrix {
	m := &Matrix{}
	for _, e := range es {
		m.Names = append(m.Names, e.name)
		m.Addrs = append(m.Addrs, e.addr)
		m.NUMA = append(m.NUMA, e.at.numa)
	}
	for i, a := range es {
		row := make([]string, len(es))
		for j, b := range es {
			switch {
			case i == j:
				row[j] = "X"
			case a.gpu && b.gpu && nvlinks > 0:
				// NVLink does not show in PCIe: the profile says what the baseboard has.
				row[j] = fmt.Sprintf("NV%d", nvlinks)
			default:
				row[j] = distance(a.at, b.at)
			}
		}
		m.Cells = append(m.Cells, row)
	}
	return m
}

// HostMatrix is the host's matrix over the units' GPUs and GPU-adjacent NICs, GPUs in
// unit order, then NICs in unit order.
func HostMatrix(units []*Unit, nvlinks int) *Matrix {
	var es []matrixEntry
	for _, u := range units {
		es = append(es, matrixEntry{name: fmt.Sprintf("GPU%d", u.ID), addr: u.GPU.Addr, gpu: true, at: hostPlace(u.GPU)})
	}
	k := 0
	for _, u := range units {
		for _, n := range u.NICs {
			es = append(es, matrixEntry{name: fmt.Sprintf("NIC%d", k), addr: n.Addr, at: hostPlace(n)})
			k++
		}
	}
	return buildMatrix(es, nvlinks)
}

// Text renders the matrix as nvidia-smi topo -m does, with a NUMA column and the NIC
// legend.
func (m *Matrix) Text() string {
	var b strings.Builder
	b.WriteString("\t")
	for _, n := range m.Names {
		b.WriteString(n + "\t")
	}
	b.WriteString("NUMA Affinity\n")
	for i, n := range m.Names {
		b.WriteString(n + "\t")
		for _, c := range m.Cells[i] {
			if c == "X" {
				c = " X "
			}
			b.WriteString(c + "\t")
		}
		if m.NUMA[i] >= 0 && strings.HasPrefix(n, "GPU") {
			fmt.Fprintf(&b, "%d", m.NUMA[i])
		}
		b.WriteString("\n")
	}
	var legend []string
	for i, n := range m.Names {
		if strings.HasPrefix(n, "NIC") {
			legend = append(legend, fmt.Sprintf("  %s: %s", n, m.Addrs[i]))
		}
	}
	if len(legend) > 0 {
		b.WriteString("\nNIC Legend:\n\n" + strings.Join(legend, "\n") + "\n")
	}
	return b.String()
}
