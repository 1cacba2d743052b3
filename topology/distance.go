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

// distance is the path type between two endpoints. The switches two endpoints share are
// the top of both lists (they are the common part of two paths down one tree), so the
// nearest shared switch is where the lists, compared from the top, last agree: one walk,
// not every pair of switches.
func distance(a, b place) string {
	if a.host != b.host {
		if a.numa == b.numa || a.numa < 0 || b.numa < 0 {
			return NODE
		}
		return SYS
	}
	i, j := len(a.switches)-1, len(b.switches)-1
	for i >= 0 && j >= 0 && a.switches[i] == b.switches[j] {
		i, j = i-1, j-1
	}
	switch {
	case i == len(a.switches)-1:
		return PHB // no switch in common
	case i < 0 && j < 0:
		return PIX // both nearest switches are the same one
	}
	return PXB
}

// MaxMatrixEntries bounds a distance matrix: with more GPUs and NICs than this the
// matrix is omitted (Omitted says so) rather than computed, since its cells grow as the
// square of its entries (a dump of 20 000 GPUs would need 3.6e9). A real node is far
// below it (an HGX B300 has 8 GPUs and 16 NIC PFs), and so is every guest plan: a guest
// function takes a bus number of its own, and a guest has 256.
const MaxMatrixEntries = 256

// Matrix is a distance matrix over GPUs and NICs, laid out like nvidia-smi topo -m.
type Matrix struct {
	Names []string      `json:"names"` // GPU0.., NIC0..
	Addrs []pci.Address `json:"addrs"`
	NUMA  []int         `json:"numa"`
	Cells [][]string    `json:"cells"` // Cells[i][j]; "X" on the diagonal
	// Omitted says why the matrix is empty: more than MaxMatrixEntries GPUs and NICs.
	Omitted string `json:"omitted,omitempty"`
}

// omittedMatrix is the matrix of n GPUs and NICs when n is past MaxMatrixEntries.
func omittedMatrix(n int) *Matrix {
	return &Matrix{Omitted: fmt.Sprintf("%d GPUs and NICs, more than %d: the matrix (%d cells) is omitted", n, MaxMatrixEntries, n*n)}
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
	if len(es) > MaxMatrixEntries {
		return omittedMatrix(len(es))
	}
	// NVLink does not show in PCIe: the profile says what the baseboard has.
	nv := fmt.Sprintf("NV%d", nvlinks)
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
				row[j] = nv
			default:
				row[j] = distance(a.at, b.at)
			}
		}
		m.Cells = append(m.Cells, row)
	}
	return m
}

// HostMatrix is the host's matrix over the units' GPUs and GPU-adjacent NICs, GPUs in
// unit order, then NICs in unit order; past MaxMatrixEntries of them it is omitted.
func HostMatrix(units []*Unit, nvlinks int) *Matrix {
	n := len(units)
	for _, u := range units {
		n += len(u.NICs)
	}
	if n > MaxMatrixEntries {
		return omittedMatrix(n)
	}
	es := make([]matrixEntry, 0, n)
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
// legend; an omitted matrix is the line saying why.
func (m *Matrix) Text() string {
	if m.Omitted != "" {
		return "(" + m.Omitted + ")\n"
	}
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
