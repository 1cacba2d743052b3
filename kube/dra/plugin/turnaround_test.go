package plugin_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/recycle"
)

var tenantData = bytes.Repeat([]byte("TENANT-A-SECRET!"), 32)

// turnRig is a node whose plugin turns its units around: noderig's B300 with a swtpm
// TPM at dev/tpmrm0 (its PCRs extended with a real firmware log, as the firmware would),
// the ed25519 key at etc/passage/key, one simulated NVMe controller per unit holding a
// tenant's data, and passage-control's real handler over TLS on loopback (its fake API).
type turnRig struct {
	*noderig.Rig
	cfg     plugin.Config
	ctrls   map[pci.Address]*erasetest.Controller
	failing sync.Map // NVMe addresses whose controller does not answer
	srv     *control.Server
	kc      *fake.Clientset // the control plane's API (its taint rules)
	logs    *logLines
	reg     string
}

// logLines is the plugin's log, kept for the test to wait on.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

func (l *logLines) has(sub string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range l.lines {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

func newTurnRig(t *testing.T) *turnRig {
	t.Helper()
	r := &turnRig{Rig: newRig(t), ctrls: map[pci.Address]*erasetest.Controller{}, logs: &logLines{}}
	fw, err := os.ReadFile("../../../attest/testdata/ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := r.ForTurnaround(t, fw)
	tree, err := pci.Scan(r.Root)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range tree.Devices {
		if d.Class == pcitest.ClassNVMe {
			r.ctrls[d.Addr] = erasetest.New("S"+d.Addr.String(), erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16})
		}
	}

	// passage-control's handler with its fake API.
	pool, err := attest.CAPool(ca.PEM(t))
	if err != nil {
		t.Fatal(err)
	}
	r.kc = fake.NewClientset()
	keys, err := control.NewKeys(make([]byte, control.MinKey))
	if err != nil {
		t.Fatal(err)
	}
	r.srv = &control.Server{Store: controltest.FakeStore(), Taints: &control.Taints{Client: r.kc}, EKCA: pool, Keys: keys, Metrics: control.NewMetrics()}
	ts := httptest.NewUnstartedServer(r.srv)
	ts.StartTLS()
	t.Cleanup(ts.Close)

	r.reg = filepath.Join(r.Dir, "registry")
	r.cfg = plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"),
		StateDir: filepath.Join(r.Dir, "plugin"), MetricsFile: filepath.Join(r.Dir, "metrics", "passage-dra.prom"), Logf: r.logs.logf,
		Turnaround: r.turnaround(ts)}
	os.MkdirAll(filepath.Dir(r.cfg.MetricsFile), 0o755)
	return r
}

func (r *turnRig) turnaround(ts *httptest.Server) *plugin.Turnaround {
	return &plugin.Turnaround{URL: ts.URL, Client: ts.Client(), Keys: recycle.Keys{SigningKey: "/etc/passage/key", Dir: "/run/passage", TPM: "on"},
		Profile: "b300", Policy: erase.PolicyRequire, Tries: 2, Backoff: 20 * time.Millisecond, Poll: 20 * time.Millisecond, Timeout: time.Minute,
		Sysfs: r.Kernel,
		Open: func(_ context.Context, a pci.Address) (erase.Controller, string, error) {
			if _, bad := r.failing.Load(a); bad {
				return nil, "", fmt.Errorf("nvme %s: controller does not answer", a)
			}
			return r.ctrls[a], "nvme", nil
		},
		Erase: erase.RunOptions{Erase: erase.Options{SanitizeTimeout: 5 * time.Second, PollInterval: time.Millisecond, Samples: 8}}}
}

func write(t *testing.T, p string, b []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// nvme is the controller of unit u's NVMe.
func (r *turnRig) nvme(u int) (pci.Address, *erasetest.Controller) {
	a := r.Tree.Addr(noderig.UnitNames(u)[3])
	return a, r.ctrls[a]
}

// generation is the manifest's generation now.
func (r *turnRig) generation(t *testing.T) uint64 {
	t.Helper()
	v, err := resources.Verify(r.Path, r.cfg.Source)
	if err != nil {
		t.Fatal(err)
	}
	return v.Manifest.Generation
}

// units is units.json.
type unitsFile struct {
	Version  int                          `json:"version"`
	Verified uint64                       `json:"verified"`
	Units    map[string]*plugin.UnitState `json:"units"`
}

func (r *turnRig) units(t *testing.T) unitsFile {
	t.Helper()
	var u unitsFile
	b, err := os.ReadFile(filepath.Join(r.cfg.StateDir, "units.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &u); err != nil {
		t.Fatal(err)
	}
	return u
}

// slices are the devices published in client's API, by name.
func slicesOf(t *testing.T, client *fake.Clientset) map[string]resourceapi.Device {
	t.Helper()
	list, err := client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]resourceapi.Device{}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			out[d.Name] = d
		}
	}
	return out
}

// waitFor polls cond (bounded: a minute, swtpm under load included) and fails with what
// the plugin logged.
func (r *turnRig) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after a minute; the plugin logged:\n%s", what, r.logs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// untainted counts the published devices without a taint, and tainted those with.
func untainted(devs map[string]resourceapi.Device) (free, tainted int) {
	for _, d := range devs {
		if len(d.Taints) == 0 {
			free++
		} else {
			tainted++
		}
	}
	return free, tainted
}

// runTurnaround runs d's turnaround until the returned stop is called (which waits for
// it: the TPM is free again after).
func runTurnaround(d *plugin.Driver) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		d.RunTurnaround(ctx)
		close(done)
	}()
	return func() {
		cancel()
		<-done
	}
}

// TestTurnaround: a released unit whose group a VMM still holds is not touched; once
// let go, with no command run, its NVMe is erased (the tenant's data read back: gone),
// two generations are signed (not ready, then ready), the control plane enrols the TPM
// and verifies the newest generation over its own fresh nonce, and only then is the
// unit published again; units.json records the verified generation.
func TestTurnaround(t *testing.T) {
	r := newTurnRig(t)
	d, client, k, _ := start(t, r.cfg, r.reg)
	stop := runTurnaround(d)
	defer stop()
	publishedDevices(t, client, countIs(32))
	a, c := r.nvme(3)
	vm := claim(t, client, d, "vm3", "gpu3")
	if got := prepare(t, k, vm); got.Error != "" {
		t.Fatalf("prepare: %+v", got)
	}
	c.Write(1, 0, tenantData)
	c.Write(1, 1<<16-1, tenantData)
	letGo := r.Hold(t, 4242, 3)
	before := r.generation(t)
	if got := unprepare(t, k, vm); got != "" {
		t.Fatalf("unprepare: %q", got)
	}
	r.waitFor(t, "the turnaround waiting on pid 4242", func() bool { return r.logs.has("pid 4242") })
	if c.Dirty(1) == 0 || r.generation(t) != before {
		t.Fatalf("held by pid 4242, yet recycled: %d dirty blocks, generation %d (was %d)", c.Dirty(1), r.generation(t), before)
	}
	if u := r.units(t).Units["gpu3"]; u == nil || u.State != plugin.StateWithheld {
		t.Fatalf("units.json gpu3 while held: %+v", u)
	}
	if devs := slicesOf(t, client); len(devs) != 28 {
		t.Fatalf("%d devices published while gpu3 is held, want 28", len(devs))
	}

	letGo()
	r.waitFor(t, "gpu3 published again", func() bool { return len(slicesOf(t, client)) == 32 })
	if n := c.Dirty(1); n != 0 {
		t.Errorf("NVMe %s: %d blocks still hold the tenant's data after the turnaround", a, n)
	}
	after := r.generation(t)
	if after != before+2 {
		t.Errorf("generation %d after the recycle, want %d (one not ready, one ready)", after, before+2)
	}
	rec, err := r.srv.Store.Node(context.Background(), r.M.Node.Hostname)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status.Verdict != control.VerdictVerified || uint64(rec.Status.Generation) != after {
		t.Errorf("control plane record: verdict %q generation %d reason %q, want verified %d", rec.Status.Verdict, rec.Status.Generation, rec.Status.Reason, after)
	}
	u := r.units(t)
	if len(u.Units) != 0 || u.Verified != after {
		t.Errorf("units.json %+v, want no unit and verified %d", u, after)
	}
	if d.Recycles("returned") != 1 {
		t.Errorf("%d recycles returned, want 1", d.Recycles("returned"))
	}
	m, err := os.ReadFile(r.cfg.MetricsFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`passage_dra_recycles_total{outcome="returned"} 1`, `passage_dra_recycle_step_seconds_count{step="erase"} 1`,
		`passage_dra_recycle_step_seconds_count{step="verify"} 1`, `passage_dra_turnaround_units{state="withheld"} 0`} {
		if !strings.Contains(string(m), want) {
			t.Errorf("metrics lack %s:\n%s", want, m)
		}
	}
	cmd := exec.Command("promtool", "check", "metrics")
	cmd.Stdin = bytes.NewReader(m)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
	// The new tenant's claim of the recycled unit is prepared.
	if got := prepare(t, k, claim(t, client, d, "vm3b", "gpu3")); got.Error != "" {
		t.Fatalf("prepare of the recycled gpu3: %+v", got)
	}
}

// TestTurnaroundQuarantine: eight units released at once; gpu5's NVMe controller does
// not answer. The other seven return; gpu5 is tried Tries times with the backoff
// between, then quarantined: units.json says why, its devices are published with the
// NoSchedule quarantine taint (and a claim of them is refused), an Event on the Node
// carries the evidence, the metric counts it. Clearing it (the Node annotation) once
// the controller answers brings it back, and the annotation is removed.
func TestTurnaroundQuarantine(t *testing.T) {
	r := newTurnRig(t)
	d, client, k, _ := start(t, r.cfg, r.reg)
	r.cfg.Turnaround.Kube, r.cfg.Turnaround.NodeName = client, d.Objects().Node
	publishedDevices(t, client, countIs(32))
	var vms []*resourceapi.ResourceClaim
	for u := range 8 {
		vm := claim(t, client, d, fmt.Sprintf("vm%d", u), fmt.Sprintf("gpu%d", u))
		if got := prepare(t, k, vm); got.Error != "" {
			t.Fatalf("prepare: %+v", got)
		}
		_, c := r.nvme(u)
		c.Write(1, 0, tenantData)
		vms = append(vms, vm)
	}
	bad, _ := r.nvme(5)
	r.failing.Store(bad, true)
	for _, vm := range vms {
		if got := unprepare(t, k, vm); got != "" {
			t.Fatalf("unprepare: %q", got)
		}
	}
	stop := runTurnaround(d)
	defer stop()
	r.waitFor(t, "seven units back and gpu5 quarantined", func() bool {
		free, tainted := untainted(slicesOf(t, client))
		return free == 28 && tainted == 4
	})
	for u := range 8 {
		if _, c := r.nvme(u); u != 5 && c.Dirty(1) != 0 {
			t.Errorf("gpu%d returned with the tenant's data on its NVMe", u)
		}
	}
	for name, dev := range slicesOf(t, client) {
		if !strings.HasPrefix(name, "gpu5-") {
			continue
		}
		if len(dev.Taints) != 1 || dev.Taints[0].Key != plugin.TaintQuarantined || dev.Taints[0].Effect != resourceapi.DeviceTaintEffectNoSchedule || dev.Taints[0].Value != "erase" {
			t.Errorf("%s: taints %+v, want %s=erase:NoSchedule", name, dev.Taints, plugin.TaintQuarantined)
		}
	}
	u := r.units(t).Units["gpu5"]
	if u == nil || u.State != plugin.StateQuarantined || u.Attempts != 2 || u.Step != "erase" || !strings.Contains(u.LastError, "does not answer") {
		t.Fatalf("units.json gpu5: %+v", u)
	}
	if !r.logs.has("try 1 of 2 failed at erase") || !r.logs.has("next try at") {
		t.Errorf("no backoff logged between the tries:\n%s", r.logs)
	}
	// The Event is recorded after the tainted slices are published: it is waited for.
	var ev *corev1.Event
	r.waitFor(t, "the UnitQuarantined Event", func() bool {
		evs, err := client.CoreV1().Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for i := range evs.Items {
			if evs.Items[i].Reason == "UnitQuarantined" {
				ev = &evs.Items[i]
			}
		}
		return ev != nil
	})
	if ev == nil || ev.InvolvedObject.Kind != "Node" || ev.InvolvedObject.Name != d.Objects().Node || !strings.Contains(ev.Message, "gpu5") || !strings.Contains(ev.Message, "does not answer") {
		t.Fatalf("Event on the Node: %+v", ev)
	}
	if d.Recycles("quarantined") != 1 || d.Recycles("returned") != 7 || d.Recycles("failed") != 2 {
		t.Errorf("recycles: returned %d failed %d quarantined %d, want 7 2 1", d.Recycles("returned"), d.Recycles("failed"), d.Recycles("quarantined"))
	}
	m, _ := os.ReadFile(r.cfg.MetricsFile)
	if !strings.Contains(string(m), `passage_dra_turnaround_units{state="quarantined"} 1`) {
		t.Errorf("metrics:\n%s", m)
	}
	// A claim the scheduler would give only with a toleration is refused all the same.
	c5 := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "vm5b", Namespace: "tenant", UID: "uid-vm5b"}}
	res := resourceapi.AllocationResult{}
	for name := range slicesOf(t, client) {
		if strings.HasPrefix(name, "gpu5-") {
			res.Devices.Results = append(res.Devices.Results, resourceapi.DeviceRequestAllocationResult{Request: "r" + name, Driver: resources.DriverName, Pool: d.Objects().Pool, Device: name})
		}
	}
	c5.Status.Allocation = &res
	client.ResourceV1().ResourceClaims("tenant").Create(context.Background(), c5, metav1.CreateOptions{})
	if got := prepare(t, k, c5); !strings.Contains(got.Error, "not offered") {
		t.Errorf("prepare of the quarantined gpu5: %q, want a refusal", got.Error)
	}

	// The fault repaired, the operator clears it.
	r.failing.Delete(bad)
	n, err := client.CoreV1().Nodes().Get(context.Background(), d.Objects().Node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n.Annotations = map[string]string{plugin.ClearAnnotation: "gpu5"}
	if _, err := client.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.waitFor(t, "gpu5 back after the clear", func() bool {
		free, tainted := untainted(slicesOf(t, client))
		return free == 32 && tainted == 0
	})
	if _, c := r.nvme(5); c.Dirty(1) != 0 {
		t.Error("gpu5 returned with the tenant's data")
	}
	n, _ = client.CoreV1().Nodes().Get(context.Background(), d.Objects().Node, metav1.GetOptions{})
	if _, ok := n.Annotations[plugin.ClearAnnotation]; ok {
		t.Errorf("the clear annotation stays on the Node: %v", n.Annotations)
	}
}

// TestTurnaroundRestart: a plugin stopped mid-recycle (after the not-ready generation,
// before the erase) leaves units.json saying recycling; the plugin started again from it
// does not offer the unit, recycles it from the start and offers it once verified.
func TestTurnaroundRestart(t *testing.T) {
	r := newTurnRig(t)
	var crashed atomic.Bool
	stopped, killed := make(chan struct{}), make(chan struct{})
	r.cfg.Turnaround.Crash = func(unit, step string) error {
		if step == "erase" && crashed.CompareAndSwap(false, true) {
			close(stopped)
			<-killed // nothing of this process runs on
			return errors.New("killed")
		}
		return nil
	}
	d, client, k, _ := start(t, r.cfg, r.reg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { d.RunTurnaround(ctx); close(done) }()
	vm := claim(t, client, d, "vm2", "gpu2")
	if got := prepare(t, k, vm); got.Error != "" {
		t.Fatalf("prepare: %+v", got)
	}
	_, c := r.nvme(2)
	c.Write(1, 0, tenantData)
	if got := unprepare(t, k, vm); got != "" {
		t.Fatalf("unprepare: %q", got)
	}
	<-stopped
	cancel() // the kill: the recycle stops where it is, nothing more recorded
	close(killed)
	<-done
	d.Stop()
	if u := r.units(t).Units["gpu2"]; u == nil || u.State != plugin.StateRecycling {
		t.Fatalf("units.json after the kill: %+v", u)
	}
	if c.Dirty(1) == 0 {
		t.Fatal("erased before the kill")
	}

	r.cfg.Turnaround.Crash = nil
	d2, err := plugin.New(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range offers(d2) {
		if strings.HasPrefix(name, "gpu2-") {
			t.Fatalf("the restarted plugin offers %s before its recycle is verified", name)
		}
	}
	client2 := fakeAPI(d2.Objects().Node)
	startOn(t, d2, r.cfg, r.reg, client2)
	stop := runTurnaround(d2)
	defer stop()
	r.waitFor(t, "gpu2 back after the restart", func() bool { return len(slicesOf(t, client2)) == 32 })
	if c.Dirty(1) != 0 {
		t.Error("gpu2 offered with the tenant's data")
	}
	if u := r.units(t); len(u.Units) != 0 || u.Verified != r.generation(t) {
		t.Errorf("units.json %+v, want none and the newest generation %d verified", u, r.generation(t))
	}
}

// TestUnitsFileRefusedAtStart: a units.json this plugin did not write as it is (another
// version, an unknown field or state, a null unit, trailing data) is refused at start
// naming the file: guessing would offer a released unit.
func TestUnitsFileRefusedAtStart(t *testing.T) {
	r := newRig(t)
	data := filepath.Join(r.Dir, "plugin")
	p := filepath.Join(data, "units.json")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: filepath.Join(r.Dir, "cdi"), StateDir: data}
	for _, bad := range []string{`{"version":2,"units":{}}`, `{"version":1}`, `{"version":1,"units":{"gpu0":null}}`,
		`{"version":1,"units":{"gpu0":{"generation":7,"state":"gone"}}}`, `{"version":1,"units":{"gpu0":{"generation":7,"state":"withheld","x":1}}}`,
		`{"version":1,"units":{"":{"generation":7,"state":"withheld"}}}`, `{"version":1,"units":{}} {}`} {
		write(t, p, []byte(bad))
		if _, err := plugin.New(cfg); err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("units.json %s: %v, want a refusal naming it", bad, err)
		}
	}
	write(t, p, []byte(`{"version":1,"verified":7,"units":{"gpu1":{"generation":7,"state":"quarantined","attempts":3,"step":"erase"}}}`))
	d, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The quarantined unit is published tainted, never prepared.
	for _, dev := range d.Objects().Devices {
		tainted := len(dev.Taints) == 1 && dev.Taints[0].Key == plugin.TaintQuarantined && dev.Taints[0].Value == "erase"
		if strings.HasPrefix(dev.Name, "gpu1-") != tainted {
			t.Errorf("%s: taints %+v", dev.Name, dev.Taints)
		}
	}
}
