//go:build cgo

package fabricmanager_test

// Every test here runs against fmstub.c, passage's stand-in for FM behind libnvfm (see
// package fabrictest), loaded through go-nvfm's real dlopen path: they show that
// passage holds to FM's documented API as the stand-in models it, not that an FM on an
// NVSwitch baseboard answers so.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvfm/pkg/nvfm"

	"github.com/passage-boot/passage/kube/fabricmanager"
	"github.com/passage-boot/passage/kube/fabricmanager/fabrictest"
)

// open is a Client of the stand-in FM fm.
func open(t *testing.T) (*fabricmanager.Client, *fabrictest.FM) {
	t.Helper()
	lib := fabrictest.Library(t)
	fm := fabrictest.New(t)
	c, err := fabricmanager.Open(fabricmanager.Options{Library: lib, Reconnect: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, fm
}

func wantUnreachable(t *testing.T, what string, err error) {
	t.Helper()
	if !fabricmanager.Unreachable(err) {
		t.Fatalf("%s: %v, want FM unreachable", what, err)
	}
	if r, ok := fabricmanager.Code(err); ok {
		t.Fatalf("%s: %v read as FM's answer %s", what, err, r)
	}
}

func wantCode(t *testing.T, what string, err error, want fabricmanager.Return) {
	t.Helper()
	if r, ok := fabricmanager.Code(err); !ok || r != want {
		t.Fatalf("%s: %v, want %s", what, err, want)
	}
}

// The HGX B200/B300 table (FM User Guide; NVLINK.md §4).
var b300 = map[uint32][]int{
	1: {1, 2, 3, 4, 5, 6, 7, 8}, 2: {1, 2, 3, 4}, 3: {5, 6, 7, 8},
	4: {1, 2}, 5: {3, 4}, 6: {5, 6}, 7: {7, 8},
	8: {1}, 9: {2}, 10: {3}, 11: {4}, 12: {5}, 13: {6}, 14: {7}, 15: {8},
}

func TestStubPartitionList(t *testing.T) {
	c, _ := open(t)
	ps, err := c.Partitions()
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 15 {
		t.Fatalf("%d partitions, want 15", len(ps))
	}
	for _, p := range ps {
		if !slices.Equal(p.Modules(), b300[p.ID]) || p.Active {
			t.Errorf("%s, want modules %v inactive", p, b300[p.ID])
		}
		for _, g := range p.GPUs {
			links := uint32(18)
			if len(p.GPUs) == 1 {
				links = 0 // a single-GPU partition has its NVLinks off
			}
			if g.UUID != "" || g.PCIBusID != "" || g.MaxNumNvLinks != links || g.NumNvLinksAvailable != links {
				t.Errorf("partition %d module %d: %+v", p.ID, g.PhysicalID, g)
			}
		}
		if d := p.Degraded(); d != nil {
			t.Errorf("%s degraded: %v", p, d)
		}
	}
}

func TestStubStateMachine(t *testing.T) {
	c, fm := open(t)
	if err := c.Activate(4); err != nil {
		t.Fatal(err)
	}
	err := c.Activate(4)
	wantCode(t, "activate an active partition", err, fabricmanager.FM_ST_PARTITION_ID_IN_USE)
	if err.Error() != "fm: activate partition 4: FM_ST_PARTITION_ID_IN_USE (-17)" {
		t.Errorf("error %q", err)
	}
	// Partitions 2 and 1 share modules 1 and 2 with 4; 9 is module 2 alone.
	for _, id := range []uint32{1, 2, 9} {
		err := c.Activate(id)
		wantCode(t, fmt.Sprintf("activate %d over partition 4", id), err, fabricmanager.FM_ST_IN_USE)
		if want := fmt.Sprintf("fm: activate partition %d: FM_ST_IN_USE (-7)", id); err.Error() != want {
			t.Errorf("error %q, want %q", err, want)
		}
	}
	if err := c.Activate(3); err != nil { // modules 5-8 beside 1-2
		t.Fatal(err)
	}
	wantCode(t, "deactivate an inactive partition", c.Deactivate(5), fabricmanager.FM_ST_PARTITION_ID_NOT_IN_USE)
	wantCode(t, "activate partition 16", c.Activate(16), fabricmanager.FM_ST_BADPARAM)
	wantCode(t, "activate partition 0", c.Activate(0), fabricmanager.FM_ST_BADPARAM)
	wantCode(t, "deactivate partition 99", c.Deactivate(99), fabricmanager.FM_ST_BADPARAM)
	// Outside a --restart FM is not waiting for an active list.
	wantCode(t, "set activated while serving", c.SetActivated([]uint32{4}), fabricmanager.FM_ST_NOT_SUPPORTED)
	if got := fm.Active(t); !slices.Equal(got, []int{3, 4}) {
		t.Fatalf("active %v, want [3 4]", got)
	}
	if err := c.Deactivate(4); err != nil {
		t.Fatal(err)
	}
	if err := c.Activate(2); err != nil {
		t.Fatal(err)
	}
	ps, _ := c.Partitions()
	for _, p := range ps {
		if p.Active != (p.ID == 2 || p.ID == 3) {
			t.Errorf("%s", p)
		}
	}

	// As the FM User Guide documents the two answers: IN_USE and UNINITIALIZED. The
	// client takes UNINITIALIZED for a broken connection first, and asks once more on
	// a new one (package fabricmanager then holds it to FM's list).
	fm.Update(t, func(s *fabrictest.State) { s.FMUGCodes = true })
	wantCode(t, "activate an active partition (guide's code)", c.Activate(2), fabricmanager.FM_ST_IN_USE)
	wantCode(t, "deactivate an inactive partition (guide's code)", c.Deactivate(4), fabricmanager.FM_ST_UNINITIALIZED)
	if n := len(fm.Calls(t, "deactivate 4")); n != 3 {
		t.Errorf("deactivate 4 called %d times, want 3 (once, then once more after UNINITIALIZED): %v", n, fm.Log(t))
	}
}

// TestStubConnect: fmConnect holds the parameters' version to the header's
// fmConnectParams_version, and an FM listening elsewhere cannot be reached.
func TestStubConnect(t *testing.T) {
	c, fm := open(t)
	_ = c
	// The library is loaded and initialised by c; a second go-nvfm instance reaches the
	// same fmConnect.
	lib := nvfm.New(nvfm.WithLibraryPath(fabrictest.Library(t)))
	for _, v := range []uint32{nvfm.ConnectV1ParamsVersion, nvfm.ConnectParamsVersion + 1} {
		p := nvfm.ConnectParams{Version: v, AddressType: nvfm.ADDR_TYPE_INET, TimeoutMs: 1000}
		if _, r := lib.ConnectWithParams(p); r != nvfm.VERSION_MISMATCH {
			t.Errorf("connect with version %#x: %v, want VERSION_MISMATCH", v, r)
		}
	}
	sock := filepath.Join(t.TempDir(), "fm.sock")
	fm.Update(t, func(s *fabrictest.State) { s.Listen = "unix:" + sock })
	_, err := fabricmanager.Open(fabricmanager.Options{Library: fabrictest.Library(t)})
	wantUnreachable(t, "connect to 127.0.0.1:6666 when FM listens on a socket", err)
	if !strings.Contains(err.Error(), "FM unreachable at 127.0.0.1:6666: connect FM_ST_CONNECTION_NOT_VALID (-9)") {
		t.Errorf("error %q does not name the address", err)
	}
	c2, err := fabricmanager.Open(fabricmanager.Options{Library: fabrictest.Library(t), Socket: sock})
	if err != nil {
		t.Fatal(err)
	}
	c2.Close()
	if got := fm.Calls(t, "connect"); !slices.Contains(got, "connect unix:"+sock+" = 0") {
		t.Errorf("connects %v", got)
	}
	fm.Update(t, func(s *fabrictest.State) { s.Listen = "inet:127.0.0.1:6666" })
	c3, err := fabricmanager.Open(fabricmanager.Options{Library: fabrictest.Library(t), Address: "127.0.0.1"})
	if err != nil {
		t.Fatalf("a bare address is FM's port 6666: %v", err)
	}
	c3.Close()

	_, err = fabricmanager.Open(fabricmanager.Options{Library: filepath.Join(t.TempDir(), "libnvfm.so")})
	if err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("a library not there: %v", err)
	}
}

// TestStubRestartWindow: FM started with --restart rejects every query, activation and
// deactivation with FM_ST_NOT_CONFIGURED until it is handed the active list; handed
// none within its window, it exits and cannot be reached.
func TestStubRestartWindow(t *testing.T) {
	c, fm := open(t)
	if err := c.Activate(4); err != nil {
		t.Fatal(err)
	}
	fm.Restart(t, 5*time.Second)
	_, err := c.Partitions()
	wantCode(t, "list while FM waits", err, fabricmanager.FM_ST_NOT_CONFIGURED)
	wantCode(t, "activate while FM waits", c.Activate(5), fabricmanager.FM_ST_NOT_CONFIGURED)
	wantCode(t, "deactivate while FM waits", c.Deactivate(4), fabricmanager.FM_ST_NOT_CONFIGURED)
	// The connection from before the restart was answered CONNECTION_NOT_VALID once,
	// and the client connected again.
	if log := strings.Join(fm.Log(t), "\n"); !strings.Contains(log, "list - = -9\nconnect inet:127.0.0.1:6666 = 0") {
		t.Errorf("no reconnect after the restart:\n%s", log)
	}
	wantCode(t, "an overlapping list", c.SetActivated([]uint32{4, 2}), fabricmanager.FM_ST_BADPARAM)
	if err := c.SetActivated([]uint32{4}); err != nil {
		t.Fatal(err)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4}) {
		t.Fatalf("active %v after the list", got)
	}
	wantCode(t, "activate 4 after the list", c.Activate(4), fabricmanager.FM_ST_PARTITION_ID_IN_USE)

	// A restart nobody answers: 150 ms here (the state file's window; FM's is 60 s).
	fm.Restart(t, 150*time.Millisecond)
	_, err = c.Partitions()
	wantCode(t, "list within the window", err, fabricmanager.FM_ST_NOT_CONFIGURED)
	time.Sleep(300 * time.Millisecond)
	_, err = c.Partitions()
	wantUnreachable(t, "list after FM exited", err)
	if !strings.Contains(err.Error(), "(the connection answered FM_ST_CONNECTION_NOT_VALID (-9), not taken as FM's answer): connect FM_ST_CONNECTION_NOT_VALID (-9)") {
		t.Errorf("error %q does not say the reconnect failed", err)
	}
	if _, err := fabricmanager.Open(fabricmanager.Options{Library: fabrictest.Library(t)}); err == nil {
		t.Error("connected to an FM that exited")
	}
	if st := fm.Read(t); st.Mode != "exited" {
		t.Errorf("mode %q, want exited", st.Mode)
	}
}

// newFabric is a Fabric with its ledger in a new directory, against the stand-in.
func newFabric(t *testing.T) (*fabricmanager.Fabric, *fabrictest.FM, string) {
	t.Helper()
	lib := fabrictest.Library(t)
	fm := fabrictest.New(t)
	dir := t.TempDir()
	// FM out of reach fails a call after 300 ms of connects, not the default 2 s.
	f, err := fabricmanager.New(dir, fabricmanager.Options{Library: lib, Reconnect: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f, fm, dir
}

type ledgerFile struct {
	Version int                            `json:"version"`
	Claims  map[string]fabricmanager.Entry `json:"claims"`
}

func readLedger(t *testing.T, dir string) ledgerFile {
	t.Helper()
	var l ledgerFile
	b, err := os.ReadFile(filepath.Join(dir, fabricmanager.LedgerFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &l); err != nil {
		t.Fatal(err)
	}
	return l
}

func writeLedger(t *testing.T, dir string, l ledgerFile) {
	t.Helper()
	l.Version = 1
	b, _ := json.Marshal(l)
	if err := os.WriteFile(filepath.Join(dir, fabricmanager.LedgerFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestFabricActivateDeactivate(t *testing.T) {
	f, fm, dir := newFabric(t)
	p, err := f.Activate("vm-a", []int{2, 1})
	if err != nil || p.ID != 4 {
		t.Fatalf("activate modules 1,2: %v, %v", p, err)
	}
	if e := readLedger(t, dir).Claims["vm-a"]; e.Partition != 4 || e.State != fabricmanager.StateActive || !slices.Equal(e.Modules, []int{1, 2}) {
		t.Fatalf("ledger: %+v", e)
	}
	// The kubelet asks again: the same partition, FM not asked to activate again.
	if p, err := f.Activate("vm-a", []int{1, 2}); err != nil || p.ID != 4 {
		t.Fatalf("activate again: %v, %v", p, err)
	}
	if n := len(fm.Calls(t, "activate")); n != 1 {
		t.Errorf("%d activations, want 1: %v", n, fm.Log(t))
	}
	// Refused before FM is asked: modules another claim holds, a set FM has no
	// partition of, a module given twice or unknown (0).
	for _, c := range []struct {
		mods []int
		want string
	}{
		{[]int{1, 2, 3, 4}, "claim vm-a holds partition 4"},
		{[]int{3, 5}, "none of FM's 15 partitions has exactly modules 3,5"},
		{[]int{5, 5}, "module 5 given twice"},
		{[]int{0, 5}, "module ID 0: not a GPU Module ID"},
		{nil, "no GPU module"},
	} {
		if _, err := f.Activate("vm-b", c.mods); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("activate %v: %v, want %q", c.mods, err, c.want)
		}
	}
	if n := len(fm.Calls(t, "activate")); n != 1 {
		t.Errorf("a refused claim reached FM: %v", fm.Log(t))
	}
	if _, ok := readLedger(t, dir).Claims["vm-b"]; ok {
		t.Error("a refused claim is in the ledger")
	}
	if p, err := f.Activate("vm-c", []int{3}); err != nil || p.ID != 10 {
		t.Fatalf("activate module 3: %v, %v", p, err)
	}
	if got := f.Holding([]int{2, 3}); !slices.Equal(got, []string{"vm-a", "vm-c"}) {
		t.Errorf("holding modules 2,3: %v", got)
	}
	if err := f.Deactivate("vm-a"); err != nil {
		t.Fatal(err)
	}
	if err := f.Deactivate("vm-a"); err != nil {
		t.Fatalf("deactivate a released claim again: %v", err)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{10}) {
		t.Errorf("FM active %v, want [10]", got)
	}
	if l := readLedger(t, dir); len(l.Claims) != 1 || l.Claims["vm-c"].Partition != 10 {
		t.Errorf("ledger %+v", l)
	}

	// A partition with NVLinks down is not given.
	fm.Update(t, func(s *fabrictest.State) { s.Links[6] = 12 })
	if _, err := f.Activate("vm-d", []int{5, 6}); err == nil || !strings.Contains(err.Error(), "partition 6 (modules 5,6) is degraded: module 6 has 12 of 18 NVLinks") {
		t.Errorf("activate a degraded partition: %v", err)
	}
	// Nor one FM has active for no claim of the ledger.
	fm.Update(t, func(s *fabrictest.State) { s.Active = append(s.Active, 7) })
	if _, err := f.Activate("vm-e", []int{7, 8}); err == nil || !strings.Contains(err.Error(), "no claim of the ledger holds it") {
		t.Errorf("activate a partition active outside the ledger: %v", err)
	}
}

// TestFabricRecordsFirst: the intent is written before FM is asked. A ledger that
// cannot be written (a directory in its place) refuses the claim, FM untouched; a
// deactivation that cannot be recorded leaves the partition active.
func TestFabricRecordsFirst(t *testing.T) {
	f, fm, dir := newFabric(t)
	if _, err := f.Activate("vm-a", []int{1}); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, fabricmanager.LedgerFile)
	os.Remove(p)
	if err := os.MkdirAll(filepath.Join(p, "planted"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Activate("vm-b", []int{2}); err == nil || !strings.Contains(err.Error(), p) {
		t.Fatalf("activate with the ledger unwritable: %v", err)
	}
	if err := f.Deactivate("vm-a"); err == nil {
		t.Fatal("deactivate with the ledger unwritable: no error")
	}
	if calls := fm.Calls(t, "activate"); len(calls) != 1 || len(fm.Calls(t, "deactivate")) != 0 {
		t.Fatalf("FM was asked with nothing recorded: %v", fm.Log(t))
	}
	if got := fm.Active(t); !slices.Equal(got, []int{8}) {
		t.Fatalf("FM active %v", got)
	}
	if _, err := fabricmanager.New(dir, fabricmanager.Options{}); err == nil || !strings.Contains(err.Error(), p) {
		t.Errorf("a restart with the ledger a directory: %v, want it refused", err)
	}
}

// TestFabricRefusedAndGone: fail closed. FM's refusal is the claim's error naming FM's
// code, and the ledger holds nothing of it; FM out of reach likewise; a release FM
// will not do stays in the ledger (deactivating, with FM's error) until Resume finds
// FM back.
func TestFabricRefusedAndGone(t *testing.T) {
	f, fm, dir := newFabric(t)
	fm.Update(t, func(s *fabrictest.State) { s.RefuseActivate = int(fabricmanager.FM_ST_NVLINK_ERROR) })
	_, err := f.Activate("vm-a", []int{1, 2, 3, 4})
	if err == nil || !strings.Contains(err.Error(), "fm: activate partition 2: FM_ST_NVLINK_ERROR (-10)") {
		t.Fatalf("FM refusing: %v", err)
	}
	if l := readLedger(t, dir); len(l.Claims) != 0 {
		t.Fatalf("ledger after FM refused: %+v", l)
	}
	fm.Update(t, func(s *fabrictest.State) { s.RefuseActivate = 0 })
	if _, err := f.Activate("vm-a", []int{1, 2, 3, 4}); err != nil {
		t.Fatal(err)
	}

	fm.Update(t, func(s *fabrictest.State) { s.Mode = "gone" })
	_, err = f.Activate("vm-b", []int{5})
	wantUnreachable(t, "activate with FM gone", err)
	if _, ok := readLedger(t, dir).Claims["vm-b"]; ok {
		t.Fatal("ledger holds a claim FM never saw")
	}
	err = f.Deactivate("vm-a")
	wantUnreachable(t, "deactivate with FM gone", err)
	e := readLedger(t, dir).Claims["vm-a"]
	if e.State != fabricmanager.StateDeactivating || !strings.Contains(e.LastError, "FM unreachable") {
		t.Fatalf("ledger after a failed release: %+v", e)
	}
	// The released claim's modules are still its own.
	if _, err := f.Activate("vm-c", []int{1}); err == nil || !strings.Contains(err.Error(), "claim vm-a holds partition 2") {
		t.Errorf("activate over a partition not yet released: %v", err)
	}
	if _, err := f.Resume(); err == nil {
		t.Error("resume with FM gone: no error")
	}

	fm.Update(t, func(s *fabrictest.State) { s.Mode = "serving"; s.Epoch++ })
	r, err := f.Resume()
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Differences) != 0 || len(r.Settled) != 1 || !strings.Contains(r.Settled[0], "claim vm-a (released): partition 2") {
		t.Fatalf("resume: %+v", r)
	}
	if got := fm.Active(t); len(got) != 0 {
		t.Errorf("FM active %v after the release was retried", got)
	}
	if l := readLedger(t, dir); len(l.Claims) != 0 {
		t.Errorf("ledger %+v", l)
	}
}

// TestFabricResume: after an FM --restart, the ledger's partitions are handed to FM
// (the released one that FM did not deactivate too, the one never confirmed not),
// the release is done again, and what still differs is named.
func TestFabricResume(t *testing.T) {
	f, fm, dir := newFabric(t)
	for claim, mods := range map[string][]int{"vm-a": {1, 2}, "vm-b": {3, 4}} {
		if _, err := f.Activate(claim, mods); err != nil {
			t.Fatal(err)
		}
	}
	// The ledger of a plugin stopped at the worst times: vm-b released but FM was
	// restarting; vm-c recorded, FM not asked yet.
	f.Close()
	l := readLedger(t, dir)
	l.Claims["vm-b"] = fabricmanager.Entry{Partition: 5, Modules: []int{3, 4}, State: fabricmanager.StateDeactivating}
	l.Claims["vm-c"] = fabricmanager.Entry{Partition: 6, Modules: []int{5, 6}, State: fabricmanager.StateActivating}
	writeLedger(t, dir, l)
	fm.Restart(t, 5*time.Second)

	f2, err := fabricmanager.New(dir, fabricmanager.Options{Library: fabrictest.Library(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Close()
	r, err := f2.Resume()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(r.Handed, []uint32{4, 5}) || !slices.Contains(fm.Log(t), "set_activated 4,5 = 0") {
		t.Fatalf("handed %v: %v", r.Handed, fm.Log(t))
	}
	if len(r.Settled) != 2 || len(r.Differences) != 0 {
		t.Fatalf("resume: %q", r.Lines())
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4}) {
		t.Fatalf("FM active %v, want [4]", got)
	}
	if l := readLedger(t, dir); len(l.Claims) != 1 || l.Claims["vm-a"].State != fabricmanager.StateActive {
		t.Fatalf("ledger %+v", l)
	}

	// FM has a partition no claim holds; the ledger a claim FM lost; a crash between
	// FM's activation and the ledger's record.
	fm.Update(t, func(s *fabrictest.State) { s.Active = []int{4, 7, 13} })
	l = readLedger(t, dir)
	l.Claims["vm-d"] = fabricmanager.Entry{Partition: 12, Modules: []int{5}, State: fabricmanager.StateActive}
	l.Claims["vm-e"] = fabricmanager.Entry{Partition: 13, Modules: []int{6}, State: fabricmanager.StateActivating}
	writeLedger(t, dir, l)
	f2.Close()
	f3, err := fabricmanager.New(dir, fabricmanager.Options{Library: fabrictest.Library(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer f3.Close()
	r, err = f3.Resume()
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"claim vm-d: partition 12 (modules 5) is the claim's in the ledger, not active in FM",
		"claim vm-e: partition 13 (modules 6, active) is active in FM, its activation not confirmed",
		"partition 7 (modules 7,8, active) is active in FM, and no claim of the ledger holds it",
	}
	if r.Handed != nil || len(r.Differences) != len(want) {
		t.Fatalf("resume: %q", r.Lines())
	}
	for i, w := range want {
		if !strings.Contains(r.Differences[i], w) {
			t.Errorf("difference %q, want %q", r.Differences[i], w)
		}
	}
	// vm-e's prepare, asked again, takes the partition FM has without activating it.
	if p, err := f3.Activate("vm-e", []int{6}); err != nil || p.ID != 13 {
		t.Fatalf("activate vm-e: %v %v", p, err)
	}
	if slices.Contains(fm.Log(t), "activate 13 = 0") || readLedger(t, dir).Claims["vm-e"].State != fabricmanager.StateActive {
		t.Errorf("vm-e not taken as it was: %v", fm.Log(t))
	}
}

// TestFabricActivateDuringRestart: FM restarted between the list and the activation is
// handed the ledger's list, and the activation is asked again.
func TestFabricActivateDuringRestart(t *testing.T) {
	f, fm, _ := newFabric(t)
	if _, err := f.Activate("vm-a", []int{8}); err != nil {
		t.Fatal(err)
	}
	fm.Restart(t, 5*time.Second)
	if _, err := f.Activate("vm-b", []int{1, 2}); err != nil {
		t.Fatal(err)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4, 15}) {
		t.Fatalf("FM active %v, want [4 15]", got)
	}
	if !slices.Contains(fm.Log(t), "set_activated 15 = 0") {
		t.Errorf("no list handed: %v", fm.Log(t))
	}
	if err := f.Deactivate("vm-a"); err != nil {
		t.Fatal(err)
	}
}

func TestLedgerRefusedAtStart(t *testing.T) {
	for name, body := range map[string]string{
		"not json":      "{",
		"version":       `{"version":2,"claims":{}}`,
		"unknown field": `{"version":1,"claims":{},"extra":1}`,
		"state":         `{"version":1,"claims":{"a":{"partition":4,"modules":[1,2],"state":"on"}}}`,
		"modules":       `{"version":1,"claims":{"a":{"partition":4,"modules":[2,1],"state":"active"}}}`,
		"null claims":   `{"version":1,"claims":null}`,
	} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, fabricmanager.LedgerFile), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := fabricmanager.New(dir, fabricmanager.Options{}); err == nil {
			t.Errorf("%s: ledger %s accepted", name, body)
		}
	}
}

func TestReturnNames(t *testing.T) {
	for r, want := range map[fabricmanager.Return]string{
		fabricmanager.FM_ST_IN_USE:                            "FM_ST_IN_USE (-7)",
		fabricmanager.FM_ST_PARTITION_ID_IN_USE:               "FM_ST_PARTITION_ID_IN_USE (-17)",
		fabricmanager.FM_ST_PARTITION_ROUTE_PROGRAMMING_ERROR: "FM_ST_PARTITION_ROUTE_PROGRAMMING_ERROR (-29)",
		-30: "fmReturn_t -30",
		1:   "fmReturn_t 1",
	} {
		if got := r.String(); got != want {
			t.Errorf("%d: %q, want %q", int32(r), got, want)
		}
	}
	// go-nvfm's names are the header's without the prefix.
	for r := nvfm.Return(0); r >= -29; r-- {
		if got := fabricmanager.Return(r).String(); !strings.HasPrefix(got, "FM_ST_"+r.String()+" (") {
			t.Errorf("%d: %q, go-nvfm says %s", int32(r), got, r)
		}
	}
	if _, ok := fabricmanager.Code(errors.New("x")); ok {
		t.Error("Code of an error not FM's")
	}
}

func TestCheck(t *testing.T) {
	var fm []fabricmanager.Partition
	for id := uint32(1); id <= 15; id++ {
		p := fabricmanager.Partition{ID: id}
		for _, m := range b300[id] {
			links := uint32(18)
			if len(b300[id]) == 1 {
				links = 0
			}
			p.GPUs = append(p.GPUs, fabricmanager.GPU{PhysicalID: uint32(m), NumNvLinksAvailable: links, MaxNumNvLinks: links})
		}
		fm = append(fm, p)
	}
	var declared [][]int
	for id := uint32(1); id <= 15; id++ {
		declared = append(declared, b300[id])
	}
	units := func() []fabricmanager.LayoutUnit {
		var u []fabricmanager.LayoutUnit
		for i := range 8 {
			u = append(u, fabricmanager.LayoutUnit{ID: fmt.Sprintf("gpu%d", i), Module: i + 1, Source: "nvml"})
		}
		return u
	}
	good := fabricmanager.Layout{Units: units(), Partitions: declared}
	if got := fabricmanager.Check(good, fm); len(got) != 0 {
		t.Fatalf("a matching layout: %q", got)
	}
	h100 := [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 3}, {2, 4}, {5, 7}, {6, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}
	for name, c := range map[string]struct {
		l    func(*fabricmanager.Layout)
		fm   func([]fabricmanager.Partition) []fabricmanager.Partition
		want []string
	}{
		"unknown module": {l: func(l *fabricmanager.Layout) { l.Units[3].Module, l.Units[3].Source = 0, "" },
			want: []string{"unit gpu3: GPU Module ID unknown: no FM partition can be matched to it"}},
		"module twice": {l: func(l *fabricmanager.Layout) { l.Units[3].Module = 3 },
			want: []string{"unit gpu3: module 3 is unit gpu2's too"}},
		"module not in FM": {l: func(l *fabricmanager.Layout) { l.Units[7].Module = 9 },
			want: []string{"unit gpu7: module 9 is in none of FM's partitions"}},
		"H100 pairs declared": {l: func(l *fabricmanager.Layout) { l.Partitions = h100 },
			want: []string{
				"FM partition 4 (modules 1,2): the manifest's NVLink layout has no such module set",
				"FM partition 5 (modules 3,4)", "FM partition 6 (modules 5,6)", "FM partition 7 (modules 7,8)",
				"declares modules {1,3}: FM offers no partition of them", "{2,4}", "{5,7}", "{6,8}"}},
		"no layout": {l: func(l *fabricmanager.Layout) { l.Partitions = nil },
			want: []string{"the manifest declares no NVLink layout"}},
		"degraded": {fm: func(ps []fabricmanager.Partition) []fabricmanager.Partition {
			ps[3].GPUs[1].NumNvLinksAvailable = 9
			return ps
		},
			want: []string{"FM partition 4 (modules 1,2) is degraded: module 2 has 9 of 18 NVLinks"}},
	} {
		l := fabricmanager.Layout{Units: units(), Partitions: declared}
		if c.l != nil {
			c.l(&l)
		}
		f := slices.Clone(fm)
		for i := range f {
			f[i].GPUs = slices.Clone(f[i].GPUs)
		}
		if c.fm != nil {
			f = c.fm(f)
		}
		got := fabricmanager.Check(l, f)
		if len(got) != len(c.want) {
			t.Errorf("%s: %q, want %d mismatches", name, got, len(c.want))
			continue
		}
		for i, w := range c.want {
			if !strings.Contains(got[i], w) {
				t.Errorf("%s: mismatch %q, want %q", name, got[i], w)
			}
		}
	}
}

// TestFabricDeactivateUnreachable (#55, 3): FM's UNINITIALIZED is also the guide's
// "partition not active"; answered on a connection FM is gone from, with the
// reconnect failing, it is no answer at all. Deactivate fails, the claim stays in the
// ledger (deactivating), and FM keeps partition 4 active: nothing may reset its GPUs.
func TestFabricDeactivateUnreachable(t *testing.T) {
	f, fm, dir := newFabric(t)
	if _, err := f.Activate("vm-a", []int{1, 2}); err != nil {
		t.Fatal(err)
	}
	fm.Update(t, func(s *fabrictest.State) {
		s.FMUGCodes, s.StaleCode, s.Mode = true, int(fabricmanager.FM_ST_UNINITIALIZED), "gone"
	})
	err := f.Deactivate("vm-a")
	if err == nil {
		t.Fatalf("deactivate with FM unreachable: nil; FM's log %v", fm.Log(t))
	}
	if r, ok := fabricmanager.Code(err); ok {
		t.Errorf("FM out of reach read as FM's answer %s: %v", r, err)
	}
	if !strings.Contains(err.Error(), "unreachable") {
		t.Errorf("error %q does not say FM is unreachable", err)
	}
	if e, ok := readLedger(t, dir).Claims["vm-a"]; !ok || e.State != fabricmanager.StateDeactivating || e.Partition != 4 {
		t.Fatalf("ledger after a release FM did not answer: %+v (held %v)", e, ok)
	}
	if got := fm.Active(t); !slices.Equal(got, []int{4}) {
		t.Fatalf("FM active %v", got)
	}
	if got := f.Holding([]int{1}); !slices.Equal(got, []string{"vm-a"}) {
		t.Errorf("holding module 1: %v", got)
	}

	// FM back, answering a partition that is not active with the guide's
	// UNINITIALIZED on a live connection: that is done, once FM's list confirms it.
	fm.Update(t, func(s *fabrictest.State) { s.Mode, s.Epoch, s.Active = "serving", s.Epoch+1, nil })
	if err := f.Deactivate("vm-a"); err != nil {
		t.Fatalf("deactivate a partition FM says is not active: %v", err)
	}
	if l := readLedger(t, dir); len(l.Claims) != 0 {
		t.Errorf("ledger %+v", l)
	}
	// UNINITIALIZED for a partition FM's list still has active is not done.
	if _, err := f.Activate("vm-b", []int{3, 4}); err != nil {
		t.Fatal(err)
	}
	fm.Update(t, func(s *fabrictest.State) { s.RefuseDeactivate = int(fabricmanager.FM_ST_UNINITIALIZED) })
	if err := f.Deactivate("vm-b"); err == nil {
		t.Fatal("UNINITIALIZED for a partition FM lists active: taken as released")
	}
	if e := readLedger(t, dir).Claims["vm-b"]; e.State != fabricmanager.StateDeactivating {
		t.Errorf("ledger vm-b: %+v", e)
	}
}

// TestFabricReconnects (#55, 4): a connection FM restarted under, answered with a code
// other than CONNECTION_NOT_VALID (libnvfm's answer to a dead socket is undocumented),
// is dropped and made again: FM waiting after its --restart is handed the ledger's
// list within its window.
func TestFabricReconnects(t *testing.T) {
	for _, code := range []fabricmanager.Return{fabricmanager.FM_ST_TIMEOUT, fabricmanager.FM_ST_GENERIC_ERROR} {
		t.Run(fmt.Sprint(int32(code)), func(t *testing.T) {
			f, fm, _ := newFabric(t)
			if _, err := f.Activate("vm-a", []int{8}); err != nil {
				t.Fatal(err)
			}
			fm.Update(t, func(s *fabrictest.State) { s.StaleCode = int(code) })
			fm.Restart(t, 3*time.Second)
			r, err := f.Resume()
			if err != nil {
				t.Fatalf("resume after FM restarted, the old connection answering %s: %v\n%v", code, err, fm.Log(t))
			}
			if !slices.Equal(r.Handed, []uint32{15}) {
				t.Fatalf("handed %v: %v", r.Handed, fm.Log(t))
			}
			if st := fm.Read(t); st.Mode != "serving" || !slices.Equal(st.Active, []int{15}) {
				t.Fatalf("FM %s, active %v", st.Mode, st.Active)
			}
			if _, err := f.Activate("vm-b", []int{1, 2}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestFabricUnreachableBounded: FM gone, a call tries to connect again for the
// Options' Reconnect at most, then fails as FM unreachable; FM back, the next call
// connects.
func TestFabricUnreachableBounded(t *testing.T) {
	fm := fabrictest.New(t)
	f, err := fabricmanager.New(t.TempDir(), fabricmanager.Options{Library: fabrictest.Library(t), Reconnect: 400 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Activate("vm-a", []int{1}); err != nil {
		t.Fatal(err)
	}
	fm.Update(t, func(s *fabrictest.State) { s.Mode, s.StaleCode = "gone", int(fabricmanager.FM_ST_TIMEOUT) })
	start := time.Now()
	_, err = f.Activate("vm-b", []int{2})
	took := time.Since(start)
	wantUnreachable(t, "activate with FM gone", err)
	if took < 400*time.Millisecond || took > 3*time.Second {
		t.Errorf("gave up after %v, want the 400 ms Reconnect", took)
	}
	if n := len(fm.Calls(t, "connect")); n < 3 || n > 10 {
		t.Errorf("%d connects: %v", n, fm.Log(t))
	}
	fm.Update(t, func(s *fabrictest.State) { s.Mode, s.Epoch = "serving", s.Epoch+1 })
	if _, err := f.Activate("vm-b", []int{2}); err != nil {
		t.Fatal(err)
	}
}
