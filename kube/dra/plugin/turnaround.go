package plugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// TaintQuarantined is the NoSchedule taint on the devices of a quarantined unit in the
// plugin's own slices; its value is the step that failed last (erase, reset, recycle,
// attest, verify; fabric: its NVLink partition not deactivated), the Node's Event the
// whole evidence.
const TaintQuarantined = resources.DriverName + "/quarantined"

// ClearAnnotation on the plugin's Node clears quarantines: its value is the units
// (gpu3, or gpu1,gpu3, or "all"), each recycled again from its first try. The plugin
// removes the annotation once it has acted on it.
//
//	kubectl annotate node NODE passage-boot.github.io/unquarantine=gpu3
const ClearAnnotation = resources.DriverName + "/unquarantine"

// Turnaround is how the plugin recycles the units it withholds, with no one running a
// command: once nothing holds a released unit's VFIO group or device cdev open, it runs
// the recycle passage recycle runs (package recycle, in process), then GETs a nonce from
// the control plane, quotes the newest generation over it and POSTs envelope and
// attestation there (the boot's exchange, initramfs/netboot); on the control plane's
// 2xx the unit is offered again. Each released unit turns around apart; the generation
// writes, the quotes and the POSTs are one at a time (they share the counter, the
// envelope, PCR 13 and the control plane's record of the node).
type Turnaround struct {
	URL    string       // passage.url
	Client *http.Client // for URL (its CA); nil: http.DefaultClient
	// Keys are what signs, counts and attests generations, beneath Config.Root; their
	// directory must be the one Config.Manifest is in.
	Keys    recycle.Keys
	Profile string
	Policy  erase.Policy // auto or require ("" and off are require)
	// Tries are the recycles of a unit before it is quarantined (0: 3). Backoff is the
	// wait before the second, doubling up to MaxBackoff (0: 30 s, 10 min).
	Tries               int
	Backoff, MaxBackoff time.Duration
	// Poll is how often a held unit's holders and the Node's ClearAnnotation are looked
	// at (0: 5 s); Timeout bounds one recycle (0: 30 min).
	Poll, Timeout time.Duration
	// Publish bounds and retries the nonce GET and the POSTs (zero: netboot.DefaultPublish).
	Publish netboot.PublishPolicy
	// Kube and NodeName: the Node's Events and ClearAnnotation; nil: neither.
	Kube     kubernetes.Interface
	NodeName string
	// Sysfs and Open default to the kernel under Config.Root (tests simulate both);
	// Erase tunes the erase.
	Sysfs vfiobind.Sysfs
	Open  erase.Opener
	Erase erase.RunOptions
	// Crash, when set, is called between a recycle's steps (recycle.Options.Crash) with
	// the unit: a non-nil error stops that recycle there (tests).
	Crash func(unit, step string) error
}

// Steps are the turnaround's timed steps, in order: the erase of the unit's NVMe, the
// resets of its functions, the rest of the recycle (decide, bind, the two signed
// generations), the nonce and the quote, the control plane's verification (the POSTs),
// the republished slices.
var Steps = []string{"erase", "reset", "sign", "attest", "verify", "publish"}

// turnState is the turnaround's run-time state beside the Driver's.
type turnState struct {
	rec *recycle.Recorder
	// writes is held around every generation written and every quote and POST.
	writes sync.Mutex
	kick   chan struct{}
	m      turnMetrics
}

func (d *Driver) initTurnaround() error {
	d.turn.kick = make(chan struct{}, 1)
	d.turn.m.init()
	t := d.cfg.Turnaround
	if t == nil {
		return nil
	}
	if t.URL == "" {
		return errors.New("turnaround: no control plane URL (passage.url)")
	}
	if t.Tries <= 0 {
		t.Tries = 3
	}
	if t.Backoff <= 0 {
		t.Backoff = 30 * time.Second
	}
	if t.MaxBackoff < t.Backoff {
		t.MaxBackoff = max(10*time.Minute, t.Backoff)
	}
	if t.Poll <= 0 {
		t.Poll = 5 * time.Second
	}
	if t.Timeout <= 0 {
		t.Timeout = 30 * time.Minute
	}
	if t.Publish.Tries == 0 {
		t.Publish = netboot.DefaultPublish
	}
	if !t.Policy.Active() {
		// The turnaround exists so that no unit reaches a tenant unerased.
		t.Policy = erase.PolicyRequire
	}
	rec, err := recycle.OpenRecorder(d.cfg.Root, t.Keys)
	if err != nil {
		return fmt.Errorf("turnaround: %w", err)
	}
	if rec.TPM == nil {
		rec.Close()
		return fmt.Errorf("turnaround: no TPM to attest the recycled generations with (the control plane verifies nothing else): %v", rec.TPMErr)
	}
	a, aerr := os.Stat(rec.Dir)
	b, berr := os.Stat(filepath.Dir(d.cfg.Manifest))
	if aerr != nil || berr != nil || !os.SameFile(a, b) || filepath.Base(d.cfg.Manifest) != recycle.EnvelopeName {
		rec.Close()
		return fmt.Errorf("turnaround: the recycle writes %s, the plugin reads %s: not the same file", filepath.Join(rec.Dir, recycle.EnvelopeName), d.cfg.Manifest)
	}
	d.turn.rec = rec
	return nil
}

func (d *Driver) kickTurnaround() {
	select {
	case d.turn.kick <- struct{}{}:
	default:
	}
}

// RunTurnaround recycles the released units until ctx ends, each in its own goroutine
// (a unit whose recycle fails or waits holds no other), and acts on ClearAnnotation.
// First, beside them, it attests the generation the host is on (AttestCurrent). It
// returns once every unit's goroutine has stopped; units.json says how far each got,
// and a restarted plugin goes on from there. Without Config.Turnaround it returns at once.
func (d *Driver) RunTurnaround(ctx context.Context) {
	t := d.cfg.Turnaround
	if t == nil {
		return
	}
	defer d.turn.rec.Close()
	running := map[string]bool{}
	done := make(chan string)
	var wg sync.WaitGroup
	defer wg.Wait()
	// The generation the host booted on, in case the boot could not deliver it.
	wg.Go(func() { d.AttestCurrent(ctx) })
	tick := time.NewTicker(t.Poll)
	defer tick.Stop()
	for {
		d.clearQuarantines(ctx)
		d.mu.Lock()
		for id, s := range d.units.Units {
			if s.State != StateQuarantined && !running[id] {
				running[id] = true
				wg.Go(func() {
					d.turnUnit(ctx, id)
					select {
					case done <- id:
					case <-ctx.Done():
					}
				})
			}
		}
		d.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-d.turn.kick:
		case <-tick.C:
		case id := <-done:
			delete(running, id)
		}
	}
}

// unit is a copy of the unit's state; ok is false once it is no longer released.
func (d *Driver) unit(id string) (UnitState, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	s, ok := d.units.Units[id]
	if !ok {
		return UnitState{}, false
	}
	return *s, true
}

// setUnit changes the unit's state and records it.
func (d *Driver) setUnit(id string, change func(*UnitState)) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	u := d.units.clone()
	s, ok := u.Units[id]
	if !ok {
		return fmt.Errorf("unit %s: no longer released", id)
	}
	change(s)
	// The state in memory is what this process goes on from; a file that cannot be
	// written makes a restart go back to an earlier state, which only recycles again.
	d.units = u
	d.writeMetrics()
	return d.writeUnits(u)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// turnUnit takes one released unit around until it is offered again or quarantined.
func (d *Driver) turnUnit(ctx context.Context, id string) {
	for ctx.Err() == nil {
		s, ok := d.unit(id)
		if !ok || s.State == StateQuarantined {
			return
		}
		if s.NextTry != nil && !sleepCtx(ctx, time.Until(*s.NextTry)) {
			return
		}
		if !d.waitFree(ctx, id) {
			return
		}
		times := map[string]time.Duration{}
		final, step, err := s.Final, "", error(nil)
		if s.State != StateVerifying || final == 0 {
			// Deactivated before anything is reset: "GPU reset is done from the host after
			// the VM shuts down and the partition is deactivated" (package fabricmanager).
			if err := d.releaseFabric(id); err != nil {
				d.failed(ctx, id, StepFabric, err)
				continue
			}
			if err := d.setUnit(id, func(u *UnitState) { u.State, u.Final = StateRecycling, 0 }); err != nil {
				d.logf("turnaround %s: %v", id, err)
			}
			final, step, err = d.recycleUnit(ctx, id, times)
			if errors.Is(err, recycle.ErrHeld) {
				d.logf("turnaround %s: %v: waiting for it to be let go", id, err)
				continue // no try spent: the unit is still someone's
			}
			if err == nil {
				if err := d.setUnit(id, func(u *UnitState) { u.State, u.Final = StateVerifying, final }); err != nil {
					d.logf("turnaround %s: %v", id, err)
				}
			}
		}
		var gen uint64
		if err == nil {
			gen, step, err = d.deliver(ctx, times)
			if err == nil && gen < final {
				step, err = "verify", fmt.Errorf("the control plane verified generation %d, older than %d that recycled the unit", gen, final)
			}
		}
		if ctx.Err() != nil {
			return // stopped: units.json says how far it got
		}
		if err == nil {
			d.returned(ctx, id, gen, times)
			return
		}
		d.failed(ctx, id, step, err)
	}
}

// waitFree waits until no process holds the unit's VFIO group or device cdevs open.
func (d *Driver) waitFree(ctx context.Context, id string) bool {
	d.mu.Lock()
	var groups []int
	var devs []*pci.Device
	var err error
	for _, u := range d.v.Manifest.Units {
		if u.ID != id {
			continue
		}
		for _, f := range u.Functions {
			a, perr := pci.ParseAddress(f.BDF)
			err = errors.Join(err, perr)
			groups = append(groups, f.IOMMUGroup)
			devs = append(devs, &pci.Device{Addr: a, IOMMUGroup: f.IOMMUGroup})
		}
	}
	d.mu.Unlock()
	if err != nil {
		d.logf("turnaround %s: %v", id, err)
		return true // recycle.Run holds the unit to its own check
	}
	said := false
	for {
		hs, err := recycle.Holders(d.cfg.Root, groups, devs)
		if len(hs) == 0 && err == nil {
			return true
		}
		if !said {
			if err == nil {
				err = errors.New(hs[0].String())
			}
			d.logf("turnaround %s: not recycled while held: %v", id, err)
			said = true
		}
		if !sleepCtx(ctx, d.cfg.Turnaround.Poll) {
			return false
		}
	}
}

// recycleUnit runs the recycle of the one unit; times gets its steps. step names what
// failed (erase, reset, recycle).
func (d *Driver) recycleUnit(ctx context.Context, id string, times map[string]time.Duration) (final uint64, step string, err error) {
	t := d.cfg.Turnaround
	var uid topology.UnitID
	if err := uid.UnmarshalText([]byte(id)); err != nil {
		return 0, "recycle", err
	}
	o := recycle.Options{Root: d.cfg.Root, Profile: t.Profile, Units: []topology.UnitID{uid}, Policy: t.Policy,
		Writes: &d.turn.writes, Who: "passage-dra turnaround " + id, Sysfs: t.Sysfs, Open: t.Open, Erase: t.Erase, Log: logWriter{d, "turnaround " + id + ": "}}
	d.turn.rec.Fill(&o)
	var mu sync.Mutex
	marks := map[string]time.Time{}
	o.Crash = func(step string) error {
		mu.Lock()
		marks[step] = time.Now()
		mu.Unlock()
		if t.Crash != nil {
			return t.Crash(id, step)
		}
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, t.Timeout)
	defer cancel()
	start := time.Now()
	res, err := recycle.Run(rctx, o)
	total := time.Since(start)
	mu.Lock()
	from, to := marks["erase"], marks["bind"]
	mu.Unlock()
	if res != nil && res.Erase != nil && !from.IsZero() && !to.IsZero() {
		var e time.Duration
		for _, u := range res.Erase.Units {
			for _, n := range u.NVMe {
				e += n.Duration
			}
		}
		times["erase"], times["reset"] = e, max(0, to.Sub(from)-e)
		times["sign"] = max(0, total-to.Sub(from))
	}
	if err != nil {
		return 0, "recycle", err
	}
	for _, v := range res.Verdicts {
		if v.Status == topology.StatusReady || (v.Status == topology.StatusDegraded && d.cfg.Options.Degraded) {
			continue
		}
		step = "recycle"
		for _, u := range res.Erase.Units {
			for _, p := range u.Problems() {
				if strings.HasPrefix(p, "reset ") && step == "recycle" {
					step = "reset"
				}
				if strings.HasPrefix(p, "erase ") {
					step = "erase"
				}
			}
		}
		return 0, step, fmt.Errorf("generation %d says %s %s: %s", res.Final, v.Unit, v.Status, strings.Join(v.Reasons, "; "))
	}
	return res.Final, "", nil
}

// deliver is the boot's exchange for the newest generation, one at a time with the
// generation writes: a nonce from the control plane (fresh: after the recycle), the
// quote of the newest generation over it, the envelope and the attestation POSTed. It
// returns the generation the control plane verified; step names what failed (attest,
// verify).
func (d *Driver) deliver(ctx context.Context, times map[string]time.Duration) (gen uint64, step string, err error) {
	t := d.cfg.Turnaround
	d.turn.writes.Lock()
	defer d.turn.writes.Unlock()
	start := time.Now()
	env, err := manifest.ReadRegular(d.cfg.Manifest, MaxFile)
	if err != nil {
		return 0, "attest", err
	}
	v, err := resources.Verify(d.cfg.Manifest, d.cfg.Source)
	if err != nil {
		return 0, "attest", err
	}
	nonce, _, err := netboot.FetchNonce(ctx, t.Client, t.URL, t.Publish)
	if err != nil {
		return 0, "attest", fmt.Errorf("nonce from %s: %w", t.URL, err)
	}
	rec := d.turn.rec
	if err := rec.Attest(rec.Dir, v.Payload, nonce); err != nil {
		return 0, "attest", fmt.Errorf("generation %d: %w", v.Manifest.Generation, err)
	}
	body, err := manifest.ReadRegular(filepath.Join(rec.Dir, recycle.EnvelopeName+recycle.AttestationSuffix), attest.MaxFile)
	if err == nil {
		// The control plane takes the envelope only inside the attestation that names it.
		body, err = attest.WithEnvelope(body, env)
	}
	if err != nil {
		return 0, "attest", err
	}
	times["attest"] = time.Since(start)
	start = time.Now()
	activate := func(_ string, challenge json.RawMessage) ([]byte, []byte, error) {
		return attest.Answer(rec.TPM.Transport(), challenge)
	}
	if _, err := netboot.DeliverAttestation(ctx, t.Client, t.URL, body, activate, t.Publish); err != nil {
		return 0, "verify", fmt.Errorf("generation %d: attestation: %w", v.Manifest.Generation, err)
	}
	times["verify"] = time.Since(start)
	return v.Manifest.Generation, "", nil
}

// returned offers the unit again: its record goes (the verified generation kept), the
// manifest is loaded and the slices published.
func (d *Driver) returned(ctx context.Context, id string, gen uint64, times map[string]time.Duration) {
	d.mu.Lock()
	u := d.units.clone()
	delete(u.Units, id)
	u.Verified = max(u.Verified, gen)
	if err := d.writeUnits(u); err != nil {
		d.mu.Unlock()
		d.failed(ctx, id, "verify", fmt.Errorf("verified generation %d not recorded: %w", gen, err))
		return
	}
	d.units = u
	lerr := d.load()
	d.mu.Unlock()
	start := time.Now()
	err := lerr
	if err == nil {
		err = d.publish(ctx)
	}
	times["publish"] = time.Since(start)
	d.turn.m.outcome("returned", times)
	d.mu.Lock()
	d.writeMetrics()
	d.mu.Unlock()
	if err != nil {
		d.logf("turnaround %s: verified in generation %d; slices not republished yet (the next reload does): %v", id, gen, err)
		return
	}
	d.logf("turnaround %s: back in generation %d (%s)", id, gen, stepLine(Steps, times))
}

// stepLine is the times of steps (in their order) that ran, for a log line.
func stepLine(steps []string, times map[string]time.Duration) string {
	var s []string
	for _, st := range steps {
		if v, ok := times[st]; ok {
			s = append(s, fmt.Sprintf("%s %s", st, v.Round(time.Millisecond)))
		}
	}
	return strings.Join(s, ", ")
}

// maxLastError bounds a failure's words in units.json and in the Event.
const maxLastError = 1 << 10

// lastError is err's words as units.json and the Event keep them.
func lastError(err error) string {
	msg := manifest.Printable(err.Error())
	if len(msg) > maxLastError {
		msg = msg[:maxLastError-3] + "..."
	}
	return msg
}

// failed counts a failed try: the unit waits Backoff (doubling) for the next, or after
// Tries is quarantined, tainted in the slices and told on the Node.
func (d *Driver) failed(ctx context.Context, id, step string, err error) {
	t := d.cfg.Turnaround
	msg := lastError(err)
	var s UnitState
	werr := d.setUnit(id, func(u *UnitState) {
		u.Attempts++
		u.Step, u.LastError, u.Final = step, msg, 0
		if u.Attempts >= t.Tries {
			u.State, u.NextTry = StateQuarantined, nil
		} else {
			wait := t.Backoff << min(u.Attempts-1, 20)
			if wait > t.MaxBackoff || wait <= 0 {
				wait = t.MaxBackoff
			}
			next := time.Now().Add(wait).UTC()
			u.State, u.NextTry = StateWithheld, &next
		}
		s = *u
	})
	if werr != nil {
		d.logf("turnaround %s: %v", id, werr)
	}
	if s.State != StateQuarantined {
		d.turn.m.outcome("failed", nil)
		d.logf("turnaround %s: try %d of %d failed at %s: %s; next try at %s", id, s.Attempts, t.Tries, step, msg, s.NextTry.Format(time.RFC3339))
		return
	}
	d.turn.m.outcome("failed", nil)
	d.turn.m.outcome("quarantined", nil)
	d.mu.Lock()
	rerr := d.render(d.v)
	d.mu.Unlock()
	if rerr == nil {
		rerr = d.publish(ctx)
	}
	if rerr != nil {
		d.logf("turnaround %s: quarantine taint not published yet: %v", id, rerr)
	}
	ev := fmt.Sprintf("unit %s quarantined after %d failed recycles (released under generation %d); last at %s: %s. Clear: kubectl annotate node %s %s=%s",
		id, s.Attempts, s.Generation, step, msg, t.NodeName, ClearAnnotation, id)
	d.logf("turnaround %s: %s", id, ev)
	d.event(ctx, corev1.EventTypeWarning, "UnitQuarantined", ev)
}

// quarantineTaints are the quarantined units' taints (Options.Taints); d.mu held.
func (d *Driver) quarantineTaints() map[string][]resourceapi.DeviceTaint {
	out := map[string][]resourceapi.DeviceTaint{}
	for id, s := range d.units.Units {
		if s.State == StateQuarantined {
			v := s.Step
			if v == "" {
				v = "recycle"
			}
			out[id] = []resourceapi.DeviceTaint{{Key: TaintQuarantined, Value: v, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
		}
	}
	return out
}

// clearQuarantines acts on the Node's ClearAnnotation: the units it names that are
// quarantined are withheld again with no try spent, and the annotation is removed (only
// if it still says what was read).
func (d *Driver) clearQuarantines(ctx context.Context) {
	t := d.cfg.Turnaround
	if t.Kube == nil || t.NodeName == "" {
		return
	}
	n, err := t.Kube.CoreV1().Nodes().Get(ctx, t.NodeName, metav1.GetOptions{})
	if err != nil {
		if ctx.Err() == nil {
			d.logf("turnaround: node %s: %v", t.NodeName, err)
		}
		return
	}
	val, ok := n.Annotations[ClearAnnotation]
	if !ok {
		return
	}
	want := map[string]bool{}
	for _, id := range split(strings.ReplaceAll(val, " ", "")) {
		want[id] = true
	}
	d.mu.Lock()
	u := d.units.clone()
	var cleared []string
	for id, s := range u.Units {
		if s.State == StateQuarantined && (want[id] || want["all"]) {
			s.State, s.Attempts, s.NextTry = StateWithheld, 0, nil
			cleared = append(cleared, id)
		}
	}
	var werr error
	if len(cleared) > 0 {
		if werr = d.writeUnits(u); werr == nil {
			d.units = u
			werr = d.render(d.v)
		}
	}
	d.mu.Unlock()
	if werr != nil {
		d.logf("turnaround: %s=%s not acted on: %v", ClearAnnotation, val, werr)
		return
	}
	path := "/metadata/annotations/" + strings.ReplaceAll(ClearAnnotation, "/", "~1")
	patch, _ := json.Marshal([]map[string]string{{"op": "test", "path": path, "value": val}, {"op": "remove", "path": path}})
	if _, err := t.Kube.CoreV1().Nodes().Patch(ctx, t.NodeName, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		d.logf("turnaround: node %s: %s not removed: %v", t.NodeName, ClearAnnotation, err)
	}
	if len(cleared) == 0 {
		return
	}
	if err := d.publish(ctx); err != nil {
		d.logf("turnaround: slices after clearing %v: %v", cleared, err)
	}
	msg := fmt.Sprintf("quarantine cleared (%s=%s): %s recycled again", ClearAnnotation, val, strings.Join(cleared, ", "))
	d.logf("turnaround: %s", msg)
	d.event(ctx, corev1.EventTypeNormal, "QuarantineCleared", msg)
	d.kickTurnaround()
}

// event records an Event on the plugin's Node (namespace default, as the kubelet's).
func (d *Driver) event(ctx context.Context, kind, reason, msg string) {
	t := d.cfg.Turnaround
	if t.Kube == nil || t.NodeName == "" {
		return
	}
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta:          metav1.ObjectMeta{GenerateName: t.NodeName + ".", Namespace: metav1.NamespaceDefault},
		InvolvedObject:      corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: t.NodeName, UID: types.UID(t.NodeName)},
		Reason:              reason,
		Message:             msg,
		Type:                kind,
		Source:              corev1.EventSource{Component: "passage-dra", Host: t.NodeName},
		FirstTimestamp:      now,
		LastTimestamp:       now,
		Count:               1,
		ReportingController: resources.DriverName + "/passage-dra",
		ReportingInstance:   t.NodeName,
	}
	if _, err := t.Kube.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		d.logf("turnaround: event %s on node %s: %v", reason, t.NodeName, err)
	}
}

// logWriter gives recycle's lines to the plugin's log.
type logWriter struct {
	d      *Driver
	prefix string
}

func (w logWriter) Write(b []byte) (int, error) {
	for _, l := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		w.d.logf("%s%s", w.prefix, l)
	}
	return len(b), nil
}
