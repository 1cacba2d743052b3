package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci/pcitest"
)

// inspect on hostile input: nothing readable exits 2 with one line on stderr; a tree
// read with problems is shown, problems and all, and exits 1.

func writeFile(t *testing.T, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestInspectDumpUnreadable(t *testing.T) {
	big := filepath.Join(t.TempDir(), "big.txt")
	f, err := os.Create(big)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("0000:00:01.0 PCI bridge\n00: 86 80 2a 35\n")
	f.Truncate(64<<20 + 1)
	f.Close()
	for _, tc := range []struct {
		name, file, want string
	}{
		{"empty", writeFile(t, "empty.txt", nil), "no PCI function"},
		{"garbage", writeFile(t, "garbage.txt", []byte("\x00\x01garbage\nnot a dump\n")), "no PCI function"},
		{"lspci without -x", writeFile(t, "plain.txt", []byte("0000:00:01.0 PCI bridge: Intel\n0000:01:00.0 Ethernet controller: Broadcom\n")), "no config space"},
		{"past 64 MiB", big, "larger than 64 MiB"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, args := range [][]string{{"--lspci-dump", tc.file}, {"--lspci-dump", tc.file, "--json"}} {
				rc, out, errs := inspect(args...)
				if rc != 2 || out != "" {
					t.Errorf("%v: rc %d stdout %q", args, rc, out)
				}
				if strings.Count(errs, "\n") != 1 || !strings.HasPrefix(errs, "passage inspect: ") || !strings.Contains(errs, tc.want) {
					t.Errorf("%v: stderr %q, want one line with %q", args, errs, tc.want)
				}
			}
		})
	}
}

func b300Dump(t *testing.T) (string, *pcitest.Node) {
	t.Helper()
	n := pcitest.New(t, pcitest.B300())
	lspci, err := exec.LookPath("lspci")
	if err != nil {
		t.Fatalf("lspci not found (install pciutils): %v", err)
	}
	out, err := exec.Command(lspci, "-D", "-xxxx", "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath()).Output()
	if err != nil {
		t.Fatal(err)
	}
	return string(out), n
}

func TestInspectDumpCutInsideFunction(t *testing.T) {
	dump, n := b300Dump(t)
	gpu := n.Addr("gpu3").String()
	// Drop the GPU's 0x30 line (the capability pointer's).
	start := strings.Index(dump, "\n"+gpu+" ")
	if start < 0 {
		t.Fatalf("%s not in the dump", gpu)
	}
	at := start + strings.Index(dump[start:], "\n30: ")
	end := at + 1 + strings.Index(dump[at+1:], "\n")
	line := strings.Count(dump[:at+1], "\n") + 1
	file := writeFile(t, "cut.txt", []byte(dump[:at+1]+dump[end+1:]))

	rc, out, errs := inspect("--lspci-dump", file)
	if rc != 1 {
		t.Errorf("rc %d, want 1", rc)
	}
	want := fmt.Sprintf("! dump line %d: offset 0x40 where 0x30 was due", line)
	if !strings.Contains(out, want) {
		t.Errorf("tree lacks %q", want)
	}
	// The rest of the tree is shown.
	if got := strings.Count(out, "\n"); got < 134+10 {
		t.Errorf("%d lines", got)
	}
	if !strings.Contains(errs, "passage inspect: ") || !strings.Contains(errs, "problem") {
		t.Errorf("stderr %q", errs)
	}

	rc, out, _ = inspect("--lspci-dump", file, "--json")
	if rc != 1 {
		t.Errorf("--json: rc %d, want 1", rc)
	}
	doc := decodeJSON(t, out)
	found := false
	for _, d := range doc.Devices {
		if d.BDF == gpu {
			found = len(d.Problems) > 0 && strings.Contains(strings.Join(d.Problems, "\n"), "offset 0x40 where 0x30 was due")
		}
	}
	if len(doc.Devices) != 134 || !found {
		t.Errorf("--json: %d devices, problem on %s %v", len(doc.Devices), gpu, found)
	}
}

func TestInspectDumpHexOutsideFunction(t *testing.T) {
	dump, _ := b300Dump(t)
	// A blank line inside the first function's block.
	at := strings.Index(dump, "\n40: ")
	file := writeFile(t, "split.txt", []byte(dump[:at+1]+"\n"+dump[at+1:]))
	rc, out, _ := inspect("--lspci-dump", file)
	if rc != 1 || !strings.Contains(out, "outside any function") {
		t.Errorf("rc %d, tree problem shown %v", rc, strings.Contains(out, "outside any function"))
	}
}

// TestInspectLiveConfigAllOnes: a function that stopped answering is named for what it
// is, and inspect does not exit 0 on it.
func TestInspectLiveConfigAllOnes(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	cfg := filepath.Join(n.Root, "sys/bus/pci/devices", n.Addr("gpu-dsp2").String(), "config")
	if err := os.WriteFile(cfg, bytes.Repeat([]byte{0xff}, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	rc, out, errs := inspect("--root", n.Root)
	if rc != 1 || !strings.Contains(out, "! config space reads all ones: the function does not answer (removed, or in reset)") {
		t.Errorf("rc %d, stderr %q", rc, errs)
	}
	if strings.Contains(out, "unaligned pointer") {
		t.Error("the all-ones capability pointer reported as a finding of its own")
	}
}

// TestInspectDumpUnknownNotNone: what a dump does not hold is shown as unknown, never as
// absent: lspci -xxx stops before the extended capabilities, so an endpoint's ATS and a
// port's ACS are unknown, and a function whose capability pointer line is missing is not
// known to be PCI Express or not.
func TestInspectDumpUnknownNotNone(t *testing.T) {
	n := pcitest.New(t, pcitest.B300())
	out, err := exec.Command("lspci", "-D", "-xxx", "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath()).Output()
	if err != nil {
		t.Fatal(err)
	}
	rc, tree, _ := inspect("--lspci-dump", writeFile(t, "xxx.txt", out))
	gpu, rp := n.Addr("gpu0").String(), n.Addr("rp0").String()
	for _, l := range strings.Split(tree, "\n") {
		switch {
		case strings.Contains(l, gpu+"  ") && (strings.Contains(l, "ATS none") || !strings.Contains(l, "ATS unknown")):
			t.Errorf("gpu0: %q", l)
		case strings.Contains(l, rp+"-") && !strings.Contains(l, "ACS unknown"):
			t.Errorf("rp0: %q", l)
		}
	}
	if rc != 1 {
		t.Errorf("rc %d", rc)
	}

	dump, _ := b300Dump(t)
	start := strings.Index(dump, "\n"+rp+" ")
	at := start + strings.Index(dump[start:], "\n30: ")
	end := at + 1 + strings.Index(dump[at+1:], "\n")
	_, tree, _ = inspect("--lspci-dump", writeFile(t, "cut.txt", []byte(dump[:at+1]+dump[end+1:])))
	for _, l := range strings.Split(tree, "\n") {
		if strings.Contains(l, rp+"-") && !strings.Contains(l, "Express unknown") {
			t.Errorf("rp0 without its capability pointer: %q", l)
		}
	}
}
