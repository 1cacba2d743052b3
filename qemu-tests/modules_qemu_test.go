//go:build qemu

package qemutest

import (
	"bytes"
	"context"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/passage-boot/passage/stages"
)

// moduleLoaded is a module load the modules stage reports: "module vfio loaded (52.6ms)".
var moduleLoaded = regexp.MustCompile(`^module \S+ loaded \(([^)]+)\)$`)

// BenchmarkModulesStage is the boot's modules stage (the vfio stack, loaded before
// anything can claim a passthrough device) on each kernel the suite boots: 6.1's plain
// .ko and 6.12's .ko.xz, which the image carries decompressed with a modules.dep
// (image/modsel), so the guest neither decompresses nor reads a module to order them.
// It reports the stage's duration from log.jsonl and the kernel's time to the uinit.
// Run with: make qemu-bench (or -bench ModulesStage -benchtime 3x).
func BenchmarkModulesStage(b *testing.B) {
	for _, k := range []string{"6.12", "6.1"} {
		b.Run("kernel="+k, func(b *testing.B) {
			build := kernelBuild(b, k)
			var stage, uinit, loads float64
			n := 0
			for b.Loop() {
				run, err := Boot(context.Background(), Options{Build: build, Name: b.Name(), WorkDir: filepath.Join(b.TempDir(), "work"),
					Timeout: 4 * time.Minute, Append: []string{"passage.net=off"}})
				if err != nil {
					b.Fatal(err)
				}
				recs, err := stages.ReadStages(bytes.NewReader(run.Files["log.jsonl"]))
				if err != nil {
					b.Fatalf("log.jsonl: %v", err)
				}
				found := false
				for _, r := range recs {
					if r.Name == "modules" {
						if r.Status != "ok" {
							b.Fatalf("modules stage %s: %s %v", r.Status, r.Error, r.Findings)
						}
						stage += r.DurationMS / 1e3
						for _, c := range r.Changes {
							if m := moduleLoaded.FindStringSubmatch(c); m != nil {
								d, err := time.ParseDuration(m[1])
								if err != nil {
									b.Fatalf("modules stage change %q: %v", c, err)
								}
								loads += d.Seconds()
							}
						}
						found = true
					}
				}
				if !found {
					b.Fatalf("no modules stage in log.jsonl (PASSAGE-DONE %q); the console's end:\n%s", run.Done, consoleTail(run.Console, 40))
				}
				uinit += run.Markers["uinit-start"]
				n++
			}
			// Means over the boots: the stage, the kernel's own loads within it (what
			// finit_module took), and the kernel's time to the uinit.
			b.ReportMetric(stage/float64(n), "modules-stage-s")
			b.ReportMetric(loads/float64(n), "module-loads-s")
			b.ReportMetric(uinit/float64(n), "kernel-to-uinit-s")
		})
	}
}
