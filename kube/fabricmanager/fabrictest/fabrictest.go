// Package fabrictest gives tests a stand-in Fabric Manager: fmstub.c (../fmstub), a
// libnvfm.so of passage's own that keeps FM's partition state machine for an HGX
// B200/B300 baseboard in a state file, built with gcc against go-nvfm's copy of the FM
// SDK headers in the Go module cache. go-nvfm loads it through its real dlopen path.
// What the tests show is that passage holds to FM's documented API as the stand-in
// models it: no FM, NVSwitch or NVIDIA library takes part.
package fabrictest

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/passage-boot/passage/internal/checkout"
)

// StateEnv names the stand-in's state file for every process that loads it.
const StateEnv = "PASSAGE_FMSTUB_STATE"

var built struct {
	sync.Mutex
	path string
}

// Library is the stand-in libnvfm.so. It is built once for its inputs (fmstub.c, the
// headers, gcc's version) into a directory of the system's temporary one named by
// their digest, which later test binaries find: go-nvfm's process keeps it mapped, so
// no test's TempDir may hold it.
func Library(t testing.TB) string {
	t.Helper()
	built.Lock()
	defer built.Unlock()
	if built.path != "" {
		return built.path
	}
	src, err := checkout.Path("kube/fabricmanager/fmstub/fmstub.c")
	if err != nil {
		t.Fatalf("fabrictest: %v", err)
	}
	// The headers are go-nvfm's (unmodified, in the module cache): NVIDIA's licence
	// does not let a modified copy be handed on, and passage needs none of its own.
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/NVIDIA/go-nvfm").Output()
	if err != nil {
		t.Fatalf("fabrictest: go list github.com/NVIDIA/go-nvfm: %v", err)
	}
	inc := filepath.Join(strings.TrimSpace(string(out)), "pkg", "nvfm")
	gcc, err := exec.Command("gcc", "--version").Output()
	if err != nil {
		t.Fatalf("fabrictest: gcc: %v (image/deps.sh installs it)", err)
	}
	h := sha256.New()
	h.Write(gcc)
	for _, p := range []string{src, filepath.Join(inc, "nv_fm_agent.h"), filepath.Join(inc, "nv_fm_types.h")} {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(h, "%s %d\n", filepath.Base(p), len(b))
		h.Write(b)
	}
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("passage-fmstub-%x", h.Sum(nil)[:8]))
	lib := filepath.Join(dir, "libnvfm.so")
	if _, err := os.Stat(lib); err == nil {
		built.path = lib
		return lib
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tmp, err := os.CreateTemp(dir, ".libnvfm.so.*")
	if err != nil {
		t.Fatal(err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	cmd := exec.Command("gcc", "-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", inc, "-o", tmp.Name(), src)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("fabrictest: gcc %s: %v\n%s", src, err, b)
	}
	// Renamed into place whole: another test binary building at once finds either none
	// or this one.
	if err := os.Rename(tmp.Name(), lib); err != nil {
		t.Fatal(err)
	}
	built.path = lib
	return lib
}

// State is the stand-in's state file (see fmstub.c).
type State struct {
	Mode                                         string // serving, restarting, exited, gone
	Epoch                                        uint64
	Active                                       []int
	RestartAtMs, WindowMs                        int64
	RefuseList, RefuseActivate, RefuseDeactivate int
	FMUGCodes                                    bool
	Links                                        map[int]int // module -> NVLinks available
	Listen                                       string
	// StaleCode is what a call on a dead connection is answered (0:
	// FM_ST_CONNECTION_NOT_VALID).
	StaleCode int
	extra     []string
}

// FM is one stand-in FM: its state file, named to every process by StateEnv.
type FM struct {
	Path string
}

// New starts a stand-in FM serving (no partition active) and sets StateEnv for the test
// (so the test cannot be parallel) and the processes it starts.
func New(t testing.TB) *FM {
	t.Helper()
	fm := &FM{Path: filepath.Join(t.TempDir(), "fm.state")}
	if err := os.WriteFile(fm.Path, []byte("mode=serving\nepoch=1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(StateEnv, fm.Path)
	return fm
}

// Update changes the state under the stand-in's lock.
func (fm *FM) Update(t testing.TB, change func(*State)) {
	t.Helper()
	if err := fm.locked(func(f *os.File, s *State) (bool, error) {
		change(s)
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
}

// Read is the state now.
func (fm *FM) Read(t testing.TB) State {
	t.Helper()
	var st State
	if err := fm.locked(func(f *os.File, s *State) (bool, error) {
		st = *s
		return false, nil
	}); err != nil {
		t.Fatal(err)
	}
	return st
}

// Active are the partitions active now, sorted.
func (fm *FM) Active(t testing.TB) []int {
	t.Helper()
	a := fm.Read(t).Active
	slices.Sort(a)
	return a
}

// Restart is FM started again with --restart: its connections are no longer valid,
// it answers FM_ST_NOT_CONFIGURED until it is handed the active list, and exits when
// that has not come within window (FM's is 60 s).
func (fm *FM) Restart(t testing.TB, window time.Duration) {
	fm.Update(t, func(s *State) {
		s.Mode, s.Epoch = "restarting", s.Epoch+1
		s.RestartAtMs, s.WindowMs = time.Now().UnixMilli(), window.Milliseconds()
	})
}

// Log is the calls the stand-in answered, one "<call> <argument> = <code>" each.
func (fm *FM) Log(t testing.TB) []string {
	t.Helper()
	b, err := os.ReadFile(fm.Path + ".log")
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

// Calls are the logged calls of kind (activate, deactivate, set_activated, list,
// connect): "activate 4 = 0".
func (fm *FM) Calls(t testing.TB, kind string) []string {
	var out []string
	for _, l := range fm.Log(t) {
		if strings.HasPrefix(l, kind+" ") {
			out = append(out, l)
		}
	}
	return out
}

func (fm *FM) locked(do func(*os.File, *State) (bool, error)) error {
	f, err := os.OpenFile(fm.Path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	b, err := os.ReadFile(fm.Path)
	if err != nil {
		return err
	}
	s, err := parse(b)
	if err != nil {
		return fmt.Errorf("%s: %w", fm.Path, err)
	}
	write, err := do(f, &s)
	if err != nil || !write {
		return err
	}
	out := format(s)
	if _, err := f.WriteAt(out, 0); err != nil {
		return err
	}
	return f.Truncate(int64(len(out)))
}

func parse(b []byte) (State, error) {
	s := State{Mode: "serving", WindowMs: 60000, Links: map[int]int{}}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			continue
		}
		var err error
		switch k {
		case "mode":
			s.Mode = v
		case "epoch":
			s.Epoch, err = strconv.ParseUint(v, 10, 64)
		case "active":
			for _, id := range strings.Split(v, ",") {
				if id == "" {
					continue
				}
				n, perr := strconv.Atoi(id)
				err = perr
				s.Active = append(s.Active, n)
			}
		case "restart_at_ms":
			s.RestartAtMs, err = strconv.ParseInt(v, 10, 64)
		case "window_ms":
			s.WindowMs, err = strconv.ParseInt(v, 10, 64)
		case "refuse_list":
			s.RefuseList, err = strconv.Atoi(v)
		case "refuse_activate":
			s.RefuseActivate, err = strconv.Atoi(v)
		case "refuse_deactivate":
			s.RefuseDeactivate, err = strconv.Atoi(v)
		case "fmug_codes":
			s.FMUGCodes = v == "1"
		case "links":
			for _, ml := range strings.Split(v, ",") {
				if ml == "" {
					continue
				}
				var m, n int
				if _, perr := fmt.Sscanf(ml, "%d:%d", &m, &n); perr != nil {
					err = perr
				}
				s.Links[m] = n
			}
		case "listen":
			s.Listen = v
		case "stale_code":
			s.StaleCode, err = strconv.Atoi(v)
		default:
			s.extra = append(s.extra, line)
		}
		if err != nil {
			return s, fmt.Errorf("%s: %w", line, err)
		}
	}
	return s, nil
}

func format(s State) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "mode=%s\nepoch=%d\nactive=", s.Mode, s.Epoch)
	for i, id := range s.Active {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, id)
	}
	fm := 0
	if s.FMUGCodes {
		fm = 1
	}
	fmt.Fprintf(&b, "\nrestart_at_ms=%d\nwindow_ms=%d\nrefuse_list=%d\nrefuse_activate=%d\nrefuse_deactivate=%d\nfmug_codes=%d\nlinks=",
		s.RestartAtMs, s.WindowMs, s.RefuseList, s.RefuseActivate, s.RefuseDeactivate, fm)
	for i, m := range slices.Sorted(maps.Keys(s.Links)) {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%d:%d", m, s.Links[m])
	}
	fmt.Fprintf(&b, "\nlisten=%s\nstale_code=%d\n", s.Listen, s.StaleCode)
	for _, l := range s.extra {
		b.WriteString(l + "\n")
	}
	return b.Bytes()
}
