// Package stages runs the boot as an ordered list of stages, each with a deadline, and
// keeps what the operator and the hypervisor need to know about each: status, duration,
// findings and changes. It knows nothing about PCIe: the stage list and the domain calls
// live in stages/boot.
//
// Failure policy: a stage that fails (an error, a panic, its deadline) does not stop the
// run. A stage that declares Needs runs only when each of those stages ended ok or
// degraded; otherwise it is skipped with the reason. Work items that a stage covers are
// Units in the shared State, each with its own status, so a later stage can leave a failed
// unit alone (vfio binding excludes it) while the others go on.
package stages

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"
)

// Status is the outcome of a stage or the state of a unit. The order matters: a unit's
// status only gets worse (ok < degraded < failed).
type Status string

const (
	OK       Status = "ok"
	Degraded Status = "degraded"
	Failed   Status = "failed"
	Skipped  Status = "skipped"
)

func (s Status) rank() int {
	switch s {
	case OK:
		return 0
	case Degraded:
		return 1
	case Failed:
		return 2
	}
	return -1
}

// Worse returns the worse of a and b; skipped counts as nothing.
func Worse(a, b Status) Status {
	if b.rank() > a.rank() {
		return b
	}
	return a
}

// Result is what one stage did.
type Result struct {
	Name     string
	Status   Status
	Duration time.Duration
	Findings []string // what the stage observed that an operator should know
	Changes  []string // what the stage changed on the machine
	Err      error    // why the stage failed, or why it was skipped

	// waiting is what the stage said it is waiting on (Wait), shared with the runner so
	// that a stage it abandons is named with what held it.
	waiting *waitNote
}

// waitNote is the one thing a running stage is waiting on; the stage's goroutine writes
// it, the runner reads it on each tick and when the deadline passes.
type waitNote struct {
	mu       sync.Mutex
	what     func() string
	deadline time.Time // the stage's; a wait that ends after it was cut by it and stays named
}

func (w *waitNote) get() string {
	if w == nil {
		return ""
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.what == nil {
		return ""
	}
	return w.what()
}

// Wait records that the stage is now waiting on what (a carrier, a DHCP reply, the
// kernel's random pool, an HTTP response) until done is called. If the stage runs out
// of time meanwhile, its error names what it was waiting on, even when done is called
// on the way out. Waits nest: done restores the outer one.
func (r *Result) Wait(what string) (done func()) {
	return r.WaitOn(func() string { return what })
}

// WaitOn is Wait for a wait whose state changes as it goes (an erase's progress): what
// is asked again on each console tick and when the deadline passes, so it must be safe
// to call from another goroutine. It says "" when there is nothing to show.
func (r *Result) WaitOn(what func() string) (done func()) {
	if r.waiting == nil {
		r.waiting = &waitNote{}
	}
	w := r.waiting
	w.mu.Lock()
	prev := w.what
	w.what = what
	w.mu.Unlock()
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if !w.deadline.IsZero() && !time.Now().Before(w.deadline) {
			return
		}
		w.what = prev
	}
}

// waitingOn is ", waiting for X" when the stage said it was waiting on X, else "".
func waitingOn(w *waitNote) string {
	if what := w.get(); what != "" {
		return ", waiting for " + what
	}
	return ""
}

// Findingf records an observation.
func (r *Result) Findingf(format string, args ...any) {
	r.Findings = append(r.Findings, fmt.Sprintf(format, args...))
}

// Changef records a change made to the machine.
func (r *Result) Changef(format string, args ...any) {
	r.Changes = append(r.Changes, fmt.Sprintf(format, args...))
}

// Degrade marks the stage degraded (unless it is already worse) with a finding saying why.
func (r *Result) Degrade(format string, args ...any) {
	r.Status = Worse(r.Status, Degraded)
	r.Findingf(format, args...)
}

// ResultRecord is a Result as JSON: one "stage" line of log.jsonl. ReadStages reads them
// back (the QEMU tests and the boot benchmark do, from the guest's log).
type ResultRecord struct {
	Type       string   `json:"type"`
	Name       string   `json:"name"`
	Status     Status   `json:"status"`
	DurationMS float64  `json:"duration_ms"`
	Findings   []string `json:"findings,omitempty"`
	Changes    []string `json:"changes,omitempty"`
	Error      string   `json:"error,omitempty"`
}

// ReadStages returns the stage lines of a log.jsonl in the order the stages ran; the
// other lines (units) are passed over. A line that is not JSON is an error naming it.
func ReadStages(r io.Reader) ([]ResultRecord, error) {
	var out []ResultRecord
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		if len(bytes.TrimSpace(sc.Bytes())) == 0 {
			continue
		}
		var rec ResultRecord
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return nil, fmt.Errorf("log line %d: %w", n, err)
		}
		if rec.Type == "stage" {
			out = append(out, rec)
		}
	}
	return out, sc.Err()
}

// MarshalJSON writes the error as text and the duration in milliseconds.
func (r Result) MarshalJSON() ([]byte, error) {
	j := ResultRecord{Type: "stage", Name: r.Name, Status: r.Status,
		DurationMS: float64(r.Duration.Microseconds()) / 1000, Findings: r.Findings, Changes: r.Changes}
	if r.Err != nil {
		j.Error = r.Err.Error()
	}
	return json.Marshal(j)
}

// SkipError makes a stage end as skipped rather than failed.
type SkipError struct{ Reason string }

func (e *SkipError) Error() string { return e.Reason }

// Skip returns an error that ends the stage as skipped with the reason, e.g.
// Skip("passage.url not set").
func Skip(format string, args ...any) error { return &SkipError{Reason: fmt.Sprintf(format, args...)} }

// Stage is one step of the run.
type Stage struct {
	Name string
	// Needs names earlier stages that must have ended ok or degraded for this one to run.
	Needs []string
	// Timeout bounds the stage; zero means the runner's default.
	Timeout time.Duration
	// Always runs the stage even after the run's own context is done (the manifest: the
	// hypervisor must always learn what happened).
	Always bool
	// Run does the work. It fills r's findings and changes, may set r.Status to Degraded,
	// and returns an error to fail (or Skip to skip). It must return when ctx is done; a
	// stage that does not is abandoned (see Runner.Grace).
	Run func(ctx context.Context, st *State, r *Result) error
}

// Unit is one work item several stages cover: on a B300 node, a GPU with its adjacent NIC
// PFs and NVMe. Status only gets worse.
type Unit struct {
	ID      string   `json:"id"`
	GPU     string   `json:"gpu"`                 // BDF
	NICs    []string `json:"nics,omitempty"`      // BDFs of the adjacent NIC PFs
	Members []string `json:"functions,omitempty"` // every passthrough BDF of the unit, GPU and NICs included
	Status  Status   `json:"status"`
	Reasons []string `json:"reasons,omitempty"` // one per degrade or fail, prefixed by the stage
}

// State is what stages share. Units is the list stages mark; domain data (the scanned tree,
// the labels, the plans) belongs to whoever builds the stage list (see stages/boot), not
// here.
type State struct {
	mu      sync.Mutex
	units   []*Unit
	results []Result
}

// Results returns the results of the stages that have finished so far, in order: what the
// manifest stage records.
func (s *State) Results() []Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Result(nil), s.results...)
}

// SetUnits replaces the unit list (the label stage's job). New units start ok.
func (s *State) SetUnits(units []Unit) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.units = s.units[:0]
	for i := range units {
		u := units[i]
		if u.Status == "" {
			u.Status = OK
		}
		s.units = append(s.units, &u)
	}
}

// Units returns a copy of the units, in order.
func (s *State) Units() []Unit {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Unit, len(s.units))
	for i, u := range s.units {
		out[i] = *u
		out[i].NICs = append([]string(nil), u.NICs...)
		out[i].Members = append([]string(nil), u.Members...)
		out[i].Reasons = append([]string(nil), u.Reasons...)
	}
	return out
}

// Eligible returns the units that have not failed: the ones a later stage may still act on.
func (s *State) Eligible() []Unit {
	var out []Unit
	for _, u := range s.Units() {
		if u.Status != Failed {
			out = append(out, u)
		}
	}
	return out
}

// Mark worsens a unit's status to st (never improves it) and records why; a reason the
// unit already holds is not recorded twice. It returns an
// error for an unknown unit so a stage cannot silently mark nothing.
func (s *State) Mark(id string, st Status, reason string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, u := range s.units {
		if u.ID == id {
			u.Status = Worse(u.Status, st)
			if reason != "" && !slices.Contains(u.Reasons, reason) {
				u.Reasons = append(u.Reasons, reason)
			}
			return nil
		}
	}
	return fmt.Errorf("unit %s: no such unit", id)
}

// UnitOf returns the ID of the unit holding function bdf.
func (s *State) UnitOf(bdf string) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, u := range s.units {
		if u.GPU == bdf {
			return u.ID, true
		}
		for _, m := range append(u.NICs, u.Members...) {
			if m == bdf {
				return u.ID, true
			}
		}
	}
	return "", false
}

// Runner runs stages in order.
type Runner struct {
	Stages []Stage
	// Timeout is the deadline of a stage without its own.
	Timeout time.Duration
	// Grace is how long the runner waits past a stage's deadline for it to return before
	// abandoning it as failed; the boot must go on even if a stage ignores its context.
	Grace time.Duration
	// Console gets one line per stage as it ends, and, while a stage has been waiting
	// on something (Result.Wait) for Tick or longer, a "still waiting" line every Tick,
	// as systemd shows a start job. Nil: no console output.
	Console io.Writer
	// Tick is how often a waiting stage is shown; 0 is 5 s.
	Tick time.Duration
	// Verbose prints each stage's whole error on the console, not its first line only
	// (passage.debug).
	Verbose bool
	// Log gets each result as a JSON line as the stage ends. Nil: no log.
	Log io.Writer
	// Now is the clock; nil is time.Now.
	Now func() time.Time
}

// Validate checks names are unique and Needs refer to earlier stages.
func (rn *Runner) Validate() error {
	seen := map[string]bool{}
	for i, s := range rn.Stages {
		if s.Name == "" {
			return fmt.Errorf("stage %d: no name", i)
		}
		if s.Run == nil {
			return fmt.Errorf("stage %s: no Run", s.Name)
		}
		if seen[s.Name] {
			return fmt.Errorf("stage %s: defined twice", s.Name)
		}
		for _, n := range s.Needs {
			if !seen[n] {
				return fmt.Errorf("stage %s: needs %s, which is not an earlier stage", s.Name, n)
			}
		}
		seen[s.Name] = true
	}
	return nil
}

func (rn *Runner) now() time.Time {
	if rn.Now != nil {
		return rn.Now()
	}
	return time.Now()
}

// Run runs every stage in order and returns their results. It returns an error only for an
// invalid stage list (before running anything); stage failures are in the results.
func (rn *Runner) Run(ctx context.Context, st *State) ([]Result, error) {
	if err := rn.Validate(); err != nil {
		return nil, err
	}
	var results []Result
	byName := map[string]Status{}
	for _, s := range rn.Stages {
		r := rn.runOne(ctx, st, s, byName)
		byName[s.Name] = r.Status
		results = append(results, r)
		st.mu.Lock()
		st.results = append(st.results, r)
		st.mu.Unlock()
		rn.report(r)
	}
	return results, nil
}

func (rn *Runner) runOne(ctx context.Context, st *State, s Stage, done map[string]Status) Result {
	for _, n := range s.Needs {
		if ds := done[n]; ds != OK && ds != Degraded {
			return Result{Name: s.Name, Status: Skipped, Err: fmt.Errorf("needs %s, which %s", n, ds)}
		}
	}
	if ctx.Err() != nil && !s.Always {
		return Result{Name: s.Name, Status: Skipped, Err: fmt.Errorf("run stopped before this stage: %w", ctx.Err())}
	}
	parent := ctx
	if s.Always {
		parent = context.WithoutCancel(ctx)
	}
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = rn.Timeout
	}
	if timeout <= 0 {
		timeout = time.Minute
	}
	sctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()

	start := rn.now()
	done1 := make(chan Result, 1)
	wn := &waitNote{}
	wn.deadline, _ = sctx.Deadline()
	go func() {
		r := Result{Name: s.Name, Status: OK, waiting: wn}
		defer func() {
			if p := recover(); p != nil {
				r.Status = Failed
				r.Err = fmt.Errorf("panic: %v\n%s", p, firstFrames(debug.Stack(), 12))
			}
			done1 <- r
		}()
		err := s.Run(sctx, st, &r)
		var skip *SkipError
		switch {
		case errors.As(err, &skip):
			r.Status = Skipped
			r.Err = err
		case err != nil:
			r.Status = Failed
			r.Err = err
			if w := waitingOn(wn); w != "" && sctx.Err() != nil && parent.Err() == nil {
				r.Err = fmt.Errorf("%w (deadline %v exceeded%s)", err, timeout, w)
			}
		case sctx.Err() != nil && parent.Err() == nil:
			// The stage returned without noticing its deadline: what it did may be partial.
			r.Status = Failed
			r.Err = fmt.Errorf("deadline %v exceeded%s: %w", timeout, waitingOn(wn), sctx.Err())
		case r.Status == "":
			r.Status = OK
		}
		r.Name = s.Name
	}()

	grace := rn.Grace
	if grace <= 0 {
		grace = 2 * time.Second
	}
	var tick <-chan time.Time
	if rn.Console != nil {
		every := rn.Tick
		if every <= 0 {
			every = 5 * time.Second
		}
		t := time.NewTicker(every)
		defer t.Stop()
		tick = t.C
	}
	var r Result
wait:
	for {
		select {
		case r = <-done1:
			break wait
		case <-tick:
			if what := wn.get(); what != "" {
				fmt.Fprintf(rn.Console, "passage: %s: still waiting for %s (%s of %v)\n", s.Name, oneLine(what), fmtDuration(rn.now().Sub(start)), timeout)
			}
		case <-sctx.Done():
			select {
			case r = <-done1:
			case <-time.After(grace):
				r = Result{Name: s.Name, Status: Failed,
					Err: fmt.Errorf("deadline %v exceeded%s, and the stage did not return within %v: abandoned", timeout, waitingOn(wn), grace)}
			}
			break wait
		}
	}
	if r.Status == Failed && r.Err == nil {
		r.Err = errors.New("failed")
	}
	r.Duration = rn.now().Sub(start)
	return r
}

// firstFrames keeps a panic's stack short enough for a console and a manifest.
func firstFrames(stack []byte, lines int) string {
	ls := strings.Split(strings.TrimSpace(string(stack)), "\n")
	if len(ls) > lines {
		ls = ls[:lines]
	}
	return strings.Join(ls, "\n")
}

func (rn *Runner) report(r Result) {
	if rn.Console != nil {
		io.WriteString(rn.Console, stageLine(r, rn.Verbose))
	}
	if rn.Log != nil {
		b, err := json.Marshal(r)
		if err == nil {
			rn.Log.Write(append(b, '\n'))
		}
	}
}

// Summary is the status of the whole run: the worst of every stage and every unit.
// Skipped stages count as nothing.
func Summary(results []Result, units []Unit) Status {
	s := OK
	for _, r := range results {
		s = Worse(s, r.Status)
	}
	for _, u := range units {
		s = Worse(s, u.Status)
	}
	return s
}
