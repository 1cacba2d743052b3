package pci_test

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// lspciView is what lspci -vvv says about one function, in lspci's own words.
type lspciView struct {
	port           string // "Root Port", "Endpoint", ...; "" without an Express capability
	lnkCap, lnkSta string // "32GT/s x16"
	acsCap, acsCtl string
	ats            bool
	atsCtl         string // "Enable+" / "Enable-"
}

var (
	reHeader  = regexp.MustCompile(`^([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) `)
	reExpress = regexp.MustCompile(`^\tCapabilities: \[[0-9a-f]+\] Express \(v\d+\) (.+?)(?: \(Slot[+-]\))?, (?:MSI|IntMsgNum) `)
	reLnkCap  = regexp.MustCompile(`^\t\tLnkCap:\tPort #\d+, Speed ([^,]+), Width x(\d+),`)
	reLnkSta  = regexp.MustCompile(`^\t\tLnkSta:\tSpeed ([^ ,]+)(?: \([a-z]+\))?, Width x(\d+)`)
	reACSCap  = regexp.MustCompile(`^\t\tACSCap:\t(.*)$`)
	reACSCtl  = regexp.MustCompile(`^\t\tACSCtl:\t(.*)$`)
	reATS     = regexp.MustCompile(`^\tCapabilities: \[[0-9a-f]+ v\d+\] Address Translation Service \(ATS\)`)
	reATSCtl  = regexp.MustCompile(`^\t\tATSCtl:\t(Enable[+-])`)
)

// parseLspci reads lspci -D -vvv output into one view per function.
func parseLspci(t *testing.T, out []byte) map[string]*lspciView {
	t.Helper()
	views := map[string]*lspciView{}
	var cur *lspciView
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if m := reHeader.FindStringSubmatch(l); m != nil {
			cur = &lspciView{}
			views[m[1]] = cur
			continue
		}
		if cur == nil {
			continue
		}
		if m := reExpress.FindStringSubmatch(l); m != nil {
			cur.port = m[1]
		} else if m := reLnkCap.FindStringSubmatch(l); m != nil {
			cur.lnkCap = m[1] + " x" + m[2]
		} else if m := reLnkSta.FindStringSubmatch(l); m != nil {
			cur.lnkSta = m[1] + " x" + m[2]
		} else if m := reACSCap.FindStringSubmatch(l); m != nil {
			cur.acsCap = m[1]
		} else if m := reACSCtl.FindStringSubmatch(l); m != nil {
			cur.acsCtl = m[1]
		} else if reATS.MatchString(l) {
			cur.ats = true
		} else if m := reATSCtl.FindStringSubmatch(l); m != nil {
			cur.atsCtl = m[1]
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return views
}

// ourView renders our decoding in the same words.
func ourView(d *pci.Device) lspciView {
	var v lspciView
	if e := d.Express; e != nil {
		v.port = e.Type.String()
		if e.HasLink {
			v.lnkCap = fmt.Sprintf("%s x%d", e.MaxSpeed, e.MaxWidth)
			v.lnkSta = fmt.Sprintf("%s x%d", e.Speed, e.Width)
		}
	}
	if d.ACS != nil {
		v.acsCap, v.acsCtl = d.ACS.Cap.Lspci(), d.ACS.Ctl.Lspci()
	}
	if d.ATS != nil {
		v.ats = true
		v.atsCtl = "Enable-"
		if d.ATS.Enable {
			v.atsCtl = "Enable+"
		}
	}
	return v
}

// lspciPath finds lspci. The oracle is the point of these tests: a missing lspci is a
// failure (make deps installs pciutils), never a skip.
func lspciPath(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("lspci")
	if err != nil {
		t.Fatalf("lspci not found (install pciutils; make deps does): %v", err)
	}
	return p
}

func runLspci(t *testing.T, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(lspciPath(t), args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("lspci %s: %v\n%s", strings.Join(args, " "), err, stderr.Bytes())
	}
	return out
}

// compareWithLspci checks every function of tree against lspci's view, both ways.
func compareWithLspci(t *testing.T, tree *pci.Tree, views map[string]*lspciView) {
	t.Helper()
	if len(tree.Devices) == 0 {
		t.Fatal("our tree is empty")
	}
	ours := map[string]bool{}
	checked := map[string]int{}
	for _, d := range tree.Devices {
		bdf := d.Addr.String()
		ours[bdf] = true
		lv, ok := views[bdf]
		if !ok {
			t.Errorf("%s: we see it, lspci does not", bdf)
			continue
		}
		ov := ourView(d)
		for _, f := range []struct{ name, ours, lspci string }{
			{"Express port type", ov.port, lv.port},
			{"LnkCap", ov.lnkCap, lv.lnkCap},
			{"LnkSta", ov.lnkSta, lv.lnkSta},
			{"ACSCap", ov.acsCap, lv.acsCap},
			{"ACSCtl", ov.acsCtl, lv.acsCtl},
			{"ATS", fmt.Sprint(ov.ats), fmt.Sprint(lv.ats)},
			{"ATSCtl", ov.atsCtl, lv.atsCtl},
		} {
			if f.ours != f.lspci {
				t.Errorf("%s %s: ours %q, lspci %q", bdf, f.name, f.ours, f.lspci)
			}
			if f.lspci != "" && f.lspci != "false" {
				checked[f.name]++
			}
		}
	}
	for bdf := range views {
		if !ours[bdf] {
			t.Errorf("%s: lspci sees it, we do not", bdf)
		}
	}
	t.Logf("%d functions; non-empty fields compared: %v", len(tree.Devices), checked)
}

func TestLspciOracleReferenceTrees(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec pcitest.Spec
		// want are fields every reference node must exercise, so a parser that matched
		// nothing cannot pass.
		want []string
	}{
		{"B300", pcitest.B300(), []string{"Express port type", "LnkCap", "LnkSta", "ACSCap", "ACSCtl", "ATS", "ATSCtl"}},
		{"B200", pcitest.B200(), []string{"Express port type", "LnkCap", "LnkSta", "ACSCap", "ACSCtl", "ATS", "ATSCtl"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := pcitest.New(t, tc.spec)
			tree, err := pci.Scan(n.Root)
			if err != nil {
				t.Fatal(err)
			}
			if err := tree.Err(); err != nil {
				t.Fatalf("reference tree has problems: %v", err)
			}
			out := runLspci(t, "-D", "-vvv", "-A", "linux-sysfs", "-O", "sysfs.path="+n.SysfsPath())
			views := parseLspci(t, out)
			compareWithLspci(t, tree, views)
			for _, f := range tc.want {
				found := false
				for _, v := range views {
					if (f == "ACSCap" && v.acsCap != "") || (f == "ACSCtl" && v.acsCtl != "") || (f == "ATS" && v.ats) ||
						(f == "ATSCtl" && v.atsCtl != "") || (f == "LnkCap" && v.lnkCap != "") || (f == "LnkSta" && v.lnkSta != "") ||
						(f == "Express port type" && v.port != "") {
						found = true
					}
				}
				if !found {
					t.Errorf("lspci output parsed to no %s at all", f)
				}
			}
			// The Gen6 hop must be there in lspci's words too.
			gpu := n.Addr("gpu0").String()
			if tc.name == "B300" && views[gpu].lnkSta != "64GT/s x16" {
				t.Errorf("gpu0 %s LnkSta per lspci %q, want 64GT/s x16", gpu, views[gpu].lnkSta)
			}
		})
	}
}

// repoRoot walks up from the test's directory to the module root.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		up := filepath.Dir(dir)
		if up == dir {
			t.Fatal("go.mod not found above the test directory")
		}
		dir = up
	}
}

func realworldCapFiles(t *testing.T) []string {
	t.Helper()
	dir := filepath.Join(repoRoot(t), "testdata", "realworld")
	files, err := filepath.Glob(filepath.Join(dir, "cap-*.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("%s holds no cap-*.txt", dir)
	}
	sort.Strings(files)
	return files
}

func TestLspciOracleRealWorldDumps(t *testing.T) {
	for _, f := range realworldCapFiles(t) {
		t.Run(filepath.Base(f), func(t *testing.T) {
			tree, err := pci.ReadDump(f)
			if err != nil {
				t.Fatal(err)
			}
			out := runLspci(t, "-D", "-F", f, "-vvv")
			compareWithLspci(t, tree, parseLspci(t, out))
		})
	}
}

// TestLspciOracleLiveIDs scans this machine's /sys read-only and checks every address and
// vendor:device against lspci -nD.
func TestLspciOracleLiveIDs(t *testing.T) {
	out := runLspci(t, "-nD")
	want := map[string]string{}
	re := regexp.MustCompile(`^([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) [0-9a-f]{4}: ([0-9a-f]{4}:[0-9a-f]{4})`)
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if l == "" {
			continue
		}
		m := re.FindStringSubmatch(l)
		if m == nil {
			t.Fatalf("lspci -nD line not understood: %q", l)
		}
		want[m[1]] = m[2]
	}
	tree, err := pci.Scan("/")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, d := range tree.Devices {
		got[d.Addr.String()] = d.IDs()
	}
	for bdf, ids := range want {
		if got[bdf] != ids {
			t.Errorf("%s: lspci %s, ours %q", bdf, ids, got[bdf])
		}
	}
	for bdf := range got {
		if _, ok := want[bdf]; !ok {
			t.Errorf("%s: we see it, lspci -nD does not", bdf)
		}
	}
	t.Logf("%d functions on this machine", len(want))
}
