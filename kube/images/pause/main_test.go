package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// pauseBin is pause as make images builds it (CGO_ENABLED=0, never -race): the program
// the image carries is what is tested, not this test binary. (Run as pause under
// -race, the test binary left the orphan a zombie, most likely because it started so
// slowly that the orphan exited before it asked for SIGCHLD: pause now also reaps once
// at its start.)
var pauseBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pause")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pauseBin = filepath.Join(dir, "pause")
	build := exec.Command("go", "build", "-o", pauseBin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build pause: %v\n%s", err, b)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// start runs pause, in a PID namespace of its own if pidns (it is then PID 1, as in a
// pod's sandbox). Its output goes to a file, read as it grows: written by the process
// itself, not by a goroutine of the test's.
func start(t *testing.T, pidns bool, args ...string) (*exec.Cmd, *output) {
	t.Helper()
	cmd := exec.Command(pauseBin, args...)
	f, err := os.CreateTemp(t.TempDir(), "pause.out")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd.Stdout, cmd.Stderr = f, f
	if pidns {
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start pause: %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, &output{t, f.Name()}
}

type output struct {
	t    *testing.T
	path string
}

func (o *output) String() string {
	b, err := os.ReadFile(o.path)
	if err != nil {
		o.t.Fatal(err)
	}
	return string(b)
}

// exitWithin is the exit code of cmd, which must end within d.
func exitWithin(t *testing.T, cmd *exec.Cmd, d time.Duration) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	case <-time.After(d):
		t.Fatalf("pause still running after %v", d)
		return -1
	}
}

// children are the processes whose parent is pid, with their state (R, S, Z, ...).
func children(t *testing.T, pid int) map[int]string {
	t.Helper()
	kids := map[int]string{}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "status"))
		if err != nil {
			continue // gone since the listing
		}
		var state string
		var ppid int
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "State:"); ok {
				state = strings.Fields(v)[0]
			}
			if v, ok := strings.CutPrefix(l, "PPid:"); ok {
				ppid, _ = strconv.Atoi(strings.TrimSpace(v))
			}
		}
		if ppid == pid {
			kids[n] = state
		}
	}
	return kids
}

// TestReapsAndStops: pause as PID 1 of a PID namespace, as in a pod. A process started in
// the namespace whose parent exits becomes pause's child; when it exits, pause reaps it
// (no zombie stays). SIGTERM and SIGINT each end pause with status 0.
func TestReapsAndStops(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatalf("a PID namespace needs root (uid %d)", os.Geteuid())
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		t.Fatalf("nsenter (util-linux): %v", err)
	}
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			cmd, out := start(t, true)
			pid := cmd.Process.Pid
			// sh runs in pause's namespace (nsenter forks into it) and leaves a cat behind:
			// the orphan is the namespace's init's, pause's. cat waits on a FIFO until the
			// test opens and closes it, then exits.
			fifo := filepath.Join(t.TempDir(), "fifo")
			if err := syscall.Mkfifo(fifo, 0o600); err != nil {
				t.Fatal(err)
			}
			// cat's output is not nsenter's: CombinedOutput waits for every writer of its pipe.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ns := exec.CommandContext(ctx, nsenter, "-t", strconv.Itoa(pid), "-p", "--", "sh", "-c", "cat "+fifo+" </dev/null >/dev/null 2>&1 & exit 0")
			ns.WaitDelay = 5 * time.Second
			if b, err := ns.CombinedOutput(); err != nil {
				t.Fatalf("nsenter: %v\n%s", err, b)
			}
			adopted := children(t, pid)
			if len(adopted) != 1 {
				t.Fatalf("pause (pid %d) has children %v, want the orphaned cat", pid, adopted)
			}
			// Without a reader yet, a non-blocking open for writing fails (ENXIO).
			deadline := time.Now().Add(10 * time.Second)
			for {
				w, err := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0)
				if err == nil {
					w.Close()
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the orphaned cat never opened its FIFO: %v", err)
				}
				time.Sleep(20 * time.Millisecond)
			}
			for len(children(t, pid)) > 0 {
				if time.Now().After(deadline) {
					t.Fatalf("pause's children after the orphan exited: %v (Z: not reaped)\n%s", children(t, pid), out)
				}
				time.Sleep(20 * time.Millisecond)
			}
			if err := cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			if code := exitWithin(t, cmd, 10*time.Second); code != 0 {
				t.Errorf("after %v: exit %d, want 0\n%s", sig, code, out)
			}
			if strings.Contains(out.String(), "Warning") || !strings.Contains(out.String(), "Shutting down, got signal: "+sig.String()) {
				t.Errorf("output:\n%s", out)
			}
		})
	}
}

// TestNotPID1: outside a PID namespace pause warns, as pause.c does, and still stops on
// SIGTERM; -v prints the version.
func TestNotPID1(t *testing.T) {
	cmd, out := start(t, false)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(out.String(), "Warning: pause should be the first process") {
		if time.Now().After(deadline) {
			t.Fatalf("no warning: %q", out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := exitWithin(t, cmd, 10*time.Second); code != 0 {
		t.Errorf("exit %d\n%s", code, out)
	}
	cmd, out = start(t, false, "-v")
	if code := exitWithin(t, cmd, 10*time.Second); code != 0 || out.String() != version+"\n" {
		t.Errorf("pause -v: exit %d, %q", code, out)
	}
}
