package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/passage-boot/passage/bench"
	qemutest "github.com/passage-boot/passage/qemu-tests"
	"github.com/passage-boot/passage/stages"
)

// The stage's own time excludes module loading (a node's image decides what that costs,
// not passage): the whole modules stage (the vfio stack), and in the host stage the
// loads it reports ("module e1000e loaded (145.91ms)"), not the rest of that stage (the
// early link-up is passage's and stays in).
var moduleLoaded = regexp.MustCompile(`^module \S+ loaded \(([^)]+)\)$`)

type bootTimes struct {
	uinit, manifest, handoff float64 // guest seconds since kernel start
	modules                  float64 // seconds loading modules (see moduleLoaded)
	stages                   map[string]float64
	wall                     time.Duration
}

// stageDurations reads log.jsonl's stage lines: {"type":"stage","name":..,"duration_ms":..}.
func stageDurations(log []byte) (durations map[string]float64, modules float64, err error) {
	recs, err := stages.ReadStages(bytes.NewReader(log))
	if err != nil {
		return nil, 0, fmt.Errorf("log.jsonl: %w", err)
	}
	out := map[string]float64{}
	for _, l := range recs {
		out[l.Name] += l.DurationMS / 1e3
		switch l.Name {
		case "modules":
			modules += l.DurationMS / 1e3
		case "host":
			for _, c := range l.Changes {
				if m := moduleLoaded.FindStringSubmatch(c); m != nil {
					d, err := time.ParseDuration(m[1])
					if err != nil {
						return nil, 0, fmt.Errorf("log.jsonl: host change %q: %w", c, err)
					}
					modules += d.Seconds()
				}
			}
		}
	}
	return out, modules, nil
}

func rowBoot(e *env, t *table, w io.Writer, boots int) error {
	build, err := filepath.Abs(e.build)
	if err != nil {
		return err
	}
	var runs []bootTimes
	var failures []string
	// A boot that fails is retried (up to boots more attempts) and counted: the row is
	// about time, and the failure is reported beside it rather than hiding the figures.
	for i := 0; len(runs) < boots && i < 2*boots; i++ {
		work := filepath.Join(e.scratch, fmt.Sprintf("boot-%d", i))
		if err := os.MkdirAll(work, 0o755); err != nil {
			return err
		}
		r, err := qemutest.Boot(context.Background(), qemutest.Options{Build: build, WorkDir: work})
		if err == nil && r.Done != "ok" && r.Done != "degraded" {
			err = fmt.Errorf("guest reported %q", r.Done)
		}
		if err != nil {
			kept := keepConsole(e, work, i)
			failures = append(failures, fmt.Sprintf("boot %d: %v (console kept at %s)", i+1, err, kept))
			fmt.Fprintf(e.log, "bench: boot %d failed: %v\n", i+1, err)
			continue
		}
		bt := bootTimes{wall: r.WallDone}
		for _, m := range []struct {
			name string
			dst  *float64
		}{{"uinit-start", &bt.uinit}, {"manifest-written", &bt.manifest}, {"handoff", &bt.handoff}} {
			v, ok := r.Markers[m.name]
			if !ok {
				return fmt.Errorf("boot %d: no %s marker", i+1, m.name)
			}
			*m.dst = v
		}
		log, ok := r.Files["log.jsonl"]
		if !ok {
			return fmt.Errorf("boot %d: no log.jsonl from the guest", i+1)
		}
		if bt.stages, bt.modules, err = stageDurations(log); err != nil {
			return fmt.Errorf("boot %d: %w", i+1, err)
		}
		runs = append(runs, bt)
		fmt.Fprintf(e.log, "bench: boot %d: uinit %.2fs manifest %.2fs handoff %.2fs (modules %.2fs)\n",
			i+1, bt.uinit, bt.manifest, bt.handoff, bt.modules)
	}
	if len(runs) < boots {
		return fmt.Errorf("%d of %d boots finished: %s", len(runs), boots, strings.Join(failures, "; "))
	}
	med := func(f func(b bootTimes) float64) time.Duration {
		var ds []time.Duration
		for _, r := range runs {
			ds = append(ds, time.Duration(f(r)*float64(time.Second)))
		}
		return bench.Median(ds)
	}
	in := fmt.Sprintf("QEMU TCG, 2 units, median of %d boots", len(runs))
	if len(failures) > 0 {
		in += fmt.Sprintf(" (%d failed boots retried)", len(failures))
	}
	add := func(id, what string, d time.Duration, note string) {
		t.add(row{id: id, what: what, input: in, passage: dur(d), note: note})
	}
	add("7a", "boot: kernel start -> uinit start", med(func(b bootTimes) float64 { return b.uinit }), "firmware + kernel init + u-root init (guest clock)")
	add("7b", "boot: uinit start -> manifest written", med(func(b bootTimes) float64 { return b.manifest - b.uinit }),
		fmt.Sprintf("module loading %s of it", dur(med(func(b bootTimes) float64 { return b.modules }))))
	own := med(func(b bootTimes) float64 { return b.manifest - b.uinit - b.modules })
	add("7c", "boot: passage's own time (7b minus module loading)", own, "scan, decide, ACS, vfio bind, manifest")
	netStage := med(func(b bootTimes) float64 { return b.stages["network"] })
	add("7d", "boot: manifest written -> handoff", med(func(b bootTimes) float64 { return b.handoff - b.manifest }),
		fmt.Sprintf("network stage (management NIC carrier + DHCP, after the manifest) %s of it", dur(netStage)))
	add("7e", "boot: kernel start -> handoff", med(func(b bootTimes) float64 { return b.handoff }),
		fmt.Sprintf("host wall time QEMU start -> PASSAGE-DONE %s", dur(med(func(b bootTimes) float64 { return b.wall.Seconds() }))))
	t.target(own < time.Second, "stage's own time in the QEMU boot (uinit -> manifest written, module loading excluded) < 1 s: %s "+
		"(the network stage, %s, follows the manifest)", dur(own), dur(netStage))

	names := map[string]bool{}
	for _, r := range runs {
		for n := range r.stages {
			names[n] = true
		}
	}
	var sorted []string
	for n := range names {
		sorted = append(sorted, n)
	}
	sort.Strings(sorted)
	fmt.Fprintf(w, "## Boot (row 7)\n\nPer stage, from the guest's log.jsonl, median of %d boots (TCG: emulated CPU, far slower than a node's):\n\n| stage | median |\n|---|---|\n", len(runs))
	for _, n := range sorted {
		d := med(func(b bootTimes) float64 { return b.stages[n] })
		mark := ""
		switch n {
		case "modules":
			mark = " (module loading)"
		case "host":
			mark = " (module loading, then the early link-up)"
		}
		fmt.Fprintf(w, "| %s%s | %s |\n", n, mark, dur(d))
	}
	fmt.Fprintf(w, "| module loading in all (excluded from 7c) | %s |\n", dur(med(func(b bootTimes) float64 { return b.modules })))
	for _, f := range failures {
		fmt.Fprintf(w, "\nFailed and retried: %s\n", f)
	}
	fmt.Fprintf(w, "\nMarkers per boot (s since kernel start): %s\n\n", strings.Join(func() []string {
		var s []string
		for _, r := range runs {
			s = append(s, fmt.Sprintf("uinit %.2f / manifest %.2f / handoff %.2f", r.uinit, r.manifest, r.handoff))
		}
		return s
	}(), "; "))
	return nil
}

// keepConsole copies a failed boot's console log into the build dir, since the scratch
// dir goes when the run ends.
func keepConsole(e *env, work string, i int) string {
	b, err := os.ReadFile(filepath.Join(work, "console.log"))
	if err != nil {
		return "(none)"
	}
	dst := filepath.Join(e.build, fmt.Sprintf("bench-boot-failed-%d.console.log", i+1))
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		return "(not kept: " + err.Error() + ")"
	}
	return dst
}
