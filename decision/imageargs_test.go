package decision

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
)

// configACSEntries is the plan's targets as pci=config_acs= entries, written out here
// without topology.KernelArg so the property below holds ImageArgs to the grammar, not to
// itself: seven flags, bit 6 (DT) first, 'x' where the mask leaves the bit, '@', the
// port's address; ';' between entries.
func configACSEntries(s *Saved) string {
	var es []string
	for _, p := range s.ACS {
		if p.Offset == 0 || p.Mask == 0 || p.Skip != "" {
			continue
		}
		var b strings.Builder
		for bit := 6; bit >= 0; bit-- {
			switch v := uint16(1) << bit; {
			case uint16(p.Mask)&v == 0:
				b.WriteByte('x')
			case uint16(p.Flags)&v != 0:
				b.WriteByte('1')
			default:
				b.WriteByte('0')
			}
		}
		es = append(es, b.String()+"@"+p.Addr.String())
	}
	return strings.Join(es, ";")
}

// savedB300 is the file `passage plan -o` writes for the B300 reference node.
func savedB300(t testing.TB) []byte {
	t.Helper()
	d := b300Decision(t, Live{})
	s, err := d.Save()
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := s.Write(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestImageArgsFailedUnit: a plan of a node one of whose units fails (its NIC without
// ATS under passage.ats=require) leaves that unit's ports out of its kernel_arg, and
// ImageArgs rebuilds the same argument, without them: the image of a node planned with a
// failed unit is not refused as edited (QEMU scenario 8's other-topology boot).
func TestImageArgsFailedUnit(t *testing.T) {
	spec := pcitest.B300()
	spec.Fn("nic3.0").ATS = nil
	tree, err := pci.Scan(pcitest.New(t, spec).Root)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	d, err := Decide(Input{Tree: tree, Profile: p, ATS: "require", Erase: erase.PolicyOff})
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.Save()
	if err != nil {
		t.Fatal(err)
	}
	skipped := 0
	for _, p := range s.ACS {
		if p.Skip != "" && p.Offset != 0 {
			skipped++
		}
	}
	if skipped == 0 {
		t.Fatal("the failed unit skipped no port: the test shows nothing")
	}
	var buf bytes.Buffer
	if err := s.Write(&buf); err != nil {
		t.Fatal(err)
	}
	out, err := ImageArgs(buf.Bytes())
	if err != nil {
		t.Fatalf("a plan with a failed unit: %v", err)
	}
	if want := s.KernelArg + " " + PlanArg + "=" + PlanDigest(buf.Bytes()); out != want || !strings.Contains(out, configACSEntries(s)) {
		t.Errorf("printed %q, want %q", out, want)
	}
}

// FuzzImageArgs: whatever a plan file holds, ImageArgs either refuses it or prints
// exactly pci=config_acs=<the plan's targets> passage.plan=sha256:<the file's digest>.
func FuzzImageArgs(f *testing.F) {
	b := savedB300(f)
	f.Add(b)
	for _, inject := range []string{"\rrdinit=/bin/sh", "\x00init=/bin/sh", "\u00a0rdinit=/bin/sh", ",noats", "$(reboot)"} {
		f.Add(bytes.Replace(b, []byte(`;xx`), []byte(inject+`;xx`), 1))
	}
	f.Add(bytes.Replace(b, []byte(`"mask": "0x001d"`), []byte(`"mask": "0x009d"`), 1))
	// A small plan, so the fuzzer's mutations reach the fields rather than the profile.
	f.Add([]byte(`{"version":4,"profile":{},"acs":[{"addr":"0000:00:01.0","offset":256,"mask":"0x005d","flags":"0x001d"},` +
		`{"addr":"0000:01:00.0","offset":0}],"kernel_arg":"pci=config_acs=0x111x1@0000:00:01.0"}`))
	// A port listed twice, every control off first: the kernel would apply that entry.
	f.Add([]byte(`{"version":4,"profile":{},"acs":[{"addr":"0000:00:01.0","offset":256,"mask":"0x007f","flags":"0x0000"},` +
		`{"addr":"0000:00:01.0","offset":256,"mask":"0x005d","flags":"0x001d"}],"kernel_arg":"pci=config_acs=0000000@0000:00:01.0;0x111x1@0000:00:01.0"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		out, err := ImageArgs(b)
		if err != nil {
			if out != "" {
				t.Fatalf("refused (%v) and printed %q", err, out)
			}
			return
		}
		s, err := ReadSaved(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("ImageArgs took a plan ReadSaved refuses: %v", err)
		}
		want := "pci=config_acs=" + configACSEntries(s) + " " + PlanArg + "=" + PlanDigest(b)
		if out != want {
			t.Fatalf("ImageArgs printed\n %q\nwant\n %q", out, want)
		}
		// What the image carries is what the kernel applies: for each port, the entry
		// __pci_config_acs reads first for it is the port's own.
		acs := apply.ParseConfigACS(out)
		for _, p := range s.ACS {
			if p.Offset == 0 || p.Skip != "" || p.Mask == 0 {
				continue
			}
			if r := acs.For(nil, p.Addr); !r.Set || r.Setting.Mask != p.Mask || r.Setting.Flags != p.Flags {
				t.Fatalf("acs %s: the kernel reads %+v from %q, the plan has mask %s flags %s", p.Addr, r, out, p.Mask, p.Flags)
			}
		}
	})
}

// TestImageArgsRebuilds: an untouched plan passes and prints its targets; the same plan
// with kernel_arg edited is refused even when the edit stays within the grammar, and a
// port whose mask reaches past bit 6 is refused naming the port.
func TestImageArgsRebuilds(t *testing.T) {
	b := savedB300(t)
	out, err := ImageArgs(b)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ReadSaved(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if want := "pci=config_acs=" + configACSEntries(s) + " " + PlanArg + "=" + PlanDigest(b); out != want || len(s.ACS) == 0 {
		t.Fatalf("printed %q, want %q", out, want)
	}
	edit := func(f func(m map[string]any)) []byte {
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		f(m)
		nb, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return nb
	}
	for name, c := range map[string]struct {
		b    []byte
		want string
	}{
		"one entry dropped": {edit(func(m map[string]any) {
			m["kernel_arg"] = m["kernel_arg"].(string)[:strings.LastIndex(m["kernel_arg"].(string), ";")]
		}), "kernel_arg"},
		"mask past bit 6": {edit(func(m map[string]any) {
			m["acs"].([]any)[0].(map[string]any)["mask"] = "0x009d"
		}), "acs " + s.ACS[0].Addr.String()},
		"flag outside the mask": {edit(func(m map[string]any) {
			m["acs"].([]any)[0].(map[string]any)["flags"] = "0x007f"
		}), "acs " + s.ACS[0].Addr.String()},
		"no port to set": {edit(func(m map[string]any) { m["acs"] = []any{} }), "nothing to bake"},
	} {
		out, err := ImageArgs(c.b)
		if err == nil || out != "" || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: printed %q, error %v; want refused naming %q", name, out, err, c.want)
		}
	}
}
