package manifest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestGenerationLockHelper is not a test: TestGenerationLockAcrossProcesses runs the test
// binary again with it, as the other process holding the lock.
func TestGenerationLockHelper(t *testing.T) {
	dir := os.Getenv("PASSAGE_GENLOCK_DIR")
	if dir == "" {
		t.Skip("run by TestGenerationLockAcrossProcesses")
	}
	l, err := LockGenerations(context.Background(), dir, "passage recycle gpu3", time.Minute)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("held")
	io.Copy(io.Discard, os.Stdin) // until the parent closes it
	l.Unlock()
	os.Exit(0)
}

// TestGenerationLockAcrossProcesses: a generation lock held by another process is not
// had; the wait is bounded and its error names the holder (pid and what it does). Once
// that process lets go, it is.
func TestGenerationLockAcrossProcesses(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestGenerationLockHelper$")
	cmd.Env = append(os.Environ(), "PASSAGE_GENLOCK_DIR="+dir)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "held\n" {
		t.Fatalf("helper: %q, %v", line, err)
	}
	_, err = LockGenerations(context.Background(), dir, "passage-dra turnaround gpu1", 50*time.Millisecond)
	want := fmt.Sprintf("held by pid %d (", cmd.Process.Pid)
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "passage recycle gpu3 since ") {
		t.Fatalf("lock held by another process: err %v; want ErrLocked naming %q and what it does", err, want)
	}
	stdin.Close()
	l, err := LockGenerations(context.Background(), dir, "passage-dra turnaround gpu1", time.Minute)
	if err != nil {
		t.Fatalf("after the holder let go: %v", err)
	}
	if b, _ := os.ReadFile(dir + "/" + GenerationLockName); !strings.Contains(string(b), fmt.Sprintf("pid %d ", os.Getpid())) {
		t.Errorf("lock file says %q, want this process", b)
	}
	l.Unlock()
}

// TestGenerationLockOpenFileDescriptions: two holders in one process, each with its own
// open of the file, exclude each other as two processes do; a cancelled context ends
// the wait with its error.
func TestGenerationLockOpenFileDescriptions(t *testing.T) {
	dir := t.TempDir()
	a, err := LockGenerations(context.Background(), dir, "a", 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := LockGenerations(context.Background(), dir, "b", 20*time.Millisecond); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), " a since ") {
		t.Errorf("second holder while the first holds: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := LockGenerations(ctx, dir, "c", time.Minute); !errors.Is(err, context.Canceled) || !errors.Is(err, ErrLocked) {
		t.Errorf("cancelled wait: %v", err)
	}
	a.Unlock()
	b, err := LockGenerations(context.Background(), dir, "b", 0)
	if err != nil {
		t.Fatalf("after the first let go: %v", err)
	}
	b.Unlock()
	if err := b.Unlock(); err != nil {
		t.Errorf("second Unlock: %v", err)
	}
}
