// Command benchtable measures passage against the tools an operator would otherwise run
// (lspci, setpci, bench/acs-plan.sh) on the same synthetic sysfs trees, alternating the
// sides and keeping each side's median, and prints one table; with -out it also writes
// the table and the details behind it as Markdown (build/bench.md). `make bench` runs
// it through bench/run.sh.
//
//	benchtable -passage build/passage [-rounds 11] [-build build] [-boot=false] [-out build/bench.md]
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/passage-boot/passage/bench"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// env is what every row needs.
type env struct {
	passage string   // the passage binary the process sides run
	floor   []string // row O3: a static Go program doing nothing, and one linking passage's imports (bench/run.sh builds both)
	script  string   // acs-plan.sh
	rounds  int
	build   string // build dir holding initramfs.cpio.gz, kernel/ (image and boot rows)
	scratch string // trees live here (tmpfs when there is one)
	log     io.Writer
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("benchtable", flag.ContinueOnError)
	fs.SetOutput(stderr)
	passage := fs.String("passage", "", "passage binary for the process sides (required)")
	script := fs.String("script", bench.ScriptPath(), "the lspci/setpci baseline script")
	rounds := fs.Int("rounds", 11, "timed runs per side (alternating); the median is reported")
	floor := fs.String("floor", "", "row O3's start-up floors, `EMPTY,DEPS`: a static Go program doing nothing, and one linking every package cmd/passage imports (bench/run.sh builds both)")
	build := fs.String("build", "build", "build dir with initramfs.cpio.gz and kernel/ for the image and boot rows")
	boot := fs.Bool("boot", true, "boot the image under QEMU 3 times for the boot row (about 15 s a boot)")
	boots := fs.Int("boots", 3, "boots for the boot row")
	out := fs.String("out", "", "also write the table and details as Markdown to `FILE`")
	only := fs.String("rows", "", "run only these rows (comma-separated: scan,oracle,plan,names,apply,scaling,floor,manifest,image,boot)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *passage == "" || fs.NArg() > 0 || *rounds < 1 {
		fmt.Fprintln(stderr, "usage: benchtable -passage BIN [-rounds N] [-build DIR] [-boot=false] [-out FILE]")
		return 2
	}
	for _, tool := range []string{"lspci", "setpci", "bash"} {
		if _, err := exec.LookPath(tool); err != nil {
			fmt.Fprintf(stderr, "benchtable: %s: %v (make deps installs pciutils)\n", tool, err)
			return 2
		}
	}
	abs, err := filepath.Abs(*passage)
	if err != nil {
		fmt.Fprintf(stderr, "benchtable: %v\n", err)
		return 2
	}
	scratch, err := bench.ScratchDir("passage-bench-")
	if err != nil {
		fmt.Fprintf(stderr, "benchtable: %v\n", err)
		return 2
	}
	defer os.RemoveAll(scratch)
	e := &env{passage: abs, script: *script, rounds: *rounds, build: *build, scratch: scratch, log: stderr}
	if *floor != "" {
		if e.floor = strings.Split(*floor, ","); len(e.floor) != 2 {
			fmt.Fprintf(stderr, "benchtable: -floor %q: want EMPTY,DEPS\n", *floor)
			return 2
		}
	}

	var t table
	var details bytes.Buffer
	start := time.Now()
	loadBefore := loadAverage()
	steps := []struct {
		name string
		fn   func(*env, *table, io.Writer) error
	}{
		{"scan", rowScan},
		{"oracle", rowOracle},
		{"plan", rowPlan},
		{"names", rowNames},
		{"apply", rowApply},
		{"scaling", rowScaling},
		{"floor", rowFloor},
		{"manifest", rowManifest},
		{"image", rowImage},
	}
	if *boot {
		steps = append(steps, struct {
			name string
			fn   func(*env, *table, io.Writer) error
		}{"boot", func(e *env, t *table, w io.Writer) error { return rowBoot(e, t, w, *boots) }})
	}
	if *only != "" {
		want := map[string]bool{}
		for _, r := range strings.Split(*only, ",") {
			want[strings.TrimSpace(r)] = true
		}
		kept := steps[:0]
		for _, s := range steps {
			if want[s.name] {
				kept = append(kept, s)
				delete(want, s.name)
			}
		}
		if len(want) > 0 || len(kept) == 0 {
			fmt.Fprintf(stderr, "benchtable: -rows %q: unknown or skipped rows\n", *only)
			return 2
		}
		steps = kept
	}
	failed := false
	for _, s := range steps {
		t0 := time.Now()
		fmt.Fprintf(stderr, "bench: %s ...\n", s.name)
		if err := s.fn(e, &t, &details); err != nil {
			// A row that cannot run is reported in the table, and the run fails at the end:
			// a missing figure must not read as a met target.
			fmt.Fprintf(stderr, "bench: %s: %v\n", s.name, err)
			t.add(row{id: s.name, what: s.name + " (did not run)", note: err.Error()})
			failed = true
		}
		fmt.Fprintf(stderr, "bench: %s done in %.1fs\n", s.name, time.Since(t0).Seconds())
	}
	if !*boot && *only == "" {
		t.add(row{id: "7", what: "boot (QEMU)", note: "skipped (-boot=false)"})
	}

	var doc bytes.Buffer
	fmt.Fprintf(&doc, "# passage benchmarks\n\n")
	fmt.Fprintf(&doc, "Produced by `make bench` (bench/run.sh -> bench/cmd/benchtable) on %s: %d CPUs, %s, %s; "+
		"%d alternating runs per side, medians; ratio = baseline / passage (higher is better for passage). "+
		"Trees on %s. Total run %.0f s; 1-minute load average %s at the start, %s at the end "+
		"(above the CPU count, other work shared the machine and every figure is slower for it).\n\n",
		time.Now().UTC().Format("2006-01-02"), runtime.NumCPU(), runtime.Version(), toolVersion("lspci", "--version"),
		e.rounds, fsKind(scratch), time.Since(start).Seconds(), loadBefore, loadAverage())
	t.markdown(&doc)
	fmt.Fprintf(&doc, "\n## Targets\n\n")
	for _, tg := range t.targets {
		fmt.Fprintf(&doc, "- %s\n", tg)
	}
	doc.WriteString("\n")
	doc.Write(details.Bytes())

	t.text(stdout)
	fmt.Fprintln(stdout, "\ntargets:")
	for _, tg := range t.targets {
		fmt.Fprintf(stdout, "  %s\n", tg)
	}
	if *out != "" {
		if err := os.WriteFile(*out, doc.Bytes(), 0o644); err != nil {
			fmt.Fprintf(stderr, "benchtable: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "\nwritten: %s\n", *out)
	}
	if failed {
		return 1
	}
	return 0
}

func toolVersion(name string, args ...string) string {
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		return name + " (version unknown)"
	}
	return strings.TrimSpace(string(out))
}

func fsKind(dir string) string {
	if strings.HasPrefix(dir, "/dev/shm/") {
		return "tmpfs (/dev/shm)"
	}
	return "the temp dir"
}

// loadAverage is /proc/loadavg's 1-minute figure, or "unknown".
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) > 0 {
		return f[0]
	}
	return "unknown"
}
