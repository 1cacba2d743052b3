package main

// fabric check and the plugin's --fm- flags against fmstub.c, passage's stand-in for
// NVIDIA Fabric Manager behind libnvfm (package fabrictest): no FM is involved.

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/fabricmanager/fabrictest"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// b300Sets are the HGX B200/B300 partitions' module sets (FM User Guide).
var b300Sets = [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 2}, {3, 4}, {5, 6}, {7, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}

func TestFabricCheckCommand(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	uuid := manifesttest.NodeUUID(5)
	r := noderig.New(t, uuid, "b300-fm", 4, keys)
	for i := range r.M.Units {
		r.M.Units[i].ModuleID, r.M.Units[i].ModuleSource = i+1, "test"
	}
	r.M.NVLink = &manifest.NVLink{Partitions: b300Sets, Source: "FM User Guide, HGX B200/B300"}
	good := r.Sign(t)
	lib := fabrictest.Library(t)
	fm := fabrictest.New(t)
	check := func(args ...string) (int, string, string) {
		return runCmd(append(append([]string{"fabric", "check", "--pub", keys, "--node-uuid", uuid, "--fm-lib", lib}, args...), good)...)
	}

	code, out, errs := check()
	if code != 0 || !strings.Contains(out, "FM's 15 partitions and manifest generation 7 of node b300-fm agree: the 8 units' Module IDs are distinct and each in FM's list") ||
		!strings.Contains(out, "not checked: which GPU is which module") || !strings.Contains(out, "nor that FM runs FABRIC_MODE=1") {
		t.Fatalf("a matching manifest: exit %d\n%s%s", code, out, errs)
	}
	sock := filepath.Join(t.TempDir(), "fm.sock")
	fm.Update(t, func(s *fabrictest.State) { s.Listen = "unix:" + sock })
	if code, out, errs := check("--fm-socket", sock); code != 0 {
		t.Fatalf("--fm-socket: exit %d\n%s%s", code, out, errs)
	}
	if code, _, errs := check(); code != 1 || !strings.Contains(errs, "fm: connect: FM unreachable at 127.0.0.1:6666: connect FM_ST_CONNECTION_NOT_VALID (-9)") {
		t.Fatalf("FM on a socket, checked at its TCP default: exit %d %s", code, errs)
	}
	fm.Update(t, func(s *fabrictest.State) { s.Listen = "" })

	// gpu3's Module ID unknown, gpu5 given a module FM has no GPU of; the layout H100's pairs; FM with
	// a GPU's NVLinks down.
	r.M.Units[3].ModuleID, r.M.Units[3].ModuleSource = 0, ""
	r.M.Units[5].ModuleID = 9
	r.M.NVLink.Partitions = [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 3}, {2, 4}, {5, 7}, {6, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}
	r.Sign(t)
	fm.Update(t, func(s *fabrictest.State) { s.Links[8] = 17 })
	code, out, errs = check()
	want := []string{
		"unit gpu3: GPU Module ID unknown: no FM partition can be matched to it",
		"unit gpu5: module 9 is in none of FM's partitions",
		"FM partition 1 (modules 1,2,3,4,5,6,7,8) is degraded: module 8 has 17 of 18 NVLinks",
		"FM partition 3 (modules 5,6,7,8) is degraded: module 8 has 17 of 18 NVLinks",
		"FM partition 4 (modules 1,2): the manifest's NVLink layout has no such module set",
		"FM partition 7 (modules 7,8): the manifest's NVLink layout has no such module set",
		"FM partition 7 (modules 7,8) is degraded",
		"declares modules {1,3}: FM offers no partition of them",
		"declares modules {6,8}: FM offers no partition of them",
	}
	if code != 1 || !strings.Contains(errs, "13 mismatches between FM's 15 partitions and manifest generation 7") {
		t.Fatalf("a mismatching manifest: exit %d\n%s%s", code, out, errs)
	}
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("fabric check output lacks %q:\n%s", w, out)
		}
	}

	fm.Update(t, func(s *fabrictest.State) { s.Mode = "gone" })
	if code, out, errs := check(); code != 1 || out != "" || !strings.Contains(errs, "FM_ST_CONNECTION_NOT_VALID") {
		t.Errorf("FM gone: exit %d %q %s", code, out, errs)
	}
	fm.Update(t, func(s *fabrictest.State) { s.Mode = "serving" })
	fm.Restart(t, 5*time.Second)
	if code, _, errs := check(); code != 1 || !strings.Contains(errs, "FM_ST_NOT_CONFIGURED (-8): FM restarted and waits for its active partitions") {
		t.Errorf("FM waiting after a restart: exit %d %s", code, errs)
	}
	if code, _, errs := check("--fm-socket", sock, "--fm-address", "127.0.0.1:6666"); code != 2 || !strings.Contains(errs, "give one of --fm-socket and --fm-address") {
		t.Errorf("both addresses: exit %d %s", code, errs)
	}
	if code, _, _ := runCmd("fabric"); code != 2 {
		t.Errorf("fabric with no check: exit %d", code)
	}
	// A manifest of another node is refused before FM is asked.
	_, other := signedOther(t, keys)
	if code, _, errs := runCmd("fabric", "check", "--pub", keys, "--node-uuid", uuid, "--fm-lib", lib, other); code != 1 || !strings.Contains(errs, "REFUSED") {
		t.Errorf("another node's manifest: exit %d %s", code, errs)
	}
}

// signedOther is another node's manifest, its key enrolled in keys.
func signedOther(t *testing.T, keys string) (string, string) {
	r := noderig.New(t, manifesttest.NodeUUID(6), "b300-other", 6, keys)
	return r.Keys, r.Path
}

// TestFabricPluginFlags: any --fm- flag gives the plugin a Fabric (its ledger in the
// plugin directory); none, no FM; both addresses are refused.
func TestFabricPluginFlags(t *testing.T) {
	parse := func(extra ...string) (bool, int, string) {
		fs := flag.NewFlagSet("passage-dra plugin", flag.ContinueOnError)
		o := &options{}
		o.register(fs)
		var stderr bytes.Buffer
		fs.SetOutput(&stderr)
		args := append([]string{"--pub", t.TempDir(), "--manifest", "m.json", "--root", t.TempDir(), "--turnaround=false", "--plugin-dir", t.TempDir()}, extra...)
		cfg, _, code := pluginConfig(fs, args, o, &stderr)
		return cfg.Fabric != nil, code, stderr.String()
	}
	if on, code, msg := parse(); on || code != 0 {
		t.Fatalf("no --fm- flag: fabric %v, exit %d %s", on, code, msg)
	}
	for _, f := range [][]string{{"--fm-lib", "/usr/lib/libnvfm.so"}, {"--fm-socket", "/run/nvidia-fabricmanager/socket"}, {"--fm-address", "127.0.0.1:6666"}} {
		if on, code, msg := parse(f...); !on || code != 0 {
			t.Errorf("%v: fabric %v, exit %d %s", f, on, code, msg)
		}
	}
	if _, code, msg := parse("--fm-socket", "/s", "--fm-address", "127.0.0.1:6666"); code != 2 || !strings.Contains(msg, "give one of") {
		t.Errorf("both addresses: exit %d %s", code, msg)
	}
}

// TestFabricRestartBeyondReload (#55, 4): with --reload 90s, longer than the 60 s an FM
// started with --restart waits for its active partitions, the plugin's loop still
// hands FM its list within the window (8 s here, the stand-in's; FM's is 60 s): FM is
// read on a period of its own.
func TestFabricRestartBeyondReload(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	uuid := manifesttest.NodeUUID(5)
	r := noderig.New(t, uuid, "b300-fm", 4, keys)
	for i := range r.M.Units {
		r.M.Units[i].ModuleID, r.M.Units[i].ModuleSource = i+1, "test"
	}
	r.M.NVLink = &manifest.NVLink{Partitions: b300Sets, Source: "FM User Guide, HGX B200/B300"}
	r.Sign(t)
	fm := fabrictest.New(t)
	fs := flag.NewFlagSet("passage-dra plugin", flag.ContinueOnError)
	o := &options{}
	o.register(fs)
	var stderr bytes.Buffer
	fs.SetOutput(&stderr)
	cfg, p, code := pluginConfig(fs, []string{"--pub", keys, "--node-uuid", uuid, "--manifest", r.Path, "--root", r.Root,
		"--turnaround=false", "--plugin-dir", t.TempDir(), "--cdi-dir", t.TempDir(), "--fm-lib", fabrictest.Library(t), "--reload", "90s"}, o, &stderr)
	if code != 0 {
		t.Fatalf("plugin flags: exit %d %s", code, stderr.String())
	}
	t.Cleanup(func() { cfg.Fabric.Close() })
	var logs bytes.Buffer
	var logMu sync.Mutex
	cfg.Logf = func(format string, args ...any) {
		logMu.Lock()
		defer logMu.Unlock()
		fmt.Fprintf(&logs, format+"\n", args...)
	}
	d, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	const window = 8 * time.Second
	fm.Restart(t, window)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	go func() { done <- serve(ctx, d, p.reload, fs.Name(), &stderr, func(error) int { return 1 }) }()
	defer func() { cancel(); <-done }()
	handed := func() bool { return slices.Contains(fm.Calls(t, "set_activated"), "set_activated - = 0") }
	for start := time.Now(); !handed() && time.Since(start) < window+time.Second; {
		time.Sleep(100 * time.Millisecond)
	}
	if !handed() {
		t.Fatalf("FM restarted with --restart was not handed its active partitions within %v (--reload %v): FM's calls %v", window, p.reload, fm.Log(t))
	}
	if st := fm.Read(t); st.Mode != "serving" {
		t.Fatalf("FM %s", st.Mode)
	}
	logMu.Lock()
	defer logMu.Unlock()
	if !strings.Contains(logs.String(), "FM was waiting for the active partitions after a restart: handed []") {
		t.Errorf("the hand-over is not logged:\n%s", logs.String())
	}
}

// TestFabricModulesCommand (#55, 6): fabric modules reads nvidia-smi -q's output (the
// topology package's synthetic HGX B300 sample) and prints the profile's modules:
// stanza, Module IDs as the driver gave them; a GPU the driver gives none is named and
// left out (exit 1); text that is not nvidia-smi -q's is refused.
func TestFabricModulesCommand(t *testing.T) {
	sample := filepath.Join("..", "..", "..", "topology", "testdata", "nvidia-smi-q-hgx-b300.txt")
	code, out, errs := runCmd("fabric", "modules", "--nvidia-smi", sample)
	want := "modules:\n  \"0000:1b:00.0\": 2\n  \"0000:43:00.0\": 1\n  \"0000:52:00.0\": 4\n  \"0000:61:00.0\": 3\n" +
		"  \"0000:9d:00.0\": 6\n  \"0000:c3:00.0\": 5\n  \"0000:d1:00.0\": 8\n  \"0000:df:00.0\": 7\n"
	if code != 0 || !strings.HasSuffix(out, want) || errs != "" {
		t.Fatalf("exit %d\n%s%s", code, out, errs)
	}
	b, err := os.ReadFile(sample)
	if err != nil {
		t.Fatal(err)
	}
	na := filepath.Join(t.TempDir(), "na.txt")
	if err := os.WriteFile(na, bytes.Replace(b, []byte("Module Id                         : 7"), []byte("Module Id                         : N/A"), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, errs = runCmd("fabric", "modules", "--nvidia-smi", na)
	if code != 1 || strings.Contains(out, "0000:df:00.0\": ") || !strings.Contains(errs, "GPU 0000:df:00.0: the driver gives no Module ID") {
		t.Errorf("a GPU without a Module ID: exit %d\n%s%s", code, out, errs)
	}
	if code, _, errs := runCmd("fabric", "modules", "--nvidia-smi", "main.go"); code != 1 || !strings.Contains(errs, "no GPU section") {
		t.Errorf("not nvidia-smi -q: exit %d %s", code, errs)
	}
	if code, _, _ := runCmd("fabric", "modules"); code != 2 {
		t.Errorf("no --nvidia-smi: exit %d", code)
	}
}

// TestFabricCheckNVSMI: FM names members by Module ID alone, so a manifest whose map
// swaps two GPUs' modules agrees with FM; --nvidia-smi holds each unit's GPU to the
// Module ID the NVIDIA driver reported for it, and names the swap, a GPU the capture
// lacks and one the driver gives no Module ID.
func TestFabricCheckNVSMI(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	uuid := manifesttest.NodeUUID(6)
	r := noderig.New(t, uuid, "b300-smi", 4, keys)
	for i := range r.M.Units {
		r.M.Units[i].ModuleID, r.M.Units[i].ModuleSource = i+1, "test"
	}
	r.M.NVLink = &manifest.NVLink{Partitions: b300Sets, Source: "FM User Guide, HGX B200/B300"}
	good := r.Sign(t)
	lib := fabrictest.Library(t)
	fabrictest.New(t)
	// The driver's view: each unit's GPU with the manifest's Module ID, unless edit says.
	capture := func(edit func(addr string, mod int) (string, bool)) string {
		t.Helper()
		var sections []string
		for _, u := range r.M.Units {
			for _, f := range u.Functions {
				if f.Role != "gpu" {
					continue
				}
				mod, keep := fmt.Sprint(u.ModuleID), true
				if edit != nil {
					mod, keep = edit(f.BDF, u.ModuleID)
				}
				if keep {
					sections = append(sections, fmt.Sprintf("GPU %s\n    Platform Info\n        Module Id : %s\n    PCI\n        Bus Id : %s\n", f.BDF, mod, f.BDF))
				}
			}
		}
		p := filepath.Join(t.TempDir(), "smi.txt")
		if err := os.WriteFile(p, []byte(fmt.Sprintf("Attached GPUs : %d\n%s", len(sections), strings.Join(sections, ""))), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	check := func(args ...string) (int, string, string) {
		return runCmd(append(append([]string{"fabric", "check", "--pub", keys, "--node-uuid", uuid, "--fm-lib", lib}, args...), good)...)
	}
	gpu := func(unit int) string {
		for _, f := range r.M.Units[unit].Functions {
			if f.Role == "gpu" {
				return f.BDF
			}
		}
		t.Fatalf("unit %d has no GPU", unit)
		return ""
	}

	if code, out, errs := check("--nvidia-smi", capture(nil)); code != 0 || !strings.Contains(out, "each unit's GPU is the module the NVIDIA driver reported for it") {
		t.Fatalf("the driver's map is the manifest's: exit %d\n%s%s", code, out, errs)
	}
	// The driver has units 0 and 1's modules the other way round: FM alone agrees.
	swapped := capture(func(addr string, mod int) (string, bool) {
		switch mod {
		case 1:
			return "2", true
		case 2:
			return "1", true
		}
		return fmt.Sprint(mod), true
	})
	if code, out, errs := check(); code != 0 {
		t.Fatalf("without --nvidia-smi: exit %d\n%s%s", code, out, errs)
	}
	code, out, errs := check("--nvidia-smi", swapped)
	for _, w := range []string{
		fmt.Sprintf("unit %s: GPU %s is module 2 to the driver, 1 to the manifest", r.M.Units[0].ID, gpu(0)),
		fmt.Sprintf("unit %s: GPU %s is module 1 to the driver, 2 to the manifest", r.M.Units[1].ID, gpu(1)),
	} {
		if code != 1 || !strings.Contains(out, w) {
			t.Errorf("swapped modules: exit %d, want a line %q\n%s%s", code, w, out, errs)
		}
	}
	// A GPU the capture lacks; one the driver gives no Module ID.
	code, out, errs = check("--nvidia-smi", capture(func(addr string, mod int) (string, bool) {
		switch mod {
		case 3:
			return "N/A", true
		case 5:
			return "", false
		}
		return fmt.Sprint(mod), true
	}))
	for _, w := range []string{
		fmt.Sprintf("unit %s: GPU %s: the driver reports no Module ID; the manifest says 3", r.M.Units[2].ID, gpu(2)),
		fmt.Sprintf("unit %s: GPU %s is not in nvidia-smi's output", r.M.Units[4].ID, gpu(4)),
	} {
		if code != 1 || !strings.Contains(out, w) {
			t.Errorf("a GPU missing, one without a Module ID: exit %d, want a line %q\n%s%s", code, w, out, errs)
		}
	}
	if code, _, errs := check("--nvidia-smi", "main.go"); code != 2 || !strings.Contains(errs, "--nvidia-smi main.go") {
		t.Errorf("not nvidia-smi -q: exit %d %s", code, errs)
	}
}
