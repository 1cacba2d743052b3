package manifest_test

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// writerEnv makes the test binary a manifest writer instead of running tests: the kill
// test re-executes itself with it set and SIGKILLs the child mid-write.
const writerEnv = "PASSAGE_MANIFEST_WRITER_DIR"

func TestMain(m *testing.M) {
	if dir := os.Getenv(writerEnv); dir != "" {
		os.Exit(writerChild(dir))
	}
	os.Exit(m.Run())
}

// writerChild writes signed manifests into dir forever, each with the next generation
// from a file counter in dir and a size that changes with the generation (so a torn
// write would show as a truncated or spliced file), printing "ready" after the first.
func writerChild(dir string) int {
	s, err := NewEd25519Signer(testKey(1))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	counter := FileCounter{Path: filepath.Join(dir, "generation")}
	m := manifesttest.B300(0)
	for i := 0; ; i++ {
		gen, src, err := NextGeneration(counter)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 3
		}
		m.Generation, m.GenerationSource = gen, src
		m.Errors = []string{strings.Repeat("x", int(gen%97)*40)}
		if _, err := WriteSigned(context.Background(), m, dir, "manifest.dsse.json", nil, s); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 3
		}
		if i == 0 {
			fmt.Println("ready")
		}
	}
}

// A SIGKILL at any point of a write leaves the previous manifest or the new one, each
// complete and verifying, and generations never go backwards. (SIGKILL keeps the page
// cache; the fsyncs that cover a power cut cannot be shown without one.)
func TestKillDuringWrite(t *testing.T) {
	dir := t.TempDir()
	v := testVerifier(t, 1)
	rng := rand.New(rand.NewPCG(1, 2))
	var lastGen uint64
	advanced := 0
	for iter := 0; iter < 30; iter++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), writerEnv+"="+dir)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil || line != "ready\n" {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("iteration %d: writer said %q, %v; stderr: %s", iter, line, err, stderr.String())
		}
		time.Sleep(time.Duration(rng.IntN(20_000)) * time.Microsecond)
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		err = cmd.Wait()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
			t.Fatalf("iteration %d: writer ended with %v, not by SIGKILL; stderr: %s", iter, err, stderr.String())
		}

		env, err := os.ReadFile(filepath.Join(dir, "manifest.dsse.json"))
		if err != nil {
			t.Fatal(err)
		}
		got, err := Verify(env, v, VerifyOptions{MinGeneration: lastGen})
		if err != nil {
			t.Fatalf("iteration %d: manifest after SIGKILL: %v", iter, err)
		}
		if got.Manifest.Generation > lastGen+1 {
			advanced++
		}
		lastGen = got.Manifest.Generation
		// The counter file is never torn either, and is never behind the manifest.
		n, err := FileCounter{Path: filepath.Join(dir, "generation")}.Next()
		if err != nil {
			t.Fatalf("iteration %d: counter after SIGKILL: %v", iter, err)
		}
		if n <= lastGen {
			t.Fatalf("iteration %d: counter gave %d, manifest already at %d", iter, n, lastGen)
		}
	}
	if advanced == 0 {
		t.Error("the writer never got past its first manifest before the kill: nothing was tested mid-write")
	}
	leftovers, _ := filepath.Glob(filepath.Join(dir, ".manifest.dsse.json.tmp*"))
	t.Logf("30 kills, last generation %d, %d iterations killed after several writes, %d kills left a temp file", lastGen, advanced, len(leftovers))
	// The next complete write sweeps what the killed writers left.
	if err := WriteAtomic(dir, "manifest.dsse.json", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".manifest.dsse.json.tmp*")); len(left) != 0 {
		t.Errorf("%d temp files left after a complete write", len(left))
	}
}
