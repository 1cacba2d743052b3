package topology

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
)

const nvsmiSample = "testdata/nvidia-smi-q-hgx-b300.txt"

// TestNVSMIModules: the eight GPUs of an HGX B300's nvidia-smi -q (synthetic, in the
// real layout: testdata) give the profile a modules: stanza that ParseProfile reads
// back to the driver's map, Module IDs out of PCI order kept as the driver gave them.
func TestNVSMIModules(t *testing.T) {
	b, err := os.ReadFile(nvsmiSample)
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := ParseNVSMI(b)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{
		"0000:1b:00.0": 2, "0000:43:00.0": 1, "0000:52:00.0": 4, "0000:61:00.0": 3,
		"0000:9d:00.0": 6, "0000:c3:00.0": 5, "0000:d1:00.0": 8, "0000:df:00.0": 7,
	}
	if len(gpus) != 8 {
		t.Fatalf("%d GPUs: %+v", len(gpus), gpus)
	}
	for _, g := range gpus {
		if want[g.Addr.String()] != g.Module {
			t.Errorf("GPU %s (line %d): module %d, want %d", g.Addr, g.Line, g.Module, want[g.Addr.String()])
		}
	}
	stanza, unknown, err := ModulesStanza(gpus, "nvidia-smi -q of node-1")
	if err != nil || len(unknown) != 0 {
		t.Fatalf("%v, unknown %v", err, unknown)
	}
	if !strings.Contains(string(stanza), "modules:\n  \"0000:1b:00.0\": 2\n  \"0000:43:00.0\": 1\n") {
		t.Errorf("stanza not in address order:\n%s", stanza)
	}
	p, err := ParseProfile("op.yaml", append([]byte("name: op\n"), append(stanza, "rules: [{name: a, role: gpu, match: {vendor: 0x10de}}]\n"...)...))
	if err != nil {
		t.Fatalf("the stanza:\n%s\nParseProfile: %v", stanza, err)
	}
	if !reflect.DeepEqual(p.Modules, want) {
		t.Errorf("profile modules %v, want %v", p.Modules, want)
	}
}

// TestNVSMIRefused: what would make a wrong map, or is not the driver's report, is
// refused naming the line; a GPU whose Module Id is N/A, or "Module ID" in the older
// spelling, is read as the driver gives it.
func TestNVSMIRefused(t *testing.T) {
	gpu := func(bdf, body string) string { return "GPU " + bdf + "\n" + body }
	pciID := func(bdf string) string { return "    PCI\n        Bus Id                            : " + bdf + "\n" }
	mod := func(v string) string {
		return "    Platform Info\n        Module Id                         : " + v + "\n"
	}
	for _, c := range []struct{ text, want string }{
		{"Attached GPUs : 2\n" + gpu("00000000:1B:00.0", mod("1")), "line 1 says 2 GPUs attached, 1 sections follow"},
		{gpu("00000000:1B:00.0", pciID("00000000:1C:00.0")), "line 3: Bus Id 0000:1c:00.0 in the section of GPU 0000:1b:00.0 (line 1)"},
		{gpu("00000000:1B:00.0", mod("1")+mod("2")), "line 5: GPU 0000:1b:00.0: a second Module Id (the first on line 3)"},
		{gpu("00000000:1B:00.0", mod("one")), `line 3: GPU 0000:1b:00.0: Module Id "one": not a number`},
		{gpu("00000000:1B:00.0", mod("-1")), "not a number"},
		{gpu("00010000:1B:00.0", ""), "domain not a 16-bit PCI domain"},
		{gpu("0000:1B:00", ""), "line 1: pci address"},
		{"Attached GPUs : x\n", `Attached GPUs "x": not a count`},
		{"Driver Version : 580\n", "no GPU section"},
		{"", "no GPU section"},
	} {
		_, err := ParseNVSMI([]byte(c.text))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want %q", c.text, err, c.want)
		}
	}
	gpus, err := ParseNVSMI([]byte(gpu("00000000:1B:00.0", mod("N/A")+pciID("00000000:1B:00.0")) +
		gpu("00000000:43:00.0", "    Module ID                             : 3\n") + gpu("00000000:52:00.0", "")))
	if err != nil {
		t.Fatal(err)
	}
	if len(gpus) != 3 || gpus[0].Module != 0 || gpus[1].Module != 3 || gpus[2].Module != 0 {
		t.Fatalf("%+v", gpus)
	}
	stanza, unknown, err := ModulesStanza(gpus, "x")
	if err != nil || len(unknown) != 2 || unknown[0].String() != "0000:1b:00.0" || !strings.Contains(string(stanza), "# GPU 0000:52:00.0: no Module ID reported") {
		t.Errorf("%s %v %v", stanza, unknown, err)
	}
	two := []NVSMIGPU{{Addr: pci.Address{Bus: 0x1b}, Module: 1, Line: 1}, {Addr: pci.Address{Bus: 0x43}, Module: 1, Line: 9}}
	if _, _, err := ModulesStanza(two, "x"); err == nil || !strings.Contains(err.Error(), "Module ID 1: GPUs 0000:1b:00.0 (line 1) and 0000:43:00.0 (line 9)") {
		t.Errorf("a module two GPUs give: %v", err)
	}
	two[1].Addr, two[1].Module = two[0].Addr, 2
	if _, _, err := ModulesStanza(two, "x"); err == nil || !strings.Contains(err.Error(), "two sections") {
		t.Errorf("an address given twice: %v", err)
	}
}

// FuzzParseNVSMI: any text is read or refused without panicking, and a stanza made of
// what was read is one ParseProfile accepts, with the same map.
func FuzzParseNVSMI(f *testing.F) {
	b, err := os.ReadFile(filepath.FromSlash(nvsmiSample))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Add([]byte("GPU 00000000:1B:00.0\n    Module Id : 3\n"))
	f.Add([]byte("Attached GPUs : 1\nGPU 0000:01:00.0\n    Module ID : N/A\n    Bus Id : 00000000:01:00.0\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		gpus, err := ParseNVSMI(b)
		if err != nil {
			return
		}
		stanza, unknown, err := ModulesStanza(gpus, string(b))
		if err != nil {
			return
		}
		p, err := ParseProfile("fuzz.yaml", append([]byte("name: fuzz\n"), append(stanza, "rules: [{name: a, role: gpu, match: {vendor: 0x10de}}]\n"...)...))
		if err != nil {
			t.Fatalf("stanza refused: %v\n%s", err, stanza)
		}
		if len(p.Modules)+len(unknown) != len(gpus) {
			t.Fatalf("%d modules and %d unknown of %d GPUs", len(p.Modules), len(unknown), len(gpus))
		}
		for _, g := range gpus {
			if g.Module != 0 && p.Modules[g.Addr.String()] != g.Module {
				t.Fatalf("GPU %s: module %d, the profile %d", g.Addr, g.Module, p.Modules[g.Addr.String()])
			}
		}
	})
}
