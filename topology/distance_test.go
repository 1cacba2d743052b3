package topology

import (
	"testing"
)

func TestHostMatrixB300(t *testing.T) {
	n, tree := reference(t, "b300")
	l := mustLabel(t, tree, "b300")
	m := HostMatrix(l.Units, l.Profile.NVLinks)
	if len(m.Names) != 8+16 {
		t.Fatalf("matrix over %d devices", len(m.Names))
	}
	for _, c := range []struct{ a, b, want string }{
		{"gpu0", "nic0.0", PXB}, // GPU below a second switch inside the CX-8: as on the real host
		{"gpu7", "nic7.1", PXB},
		{"nic0.0", "nic0.1", PIX},
		{"gpu0", "nic1.0", NODE}, // another root complex, same socket
		{"gpu0", "nic4.0", SYS},
		{"gpu0", "gpu5", "NV18"},
	} {
		if got := m.At(n.Addr(c.a), n.Addr(c.b)); got != c.want {
			t.Errorf("%s-%s = %s, want %s", c.a, c.b, got, c.want)
		}
	}
}

func TestHostMatrixB200(t *testing.T) {
	n, tree := reference(t, "b200")
	l := mustLabel(t, tree, "b200")
	if len(l.Units) != 8 {
		t.Fatalf("%d units", len(l.Units))
	}
	for i, u := range l.Units {
		if len(u.NICs) != 1 || len(u.NVMe) != 1 {
			t.Errorf("unit %d: %d NICs %d NVMe", i, len(u.NICs), len(u.NVMe))
		}
	}
	m := HostMatrix(l.Units, l.Profile.NVLinks)
	if got := m.At(n.Addr("gpu3"), n.Addr("nic3.0")); got != PIX {
		t.Errorf("B200 GPU-NIC = %s, want PIX", got)
	}
	if got := m.At(n.Addr("gpu3"), n.Addr("nic5.0")); got != SYS {
		t.Errorf("B200 GPU3-NIC5 = %s, want SYS", got)
	}
}
