package pci

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestCheckCPUList(t *testing.T) {
	for s, ok := range map[string]bool{
		"0": true, "0-63": true, "0-63,128-191": true, "0,2,4-7": true,
		"": false, "-1": false, "3-1": false, "0-63,32-40": false, "0,0": false, "a": false, "0-": false, "01": false,
		"0-63,,64": false, "0-99999999": false, "0 - 3": false,
		"0-+63,64-0127": false, "0-+63": false, "64-0127": false, "+1": false, "0-00": false,
	} {
		if err := CheckCPUList(s); (err == nil) != ok {
			t.Errorf("CheckCPUList(%q) = %v, want ok %v", s, err, ok)
		}
	}
}

func FuzzCheckCPUList(f *testing.F) {
	for _, s := range []string{"0-63,128-191", "0", "3-1", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if CheckCPUList(s) != nil {
			return
		}
		// Accepted lists are digits, commas and dashes only: nothing else reaches a
		// libvirt cpuset.
		if strings.Trim(s, "0123456789,-") != "" {
			t.Errorf("accepted %q", s)
		}
		// and each number as the kernel writes it: the list reads back the same.
		var parts []string
		for _, p := range strings.Split(s, ",") {
			lo, hi, isRange := strings.Cut(p, "-")
			a, _ := strconv.Atoi(lo)
			q := strconv.Itoa(a)
			if isRange {
				b, _ := strconv.Atoi(hi)
				q += "-" + strconv.Itoa(b)
			}
			parts = append(parts, q)
		}
		if c := strings.Join(parts, ","); c != s {
			t.Errorf("accepted %q, which reads as %q", s, c)
		}
	})
}

func TestNodeCPUs(t *testing.T) {
	root := t.TempDir()
	if got, err := NodeCPUs(root); err != nil || len(got) != 0 {
		t.Fatalf("no node directory: %v %v", got, err)
	}
	write := func(name, body string) {
		p := filepath.Join(root, "sys/devices/system/node", name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("node0/cpulist", "0-63,128-191\n")
	write("node1/cpulist", "64-127,192-255\n")
	write("node2/cpulist", "\n") // memory only
	write("possible", "0-2\n")
	got, err := NodeCPUs(root)
	if err != nil || len(got) != 2 || got[0] != "0-63,128-191" || got[1] != "64-127,192-255" {
		t.Fatalf("NodeCPUs = %v, %v", got, err)
	}
	write("node3/cpulist", "0-3;rm -rf /\n")
	if _, err := NodeCPUs(root); err == nil || !strings.Contains(err.Error(), "node3/cpulist") {
		t.Errorf("a list that is no cpulist: %v", err)
	}
	os.Remove(filepath.Join(root, "sys/devices/system/node/node3/cpulist"))
	if err := os.Symlink("/proc/self/environ", filepath.Join(root, "sys/devices/system/node/node3/cpulist")); err != nil {
		t.Fatal(err)
	}
	if _, err := NodeCPUs(root); err == nil {
		t.Error("a cpulist that links out of the root was read")
	}
}
