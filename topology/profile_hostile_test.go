package topology

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
)

// profileBound is the size bound the issue asks for (1 MiB), written out here rather
// than taken from the code under test.
const profileBound = 1 << 20

// TestRuleMustNameWhatItMatches: a rule that names neither a vendor nor a class matches
// every function its other conditions allow (with none, all of them: root ports, switch
// ports and the management NIC). ParseProfile refuses it, naming the rule. "bridge:
// true" names what it matches (a bridge header; an operator's "every bridge is a switch
// port"), and a passthrough role on a bridge is refused when labelling.
func TestRuleMustNameWhatItMatches(t *testing.T) {
	for _, m := range []string{
		`{}`,
		`{port_type: [endpoint]}`,
		`{bridge: false, depth_min: 1}`,
		`{depth_max: 0, bridge: false}`, // the qemu profiles' root-bus rule before it named its vendors
		`{device: 0x1023}`,              // a device ID means nothing without its vendor
		`{subsystem_vendor: 0x10de}`,
		`{below: [{vendor: 0x15b3, device: 0x197c}]}`,
		`{not: {vendor: 0x10de}}`,
		`{vendor: []}`,
	} {
		src := "name: x\nrules:\n  - {name: gpu, role: gpu, match: {vendor: 0x10de, class: 0x030200}}\n  - {name: anything, role: gpu-nic, match: " + m + "}\n"
		_, err := ParseProfile("op.yaml", []byte(src))
		if err == nil || !strings.Contains(err.Error(), `profile op.yaml: rule "anything"`) || !strings.Contains(err.Error(), "neither a vendor nor a class") {
			t.Errorf("match %s: err = %v, want the rule refused for naming neither a vendor nor a class", m, err)
		}
	}
	for _, m := range []string{`{vendor: 0x10de}`, `{class: 0x020000, class_mask: 0xff0000}`, `{vendor: [0x15b3], device: 0x1023}`, `{bridge: true}`} {
		src := "name: x\nrules:\n  - {name: r, role: gpu-nic, match: " + m + "}\n"
		if _, err := ParseProfile("op.yaml", []byte(src)); err != nil {
			t.Errorf("match %s: %v", m, err)
		}
	}
}

// TestPassthroughRoleOnBridgeRefused: a rule broad enough to give a passthrough role to
// a bridge (here: everything Broadcom, which takes the PEX890xx switch ports before the
// class rule "bridge" does) makes the labelling unusable, naming the bridge and the
// rule; no bridge keeps a passthrough role, so none reaches a unit.
func TestPassthroughRoleOnBridgeRefused(t *testing.T) {
	n, tree := reference(t, "b300")
	p, err := Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	p.Rules = append(p.Rules, Rule{Name: "all-broadcom", Role: RoleGPUNIC, Match: Match{Vendor: IDs{pcitest.VendorBroadcom}}})
	l, err := Label(tree, p)
	if err == nil {
		t.Fatal("a profile giving gpu-nic to the Broadcom switch ports was accepted")
	}
	usp := n.Addr("bcm-usp3")
	if !strings.Contains(err.Error(), usp.String()) || !strings.Contains(err.Error(), `"all-broadcom"`) || !strings.Contains(err.Error(), "bridge") {
		t.Errorf("err = %v, want the bridge %s and the rule all-broadcom named", err, usp)
	}
	if l == nil {
		t.Fatal("no labels returned")
	}
	for _, d := range tree.Devices {
		if fl := l.Of(d.Addr); d.IsBridge() && fl.Role.Passthrough() {
			t.Errorf("bridge %s kept role %s (rule %s)", d.Addr, fl.Role, fl.Rule)
		}
	}
	if fl := l.Of(usp); fl.Role != RoleUnlabeled || !strings.Contains(fl.Reason, "all-broadcom") {
		t.Errorf("bridge %s labelled %+v, want unlabeled with the rule named", usp, fl)
	}
	for _, u := range l.Units {
		for _, f := range u.Functions() {
			if f.IsBridge() {
				t.Errorf("unit %s holds bridge %s", u.ID, f.Addr)
			}
		}
	}
	// The endpoints the rule takes are not refused: the Broadcom placeholder is named by
	// its own (more specific) rule and stays a placeholder.
	if r := l.RoleOf(n.Addr("holder3")); r != RolePlaceholder {
		t.Errorf("placeholder labelled %s", r)
	}
}

// TestBroadPassthroughRuleCannotTakeMgmtNIC: a passthrough rule that would take every
// network function (by class) or every function of the management NIC's vendor does not
// take the management NIC of the reference B300 when a more specific host rule names
// it: the NIC stays mgmt-nic and in no unit, whatever the order of the rules.
func TestBroadPassthroughRuleCannotTakeMgmtNIC(t *testing.T) {
	n, tree := reference(t, "b300")
	const base = `  - {name: gpu, role: gpu, match: {vendor: 0x10de, class: 0x030200, class_mask: 0xffff00}}
  - {name: bridge, role: switch-port, match: {class: 0x060400, class_mask: 0xffff00}}
`
	for _, c := range []struct{ broad, host string }{
		{"  - {name: every-nic, role: gpu-nic, match: {class: 0x020000, class_mask: 0xff0000}}\n",
			"  - {name: mgmt, role: mgmt-nic, match: {vendor: 0x14e4, class: 0x020000, class_mask: 0xff0000}}\n"},
		{"  - {name: every-broadcom-nic, role: gpu-nic, match: {vendor: 0x14e4}}\n",
			"  - {name: mgmt, role: mgmt-nic, match: {vendor: 0x14e4, device: 0x16d7}}\n"},
		{"  - {name: every-nic-on-a-root-port, role: gpu-nic, match: {class: 0x020000, class_mask: 0xff0000, parent: {port_type: [root]}}}\n",
			"  - {name: mgmt, role: mgmt-nic, match: {vendor: 0x14e4, device: 0x16d7}}\n"},
	} {
		for _, src := range []string{base + c.broad + c.host, base + c.host + c.broad} {
			p, err := ParseProfile("test", []byte("name: broad\nrules:\n"+src))
			if err != nil {
				t.Fatal(err)
			}
			l, err := Label(tree, p)
			if err != nil {
				t.Fatalf("%s: %v", src, err)
			}
			for _, name := range []string{"mgmt0", "mgmt1"} {
				a := n.Addr(name)
				if fl := l.Of(a); fl.Role != RoleMgmtNIC || fl.Rule != "mgmt" {
					t.Errorf("%s%s: %s labelled %+v, want mgmt-nic by rule mgmt", c.broad, c.host, name, fl)
				}
				if u, ok := l.UnitOf(a); ok {
					t.Errorf("%s: %s in unit %s", c.broad, name, u)
				}
				for _, u := range l.Units {
					for _, f := range u.Functions() {
						if f.Addr == a {
							t.Errorf("%s: %s passed through with unit %s", c.broad, name, u.ID)
						}
					}
				}
			}
			if len(l.Units) != 8 {
				t.Errorf("%d units", len(l.Units))
			}
		}
	}
}

// TestProfileOneDocument: a second YAML document in a profile file is not silently
// ignored.
func TestProfileOneDocument(t *testing.T) {
	const first = "name: x\nrules: [{name: a, role: gpu, match: {vendor: 0x10de}}]\n"
	for _, rest := range []string{
		"---\nname: y\nrules: [{name: b, role: gpu-nic, match: {vendor: 0x14e4}}]\n",
		"---\n{rules: [{name: b, role: gpu-nic, match: {vendor: 0x14e4}}]}\n",
		"--- 3\n",
		"---\nname: [unclosed\n",
	} {
		_, err := ParseProfile("two.yaml", []byte(first+rest))
		if err == nil || !strings.Contains(err.Error(), "profile two.yaml: more than one YAML document") {
			t.Errorf("%q: err = %v, want the second document refused", rest, err)
		}
	}
	for _, ok := range []string{first, "---\n" + first, first + "...\n", first + "# trailing comment\n"} {
		if _, err := ParseProfile("one.yaml", []byte(ok)); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
}

// bigProfile is a valid profile padded with a comment to size bytes.
func bigProfile(size int) []byte {
	b := []byte("name: big\nrules: [{name: a, role: gpu, match: {vendor: 0x10de}}]\n#")
	pad := make([]byte, size-len(b)-1)
	for i := range pad {
		pad[i] = 'x'
	}
	return append(append(b, pad...), '\n')
}

// TestProfileSizeBound: a profile is a few KB; one beyond 1 MiB is refused by
// ParseProfile, and LoadProfile refuses a file beyond it without reading it whole (a
// 200 MB profile took 880 MB).
func TestProfileSizeBound(t *testing.T) {
	if _, err := ParseProfile("ok.yaml", bigProfile(profileBound)); err != nil {
		t.Errorf("a profile of exactly 1 MiB: %v", err)
	}
	if _, err := ParseProfile("big.yaml", bigProfile(profileBound+1)); err == nil || !strings.Contains(err.Error(), "profile big.yaml") || !strings.Contains(err.Error(), "1 MiB") {
		t.Errorf("ParseProfile of 1 MiB + 1: err = %v, want refused", err)
	}

	dir := t.TempDir()
	file := filepath.Join(dir, "big.yaml")
	if err := os.WriteFile(file, bigProfile(2*profileBound), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadProfile(file); err == nil || !strings.Contains(err.Error(), "1 MiB") {
		t.Errorf("LoadProfile of 2 MiB: err = %v, want refused", err)
	}

	// A sparse 256 MiB file: refused from its size, before it is read.
	huge := filepath.Join(dir, "huge.yaml")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(256 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err = LoadProfile(huge)
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(err.Error(), "1 MiB") {
		t.Errorf("LoadProfile of 256 MiB: err = %v, want refused", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 4<<20 {
		t.Errorf("LoadProfile of a 256 MiB file allocated %d MiB before refusing it", got>>20)
	}

	// A file whose size stat cannot tell (a FIFO: size 0) is read only up to the bound.
	fifo := filepath.Join(dir, "stream.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	wrote := make(chan int64, 1)
	go func() {
		w, err := os.OpenFile(fifo, os.O_WRONLY, 0)
		if err != nil {
			wrote <- -1
			return
		}
		defer w.Close()
		var n int64
		b := bigProfile(3 * profileBound)
		for len(b) > 0 {
			k, err := w.Write(b)
			n += int64(k)
			if err != nil {
				break // the reader stopped reading: EPIPE
			}
			b = b[k:]
		}
		wrote <- n
	}()
	if _, err := LoadProfile(fifo); err == nil || !strings.Contains(err.Error(), "1 MiB") {
		t.Errorf("LoadProfile of a 3 MiB stream: err = %v, want refused", err)
	}
	if n := <-wrote; n >= 3*profileBound {
		t.Errorf("LoadProfile read the whole %d-byte stream", n)
	}
}
