package qemutest

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestTopologyArgs(t *testing.T) {
	for _, topo := range []Topology{{}, {Units: 4}, {ATSOff: true, SharedGroup: true, NoACSPort: true}} {
		args := topo.Args()
		ids := map[string]bool{}
		chassis := map[string]bool{}
		for i := 0; i < len(args); i += 2 {
			if args[i] != "-device" && args[i] != "-netdev" {
				t.Fatalf("%s: unexpected %q", topo.Name(), args[i])
			}
			for _, kv := range strings.Split(args[i+1], ",") {
				k, v, _ := strings.Cut(kv, "=")
				switch k {
				case "id":
					if ids[v] {
						t.Errorf("%s: id %s twice", topo.Name(), v)
					}
					ids[v] = true
				case "chassis":
					if chassis[v] {
						t.Errorf("%s: chassis %s twice", topo.Name(), v)
					}
					chassis[v] = true
				case "netdev":
					if !ids[v] {
						t.Errorf("%s: netdev %s used before it is defined", topo.Name(), v)
					}
				}
			}
			if args[i] == "-netdev" && !strings.Contains(args[i+1], "restrict=on") {
				t.Errorf("%s: netdev without restrict=on: %s", topo.Name(), args[i+1])
			}
		}
		units := topo.Units
		if units == 0 {
			units = 2
		}
		joined := strings.Join(args, " ")
		if n := strings.Count(joined, "virtio-gpu-pci,"); n != units {
			t.Errorf("%s: %d GPU stand-ins, want %d", topo.Name(), n, units)
		}
		if n := strings.Count(joined, "ats=off"); (n == 1) != topo.ATSOff {
			t.Errorf("%s: %d ats=off", topo.Name(), n)
		}
		if strings.Contains(joined, "xio3130-downstream") != topo.NoACSPort ||
			strings.Contains(joined, "pcie-pci-bridge") != topo.SharedGroup {
			t.Errorf("%s: variant devices wrong: %s", topo.Name(), joined)
		}
		back, err := ParseTopology(topo.Name())
		if err != nil || back.ATSOff != topo.ATSOff || back.SharedGroup != topo.SharedGroup || back.NoACSPort != topo.NoACSPort {
			t.Errorf("ParseTopology(%q) = %+v, %v", topo.Name(), back, err)
		}
	}
	if _, err := ParseTopology("ats-off+bogus"); err == nil || !strings.Contains(err.Error(), "bogus") {
		t.Errorf("ParseTopology(bogus): %v", err)
	}
}

func TestCmdline(t *testing.T) {
	got := Cmdline([]string{"passage.handoff=hold", "lockdown=integrity"})
	if strings.Contains(got, "passage.handoff=poweroff") || !strings.HasSuffix(got, "passage.handoff=hold lockdown=integrity") {
		t.Errorf("Cmdline = %q", got)
	}
	if !strings.Contains(Cmdline(nil), "passage.emit=console") {
		t.Errorf("default cmdline lacks passage.emit=console")
	}
}

func TestOverlayAndConcat(t *testing.T) {
	dir := t.TempDir()
	ov := filepath.Join(dir, "ov.cpio")
	if err := writeOverlay(ov, []OverlayFile{{Name: "bbin/uinit", Data: []byte("#!x\n"), Mode: 0o755}}); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(ov)
	for _, want := range []string{"070701", "bbin\x00", "bbin/uinit\x00", "#!x\n", "TRAILER!!!"} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("overlay lacks %q", want)
		}
	}
	if len(b)%4 != 0 {
		t.Errorf("overlay length %d not 4-aligned", len(b))
	}
	if err := writeOverlay(ov, []OverlayFile{{Name: "/abs"}}); err == nil {
		t.Error("absolute overlay path accepted")
	}
	base := filepath.Join(dir, "base")
	os.WriteFile(base, []byte("12345"), 0o644)
	all := filepath.Join(dir, "all")
	if err := concat(all, base, ov); err != nil {
		t.Fatal(err)
	}
	c, _ := os.ReadFile(all)
	if !bytes.HasPrefix(c, []byte("12345\x00\x00\x00070701")) {
		t.Errorf("concat does not pad to 4 bytes: %q", c[:12])
	}
}
