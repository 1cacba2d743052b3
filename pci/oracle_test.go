package pci_test

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
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
	regions        string // "Region 1: Memory (64-bit, prefetchable) at 10000000000 [size=512G]; ..."
	// vpdName and vpdKeys are the Vital Product Data as lspci -vvv prints it from sysfs
	// vpd: "Product Name: N" and each read-only keyword but RV ("VA=MLX:..."); vpdSum is
	// what it says of the RV checksum ("checksum good").
	vpdName string
	vpdKeys []string
	vpdSum  string
}

// vpd is the VPD in one string, keywords in order: "N; PN=...; VA=...".
func (v *lspciView) vpd() string {
	keys := append([]string(nil), v.vpdKeys...)
	sort.Strings(keys)
	return strings.Join(append([]string{v.vpdName}, keys...), "; ")
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
	// ls-vpd.c: "\t\tProduct Name: ...", then "\t\t\t[PN] Part number: ...", "[RV]
	// Reserved: checksum good, 0 byte(s) reserved", and "\t\tEnd".
	reVPDName = regexp.MustCompile(`^\t\tProduct Name: (.*)$`)
	reVPDKey  = regexp.MustCompile(`^\t\t\t\[([0-9A-Z]{2})\] [^:]+: (.*)$`)
	// show_bases in lspci.c: "Region 1: Memory at 3f000000000 (64-bit, prefetchable)
	// [size=64G]", "Region 5: I/O ports at 2000 [disabled] [size=128]".
	reRegion = regexp.MustCompile(`^\tRegion (\d): (?:Memory at ([0-9a-f]+) \(((?:32|64)-bit, (?:non-)?prefetchable)\)|I/O ports at ([0-9a-f]+))((?: \[[a-z]+\])*)(?: \[size=(\d+[KMGT]?)\])?$`)
)

// parseLspci reads lspci -D -vvv output into one view per function.
func parseLspci(t *testing.T, out []byte) map[string]*lspciView {
	t.Helper()
	views := map[string]*lspciView{}
	var cur *lspciView
	inVPD := false
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
		if strings.HasPrefix(l, "\tCapabilities: ") {
			inVPD = strings.HasSuffix(l, " Vital Product Data")
		}
		if inVPD {
			if m := reVPDName.FindStringSubmatch(l); m != nil {
				cur.vpdName = m[1]
			} else if m := reVPDKey.FindStringSubmatch(l); m != nil && m[1] == "RV" {
				cur.vpdSum, _, _ = strings.Cut(m[2], ",")
			} else if m != nil {
				cur.vpdKeys = append(cur.vpdKeys, m[1]+"="+m[2])
			}
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
		} else if strings.HasPrefix(l, "\tRegion ") {
			m := reRegion.FindStringSubmatch(l)
			if m == nil {
				t.Fatalf("lspci Region line not understood: %q", l)
			}
			kind, base := "I/O ports", m[4]
			if m[2] != "" {
				kind, base = "Memory ("+m[3]+")", m[2]
			}
			r := fmt.Sprintf("Region %s: %s at %s", m[1], kind, base)
			if m[6] != "" {
				r += " [size=" + m[6] + "]"
			}
			if cur.regions != "" {
				cur.regions += "; "
			}
			cur.regions += r
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
	var rs []string
	for _, b := range d.BARs {
		r := fmt.Sprintf("Region %d: %s at %x", b.Index, b.Kind(), b.Base)
		// lspci sizes a region only where the kernel assigned it (sysfs_get_resources
		// in lib/sysfs.c takes the size from a line whose start is not 0).
		if b.Size != 0 && b.Base != 0 {
			r += " [size=" + lspciSize(b.Size) + "]"
		}
		rs = append(rs, r)
	}
	v.regions = strings.Join(rs, "; ")
	if d.VPD != nil {
		v.vpdName = d.VPD.Name
		for k, val := range d.VPD.Keywords {
			v.vpdKeys = append(v.vpdKeys, k+"="+val)
		}
	}
	return v
}

// lspciSize is show_size in lspci.c: the largest of K, M, G, T the size is a whole
// multiple of.
func lspciSize(x uint64) string {
	suffix := []string{"", "K", "M", "G", "T"}
	i := 0
	for ; i < len(suffix)-1 && x%1024 == 0; i++ {
		x /= 1024
	}
	return fmt.Sprintf("%d%s", x, suffix[i])
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
			{"Regions", ov.regions, lv.regions},
			{"VPD", ov.vpd(), lv.vpd()},
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
		{"B300", pcitest.B300(), []string{"Express port type", "LnkCap", "LnkSta", "ACSCap", "ACSCtl", "ATS", "ATSCtl", "Regions", "VPD"}},
		{"B300 NVSwitch bridge", pcitest.WithNVSwitchBridge(pcitest.B300()), []string{"Express port type", "Regions", "VPD"}},
		{"B200", pcitest.B200(), []string{"Express port type", "LnkCap", "LnkSta", "ACSCap", "ACSCtl", "ATS", "ATSCtl", "Regions"}},
		{"SR-IOV", pcitest.SRIOVNode(2, 3, 2), []string{"Express port type", "LnkCap", "LnkSta", "ACSCap", "ACSCtl", "ATS", "ATSCtl", "Regions"}},
		{"BAR kinds", barKinds(), []string{"Express port type", "Regions"}},
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
						(f == "Express port type" && v.port != "") || (f == "Regions" && v.regions != "") || (f == "VPD" && v.vpd() != "") {
						found = true
					}
				}
				if !found {
					t.Errorf("lspci output parsed to no %s at all", f)
				}
			}
			// Every VPD the trees carry has its RV checksum right, as lspci reckons it.
			for bdf, v := range views {
				if v.vpdName != "" && v.vpdSum != "checksum good" {
					t.Errorf("%s: lspci says of the VPD's RV: %q", bdf, v.vpdSum)
				}
			}
			if tc.name == "B300 NVSwitch bridge" {
				// The bridge's marker, where lspci -vvv shows it (and where the FM
				// service's prelaunch script greps for SMDL=SW_MNG).
				for _, name := range pcitest.NVSwitchBridgeFns {
					bdf := n.Addr(name).String()
					marked := slices.Contains(views[bdf].vpdKeys, "VA="+pcitest.SWMngVA)
					if want := strings.HasPrefix(name, "nvsw-lpf"); marked != want {
						t.Errorf("%s %s: lspci shows VA SMDL=SW_MNG %v, want %v (%v)", name, bdf, marked, want, views[bdf].vpdKeys)
					}
				}
			}
			// The Gen6 hop must be there in lspci's words too.
			if tc.name != "B300" {
				return
			}
			gpu := n.Addr("gpu0").String()
			if views[gpu].lnkSta != "64GT/s x16" {
				t.Errorf("gpu0 %s LnkSta per lspci %q, want 64GT/s x16", gpu, views[gpu].lnkSta)
			}
			// And the B300's frame-buffer BAR, as lspci sizes it.
			if !strings.Contains(views[gpu].regions, "Region 1: Memory (64-bit, prefetchable) at ") || !strings.Contains(views[gpu].regions, "[size=512G]") {
				t.Errorf("gpu0 %s regions per lspci %q, want a 64-bit prefetchable BAR1 of 512G", gpu, views[gpu].regions)
			}
		})
	}
}

// barKinds is a node whose functions hold every kind of BAR lspci distinguishes: I/O,
// 32-bit and 64-bit memory, prefetchable or not, sizes from bytes to terabytes, and a
// bridge's own BARs (a type 1 header has two).
func barKinds() pcitest.Spec {
	return pcitest.Spec{Hosts: []pcitest.Host{{Fns: []pcitest.Fn{
		{Name: "rp", Dev: 1, Vendor: pcitest.VendorIntel, Device: pcitest.DevRootPort, Class: pcitest.ClassBridge, Port: pci.PortRootPort,
			BARs: []pcitest.BAR{{Index: 0, Size: 1 << 20, Is64: true}}, Below: []pcitest.Fn{{
				Name: "ep", Vendor: pcitest.VendorIntel, Device: 0x1234, Class: 0x120000, Port: pci.PortEndpoint, BARs: []pcitest.BAR{
					{Index: 0, Size: 128, IO: true},
					{Index: 1, Size: 4 << 10},
					{Index: 2, Size: 16 << 20, Prefetch: true},
					{Index: 3, Size: 2 << 40, Is64: true, Prefetch: true},
					{Index: 5, Size: 2 << 10},
				}}}},
	}}}}
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
