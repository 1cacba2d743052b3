package topology

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
)

// testPlan assembles a Plan the way package decision does, from topology's own parts
// (decision imports topology, so a topology test cannot ask it).
func testPlan(t *testing.T, tree *pci.Tree, profile string, opt GuestOptions) *Plan {
	t.Helper()
	l := mustLabel(t, tree, profile)
	pl := &Plan{Labels: l, ACS: ACSPlan(l.Units), Host: HostMatrix(l.Units, l.Profile.NVLinks)}
	pl.KernelArg = KernelArg(pl.ACS)
	g, err := GuestPlan(l.Units, opt)
	if err != nil {
		t.Fatal(err)
	}
	pl.Guest, pl.GuestMatrix = g, g.Matrix(l.Profile.NVLinks)
	return pl
}

func TestPlanReports(t *testing.T) {
	n, tree := reference(t, "b300")
	pl := testPlan(t, tree, "b300", GuestOptions{Units: []UnitID{0, 1}})
	js, err := json.Marshal(pl.Doc())
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Profile string     `json:"profile"`
		Units   []UnitJSON `json:"units"`
		Funcs   []struct {
			Addr string  `json:"addr"`
			Role Role    `json:"role"`
			Unit *string `json:"unit"`
		} `json:"functions"`
		ACS []struct {
			Addr    string `json:"addr"`
			Unit    string `json:"unit"`
			CtlFrom string `json:"ctl_current"`
			CtlTo   string `json:"ctl_target"`
			Flags   string `json:"config_acs"`
			Skip    string `json:"skip"`
		} `json:"acs"`
		Guest struct {
			Units []struct {
				Functions []struct {
					Host string `json:"host"`
					Addr string `json:"addr"`
				} `json:"functions"`
			} `json:"units"`
		} `json:"guest"`
		GuestMatrix struct {
			Addrs []string `json:"addrs"`
		} `json:"guest_matrix"`
		KernelArg string `json:"kernel_arg"`
	}
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Profile != "b300" {
		t.Errorf("profile %q", doc.Profile)
	}
	if len(doc.Units) != 8 || doc.Units[3].GPU != n.Addr("gpu3").String() || len(doc.Units[3].NICs) != 2 || doc.Units[3].Status != StatusReady {
		t.Errorf("units %+v", doc.Units)
	}
	if len(doc.Guest.Units) != 2 || doc.Guest.Units[0].Functions[0].Host != n.Addr("gpu0").String() {
		t.Errorf("guest %+v", doc.Guest)
	}
	if len(doc.GuestMatrix.Addrs) != 6 || !strings.HasPrefix(doc.GuestMatrix.Addrs[0], "0000:") {
		t.Errorf("guest matrix addrs %v", doc.GuestMatrix.Addrs)
	}
	if doc.KernelArg != pl.KernelArg || !strings.HasPrefix(doc.KernelArg, "pci=config_acs=") {
		t.Errorf("kernel arg %q", doc.KernelArg)
	}
	var found bool
	for _, f := range doc.Funcs {
		if f.Addr == n.Addr("nic5.1").String() {
			found = f.Role == RoleGPUNIC && f.Unit != nil && *f.Unit == "gpu5"
		}
	}
	if !found {
		t.Errorf("nic5.1 not listed as gpu-nic of unit 5")
	}
	// The ACS entries carry the registers as four hex digits, 0x-prefixed.
	if len(doc.ACS) != len(pl.ACS) {
		t.Fatalf("%d ACS entries, plan has %d", len(doc.ACS), len(pl.ACS))
	}
	var nicPort bool
	for i, a := range doc.ACS {
		p := pl.ACS[i]
		if a.Addr != p.Addr.String() || a.Unit != p.Unit.String() || a.Skip != "" {
			t.Errorf("acs entry %d %+v for port %s unit %d", i, a, p.Addr, p.Unit)
		}
		if want := "0x" + hex4(uint16(p.Current)); a.CtlFrom != want {
			t.Errorf("%s ctl_current %q, want %q", a.Addr, a.CtlFrom, want)
		}
		if want := "0x" + hex4(uint16(p.Target())); a.CtlTo != want {
			t.Errorf("%s ctl_target %q, want %q", a.Addr, a.CtlTo, want)
		}
		if a.Addr == n.Addr("cx-dsp-nic4").String() {
			nicPort = true
			// SV RR CR UF DT: 0x01|0x04|0x08|0x10|0x40.
			if a.CtlTo != "0x005d" || a.Flags != "1x111x1" {
				t.Errorf("NIC port of unit 4: %+v", a)
			}
		}
	}
	if !nicPort {
		t.Errorf("NIC port of unit 4 not in the document")
	}

	var txt bytes.Buffer
	if err := pl.WriteText(&txt); err != nil {
		t.Fatal(err)
	}
	out := txt.String()
	for _, want := range []string{"host matrix", "guest matrix (units gpu0,gpu1; flat", "GPU0\t X \tNV18", "1x111x1", "kernel argument: pci=config_acs="} {
		if !strings.Contains(out, want) {
			t.Errorf("text report lacks %q", want)
		}
	}
	if strings.Contains(out, "not written:") {
		t.Errorf("text report skips ports no one skipped")
	}
}

func hex4(v uint16) string {
	const digits = "0123456789abcdef"
	return string([]byte{digits[v>>12], digits[v>>8&0xf], digits[v>>4&0xf], digits[v&0xf]})
}

// TestPlanReportsSkip: a port the decision leaves alone says so, in the text and in the
// JSON, instead of its reason.
func TestPlanReportsSkip(t *testing.T) {
	n, tree := reference(t, "b300")
	pl := testPlan(t, tree, "b300", GuestOptions{Units: []UnitID{0}})
	skipped := n.Addr("cx-dsp-nic2")
	for i := range pl.ACS {
		if pl.ACS[i].Addr == skipped {
			pl.ACS[i].Skip = "unit failed: test"
		}
	}
	var txt bytes.Buffer
	if err := pl.WriteText(&txt); err != nil {
		t.Fatal(err)
	}
	// The ACS plan section lists each port at the start of its line.
	_, acs, ok := strings.Cut(txt.String(), "\nacs plan\n")
	if !ok {
		t.Fatalf("no acs plan section:\n%s", txt.String())
	}
	var line string
	for _, l := range strings.Split(acs, "\n") {
		if strings.HasPrefix(l, skipped.String()+" ") {
			line = l
		}
	}
	if !strings.Contains(line, "not written: unit failed: test") {
		t.Errorf("ACS line of %s: %q", skipped, line)
	}
	doc := pl.Doc()
	for _, a := range doc.ACS {
		if (a.Addr == skipped.String()) != (a.Skip == "unit failed: test") {
			t.Errorf("acs entry %s skip %q", a.Addr, a.Skip)
		}
	}
}
