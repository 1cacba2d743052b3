//go:build qemu

package qemutest

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/passage-boot/passage/stages"
)

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
						b.ReportMetric(r.DurationMS/1e3, "modules-stage-s")
						found = true
					}
				}
				if !found {
					b.Fatal("no modules stage in log.jsonl")
				}
				b.ReportMetric(run.Markers["uinit-start"], "kernel-to-uinit-s")
			}
		})
	}
}
