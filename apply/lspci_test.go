package apply

import (
	"bufio"
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"testing"
)

// lspciACSCtl runs the real lspci against the tree (as an operator would on the node)
// and returns its full text and each function's ACSCtl line ("" when it has none).
func lspciACSCtl(t *testing.T, sysfsPath string) (string, map[string]string) {
	t.Helper()
	bin, err := exec.LookPath("lspci")
	if err != nil {
		t.Fatalf("lspci is needed for this test (apt-get install pciutils): %v", err)
	}
	cmd := exec.Command(bin, "-D", "-vvv", "-A", "linux-sysfs", "-O", "sysfs.path="+sysfsPath)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr // libkmod complaints: the tree has no modules
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("lspci: %v: %s", err, stderr.String())
	}
	ctl := map[string]string{}
	cur := ""
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if line != "" && line[0] != '\t' && line[0] != ' ' {
			cur = strings.Fields(line)[0]
			ctl[cur] = ""
			continue
		}
		if s, ok := strings.CutPrefix(strings.TrimSpace(line), "ACSCtl:"); ok && cur != "" {
			ctl[cur] = strings.TrimSpace(s)
		}
	}
	return string(out), ctl
}

// On the reference B300 tree, after apply, lspci shows DirectTrans+ in ACSCtl on exactly
// the eight NIC-side downstream ports of the CX-8 switches, and everything else it prints
// is as it was.
func TestApplyLspci(t *testing.T) {
	b := newB300(t, nil)
	textBefore, before := lspciACSCtl(t, b.node.SysfsPath())
	if len(before) != len(b.tree.Devices) {
		t.Fatalf("lspci lists %d functions, the scan %d", len(before), len(b.tree.Devices))
	}
	withACS := 0
	for bdf, c := range before {
		if c != "" {
			withACS++
		}
		if strings.Contains(c, "DirectTrans+") {
			t.Fatalf("%s has DirectTrans+ before apply: %s", bdf, c)
		}
	}
	if withACS < 8*5 {
		t.Fatalf("lspci decoded ACSCtl on %d functions only", withACS)
	}

	rep := run(t, newFaultIO(b.node.Root), b.plan(t), Options{})
	if rep.Failed() || rep.Writes() != 8 {
		t.Fatalf("apply: failed=%v writes=%d", rep.Failed(), rep.Writes())
	}
	textAfter, after := lspciACSCtl(t, b.node.SysfsPath())

	nic := map[string]bool{}
	for i := 0; i < 8; i++ {
		nic[b.node.Addr(fmt.Sprintf("cx-dsp-nic%d", i)).String()] = true
	}
	var dt []string
	for bdf, c := range after {
		if strings.Contains(c, "DirectTrans+") {
			dt = append(dt, bdf)
		}
		if nic[bdf] {
			if want := "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+"; c != want {
				t.Errorf("%s ACSCtl: %s, want %s", bdf, c, want)
			}
		} else if c != before[bdf] {
			t.Errorf("%s ACSCtl changed: %q -> %q", bdf, before[bdf], c)
		}
	}
	if len(dt) != 8 {
		t.Errorf("DirectTrans+ on %d functions %v, want the 8 NIC-side ports", len(dt), dt)
	}

	// Apart from the ACSCtl lines of those eight ports, lspci prints the same text.
	if a, b := dropACSCtl(textAfter, nic), dropACSCtl(textBefore, nic); a != b {
		t.Errorf("lspci output changed beyond the NIC ports' ACSCtl:\n%s", firstDiff(b, a))
	}
}

func dropACSCtl(text string, ports map[string]bool) string {
	var out []string
	cur := ""
	for _, l := range strings.Split(text, "\n") {
		if l != "" && l[0] != '\t' && l[0] != ' ' {
			cur = strings.Fields(l)[0]
		}
		if ports[cur] && strings.Contains(l, "ACSCtl:") {
			continue
		}
		out = append(out, l)
	}
	return strings.Join(out, "\n")
}

func firstDiff(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := 0; i < len(al) && i < len(bl); i++ {
		if al[i] != bl[i] {
			return fmt.Sprintf("line %d: %q -> %q", i+1, al[i], bl[i])
		}
	}
	return fmt.Sprintf("%d lines -> %d lines", len(al), len(bl))
}
