package topology

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestPlanReports(t *testing.T) {
	n, tree := reference(t, "b300")
	p, _ := Builtin("b300")
	pl, err := NewPlan(tree, p, GuestOptions{Units: []int{0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	var js bytes.Buffer
	if err := pl.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Units []UnitJSON `json:"units"`
		Funcs []struct {
			Addr string `json:"addr"`
			Role Role   `json:"role"`
			Unit *int   `json:"unit"`
		} `json:"functions"`
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
	if err := json.Unmarshal(js.Bytes(), &doc); err != nil {
		t.Fatal(err)
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
	if !strings.HasPrefix(doc.KernelArg, "pci=config_acs=") {
		t.Errorf("kernel arg %q", doc.KernelArg)
	}
	var found bool
	for _, f := range doc.Funcs {
		if f.Addr == n.Addr("nic5.1").String() {
			found = f.Role == RoleGPUNIC && f.Unit != nil && *f.Unit == 5
		}
	}
	if !found {
		t.Errorf("nic5.1 not listed as gpu-nic of unit 5")
	}

	var txt bytes.Buffer
	if err := pl.WriteText(&txt); err != nil {
		t.Fatal(err)
	}
	out := txt.String()
	for _, want := range []string{"host matrix", "guest matrix (units 0,1; flat", "GPU0\t X \tNV18", "1x111x1", "kernel argument: pci=config_acs="} {
		if !strings.Contains(out, want) {
			t.Errorf("text report lacks %q", want)
		}
	}
}
