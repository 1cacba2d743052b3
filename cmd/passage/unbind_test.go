package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/vfiobind"
)

// unbindTree is the B300 reference with unit 3's functions on vfio-pci, as after a boot.
func unbindTree(t *testing.T) *pcitest.Node {
	t.Helper()
	spec := pcitest.B300()
	bound := map[string]bool{"gpu3": true, "nic3.0": true, "nic3.1": true, "nvme3": true}
	var walk func(fns []pcitest.Fn)
	walk = func(fns []pcitest.Fn) {
		for i := range fns {
			if bound[fns[i].Name] {
				fns[i].Driver = vfiobind.VFIODriver
			}
			walk(fns[i].Below)
		}
	}
	for h := range spec.Hosts {
		walk(spec.Hosts[h].Fns)
	}
	n := pcitest.New(t, spec)
	// A node's /proc, with no process holding a vfio device: unbind refuses where it
	// cannot tell.
	if err := os.MkdirAll(filepath.Join(n.Root, "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestUnbindBDFHostDevice(t *testing.T) {
	n := unbindTree(t)
	var out, errb bytes.Buffer
	mgmt := n.Addr("mgmt0").String()
	if rc := cmdUnbind([]string{"--root", n.Root, "--bdf", mgmt}, &out, &errb); rc != 0 {
		t.Fatalf("rc %d: %s", rc, errb.String())
	}
	if got := strings.TrimSpace(out.String()); !strings.HasPrefix(got, mgmt+" group ") || !strings.Contains(got, "bnxt_en -> bnxt_en") {
		t.Errorf("output %q", got)
	}
}

func TestUnbindRefuses(t *testing.T) {
	n := unbindTree(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "exactly one of --unit or --bdf"},
		{[]string{"--unit", "3", "--bdf", "00:01.0"}, "exactly one of --unit or --bdf"},
		{[]string{"--unit", "9"}, "no such unit"},
		{[]string{"--unit", "three"}, `unit "three": want units like gpu0,gpu1`},
		{[]string{"--unit", "3", "--profile", "no-such-profile"}, "no-such-profile"},
		{[]string{"--bdf", "zz:00.0"}, "bad bus"},
		{[]string{"--bdf", "0000:fe:00.0"}, "no such function"},
		// Half of the CX-8's group: PF1 would stay on vfio-pci.
		{[]string{"--bdf", n.Addr("nic3.0").String()}, n.Addr("nic3.1").String() + " also on vfio-pci"},
		{[]string{"--unit", "3", "extra"}, "unexpected argument"},
	} {
		var out, errb bytes.Buffer
		args := append([]string{"--root", n.Root}, tc.args...)
		if rc := cmdUnbind(args, &out, &errb); rc != 2 || !strings.Contains(errb.String(), tc.want) {
			t.Errorf("%v: rc %d stderr %q, want 2 and %q", tc.args, rc, errb.String(), tc.want)
		}
		if out.Len() != 0 {
			t.Errorf("%v: output on refusal: %q", tc.args, out.String())
		}
	}
	var errb bytes.Buffer
	if rc := cmdUnbind([]string{"--root", t.TempDir(), "--unit", "0"}, &bytes.Buffer{}, &errb); rc != 2 || !strings.Contains(errb.String(), "pci scan") {
		t.Errorf("empty root: rc %d %q", rc, errb.String())
	}
}
