package qemutest

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/initramfs/emit"
)

func encode(t testing.TB, name string, data []byte) string {
	t.Helper()
	var b bytes.Buffer
	if err := emit.File(&b, name, data); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestParseConsoleRoundTrip(t *testing.T) {
	manifest := bytes.Repeat([]byte(`{"unit":"gpu0","bdf":"0000:09:00.0"}`+"\n"), 40)
	empty := []byte{}
	blockM := encode(t, "manifest.json", manifest)
	// Kernel messages interleave inside a block; base64-alphabet-free lines are dropped.
	lines := strings.Split(blockM, "\n")
	withNoise := strings.Join(append(append(append([]string{}, lines[:3]...),
		"[   10.123456] vfio-pci 0000:09:00.0: enabling device (0000 -> 0002)\r"), lines[3:]...), "\n")
	log := "SeaBIOS (version 1.16.2)\r\n" +
		"[    0.000000] Linux version 6.1.0-57-amd64\r\n" +
		"PASSAGE-T uinit-start 7.012\r\n" +
		withNoise +
		encode(t, "empty", empty) +
		"PASSAGE-T manifest-written 9.500\n" +
		"PASSAGE-T handoff 9.750\n" +
		"===PASSAGE-DONE degraded===\r\n" +
		"[   10.0] reboot: Power down\n"
	rep, err := ParseConsole(strings.NewReader(log))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Errors) != 0 {
		t.Fatalf("errors: %v", rep.Errors)
	}
	if !bytes.Equal(rep.Files["manifest.json"], manifest) {
		t.Errorf("manifest.json: got %d bytes, want %d", len(rep.Files["manifest.json"]), len(manifest))
	}
	if d, ok := rep.Files["empty"]; !ok || len(d) != 0 {
		t.Errorf("empty file: %q, %v", d, ok)
	}
	if rep.Done != "degraded" {
		t.Errorf("Done = %q", rep.Done)
	}
	want := map[string]float64{"uinit-start": 7.012, "manifest-written": 9.5, "handoff": 9.75}
	for k, v := range want {
		if rep.Markers[k] != v {
			t.Errorf("marker %s = %v, want %v", k, rep.Markers[k], v)
		}
	}
	tl := rep.Timeline()
	if !strings.Contains(tl, "uinit-start") || strings.Index(tl, "kernel-start") > strings.Index(tl, "handoff") {
		t.Errorf("timeline:\n%s", tl)
	}
}

func TestParseConsoleDamage(t *testing.T) {
	data := []byte("the quick brown fox jumps over the lazy dog, twice: the quick brown fox jumps over the lazy dog")
	good := encode(t, "f", data)
	lines := strings.Split(strings.TrimSuffix(good, "\n"), "\n")
	for _, tc := range []struct {
		name, log, want string
	}{
		{"line lost", strings.Join(append([]string{lines[0]}, lines[2:]...), "\n"), "console file f:"},
		{"line altered", strings.Replace(good, lines[1], strings.ToUpper(lines[1]), 1), "sha256"},
		{"size lie", strings.Replace(good, fmt.Sprintf(" %d ", len(data)), fmt.Sprintf(" %d ", len(data)+1), 1), "BEGIN said"},
		{"no end", strings.Join(lines[:len(lines)-1], "\n"), "no END"},
		{"end without begin", "===PASSAGE-FILE-END x===\n", "END without BEGIN"},
		{"end names another", strings.Replace(good, "FILE-END f", "FILE-END g", 1), "END names g"},
		{"sent twice", good + good, "sent twice"},
		{"nested begin", lines[0] + "\n" + good, "no END before BEGIN"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := ParseConsole(strings.NewReader(tc.log))
			if err != nil {
				t.Fatal(err)
			}
			if len(rep.Errors) == 0 {
				t.Fatalf("no error; files %q", rep.Files)
			}
			if !strings.Contains(fmt.Sprint(rep.Errors), tc.want) {
				t.Errorf("errors %v, want %q", rep.Errors, tc.want)
			}
		})
	}
}

func FuzzParseConsole(f *testing.F) {
	f.Add([]byte(encode(f, "a", []byte("hello")) + "===PASSAGE-DONE ok===\nPASSAGE-T handoff 1.000\n"))
	f.Add([]byte("===PASSAGE-FILE-BEGIN x 99999999999999999999 " + strings.Repeat("0", 64) + "===\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		rep, err := ParseConsole(bytes.NewReader(data))
		if err != nil {
			return
		}
		for name, d := range rep.Files {
			// Whatever decodes must re-encode to a block that decodes to the same bytes.
			again, _ := ParseConsole(strings.NewReader(encode(t, name, d)))
			if !bytes.Equal(again.Files[name], d) {
				t.Fatalf("file %s does not round-trip", name)
			}
		}
	})
}

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
