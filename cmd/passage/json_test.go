package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind"
)

var (
	fullBDF  = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]$`)
	shortBDF = regexp.MustCompile(`^[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]$`)
	register = regexp.MustCompile(`^0x[0-9a-f]{4}$`)
)

// addressKeys hold one address; addressLists hold a list of them.
var (
	addressKeys  = map[string]bool{"addr": true, "bdf": true, "gpu": true, "port": true, "host": true}
	addressLists = map[string]bool{"nics": true, "nvme": true, "data_direct": true, "bridges": true, "addrs": true}
	registerKeys = map[string]bool{"mask": true, "flags": true, "before": true, "target": true, "after": true}
)

// walkJSON checks every value of a JSON document: addresses are BDF strings
// ("0000:f2:00.0"), never objects or numbers; ACS registers in apply's changes are
// "0x005d" strings.
func walkJSON(t *testing.T, doc string, path string, v any, inACS bool) {
	t.Helper()
	switch x := v.(type) {
	case map[string]any:
		for _, k := range []string{"Domain", "Bus", "Device", "Function"} {
			if _, ok := x[k]; ok {
				t.Errorf("%s: %s: an address as a struct: %v", doc, path, x)
			}
		}
		for k, e := range x {
			p := path + "." + k
			switch {
			case addressKeys[k]:
				// "port" and "host" also name guest ports and host bridges ("rp0",
				// "pcie.0") and hold guest port objects: only a value that spells an
				// address must be a whole BDF, and no address is a number.
				switch a := e.(type) {
				case float64:
					t.Errorf("%s: %s = %v: an address as a number", doc, p, a)
				case string:
					if strings.Contains(a, ":") && !fullBDF.MatchString(a) {
						t.Errorf("%s: %s = %q, want a BDF string", doc, p, a)
					}
				}
			case addressLists[k]:
				if l, ok := e.([]any); ok {
					for i, a := range l {
						if s, ok := a.(string); !ok || !fullBDF.MatchString(s) {
							t.Errorf("%s: %s[%d] = %#v, want a BDF string", doc, p, i, a)
						}
					}
				}
			case inACS && registerKeys[k]:
				if s, ok := e.(string); !ok || !register.MatchString(s) {
					t.Errorf("%s: %s = %#v, want a register as 0xNNNN", doc, p, e)
				}
			}
			walkJSON(t, doc, p, e, inACS || k == "changes")
		}
	case []any:
		for i, e := range x {
			walkJSON(t, doc, fmt.Sprintf("%s[%d]", path, i), e, inACS)
		}
	case string:
		if shortBDF.MatchString(x) {
			t.Errorf("%s: %s = %q: an address without its domain", doc, path, x)
		}
	}
}

// TestJSONAddressesAreBDFs walks every JSON output of the commands that print one and
// finds addresses only as BDF strings.
func TestJSONAddressesAreBDFs(t *testing.T) {
	type output struct{ name, out string }
	var outs []output
	runJSON := func(name string, code int, out, errb *bytes.Buffer) {
		if errb.Len() > 0 || out.Len() == 0 {
			t.Fatalf("%s: exit %d: %s", name, code, errb.String())
		}
		outs = append(outs, output{name, out.String()})
	}
	root := pcitest.New(t, pcitest.B300()).Root
	for _, args := range [][]string{{"plan", "--unit", "0,1"}, {"plan", "--numa"}, {"inspect"}, {"apply", "--dry-run"}} {
		var out, errb bytes.Buffer
		full := append(append([]string{"--root", root}, args[1:]...), "--json")
		var code int
		switch args[0] {
		case "plan":
			code = cmdPlan(full, &out, &errb)
		case "inspect":
			code = cmdInspect(full, &out, &errb)
		case "apply":
			code = cmdApply(full, &out, &errb)
		}
		runJSON(strings.Join(args, " "), code, &out, &errb)
	}
	root2 := pcitest.New(t, pcitest.B300()).Root
	k := simulatedKernel(t, root2)
	var out, errb bytes.Buffer
	code := runApply([]string{"--root", root2, "--json", "--erase", "off"}, &out, &errb, applyEnv{
		sysfs: func(string) vfiobind.Sysfs { return k }, modules: func(string, string) vfiobind.ModuleLoader { return k }})
	runJSON("apply", code, &out, &errb)

	// unbind on the node apply just bound, through the same simulated kernel.
	out.Reset()
	errb.Reset()
	code = runUnbind([]string{"--root", root2, "--unit", "gpu3", "--json"}, &out, &errb, unbindEnv{sysfs: func(string) vfiobind.Sysfs { return k }})
	if code != 0 {
		t.Errorf("unbind: exit %d: %s", code, errb.String())
	}
	runJSON("unbind", code, &out, &errb)

	for _, o := range outs {
		var v any
		if err := json.Unmarshal([]byte(o.out), &v); err != nil {
			t.Fatalf("%s: %v", o.name, err)
		}
		walkJSON(t, o.name, "$", v, false)
	}
	if len(outs) != 6 {
		t.Errorf("%d outputs walked", len(outs))
	}
}
