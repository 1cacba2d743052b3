package plugin_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
)

// without is publishedDevices' want: n devices, none of unit's.
func without(unit string, n int) func([]string) bool {
	return func(s []string) bool {
		return len(s) == n && !slices.ContainsFunc(s, func(d string) bool { return strings.HasPrefix(d, unit+"-") })
	}
}

// unprepare asks the plugin over its DRA socket to unprepare c, as the kubelet does, and
// returns the claim's error ("" when done).
func unprepare(t *testing.T, k *kubelet, c *resourceapi.ResourceClaim) string {
	t.Helper()
	resp, err := k.dra.NodeUnprepareResources(context.Background(), &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}})
	if err != nil {
		t.Fatalf("unprepare %s: %v", c.Name, err)
	}
	r, ok := resp.Claims[string(c.UID)]
	if !ok {
		t.Fatalf("unprepare %s: no answer for the claim: %+v", c.Name, resp)
	}
	return r.Error
}

// offers are the devices a driver publishes.
func offers(d *plugin.Driver) []string {
	var names []string
	for _, dev := range d.Objects().Devices {
		names = append(names, dev.Name)
	}
	return names
}

// TestUnprepareRecordsBeforeRelease (issue 40, finding 1), through the DRA gRPC: with
// units.json unwritable (a directory in its place: it stops root as a full or
// read-only disk would), unprepare lets go of nothing: the claim is refused, its CDI
// spec and metadata stay, and the kubelet's retry is refused again. A plugin restarted
// meanwhile does not offer the unit: while the file is a directory it refuses to start
// naming it; once the disk is writable it starts, and the claim's spec still holds the
// unit out of the slices. The kubelet's retry then completes, and the unit stays
// withheld (through another restart and a reload of the same generation) until a newer
// generation. Before the fix the first unprepare removed the spec, the retry succeeded,
// and the restarted plugin published all 32 devices.
func TestUnprepareRecordsBeforeRelease(t *testing.T) {
	r := newRig(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data}
	d, client, k, _ := start(t, cfg, reg)
	publishedDevices(t, client, countIs(32))
	vm0 := claim(t, client, d, "vm0", "gpu0")
	if got := prepare(t, k, vm0); got.Error != "" || len(got.Devices) != 4 {
		t.Fatalf("prepare vm0: %+v", got)
	}
	// A prepared unit is not offered, and the kubelet may still ask for the claim again.
	publishedDevices(t, client, without("gpu0", 28))
	if got := prepare(t, k, vm0); got.Error != "" || len(got.Devices) != 4 {
		t.Fatalf("prepare vm0 again: %+v", got)
	}

	// The claim's CDI specs: the unit's and the helper's metadata ones.
	specs, _ := filepath.Glob(filepath.Join(cdiDir, "*uid-vm0*"))
	if len(specs) != 5 {
		t.Fatalf("CDI specs of vm0: %v, want the unit's and four of metadata", specs)
	}
	heldFile := filepath.Join(data, "units.json")
	if err := os.MkdirAll(filepath.Join(heldFile, "planted"), 0o755); err != nil {
		t.Fatal(err)
	}
	metadata := filepath.Join(data, "dra-device-metadata", "tenant_vm0")
	for _, call := range []string{"unprepare", "the kubelet's retry"} {
		got := unprepare(t, k, vm0)
		if !strings.Contains(got, heldFile) || !strings.Contains(got, "stays prepared") {
			t.Fatalf("%s with %s a directory: %q, want a refusal naming it", call, heldFile, got)
		}
		if m, _ := filepath.Glob(filepath.Join(cdiDir, "*uid-vm0*")); !slices.Equal(m, specs) {
			t.Fatalf("%s that could not record gpu0 withheld left the CDI specs %v of %v", call, m, specs)
		}
		if _, err := os.Stat(metadata); err != nil {
			t.Fatalf("%s that could not record gpu0 withheld let go of the metadata: %v", call, err)
		}
	}
	publishedDevices(t, client, without("gpu0", 28))

	// A restart while the file is a directory: refused, naming it.
	d.Stop()
	if _, err := plugin.New(cfg); err == nil || !strings.Contains(err.Error(), heldFile) {
		t.Fatalf("a restart with %s a directory: %v, want a refusal naming it", heldFile, err)
	}
	// The disk writable again, a restart (its API's slices wiped, as the kubelet wipes
	// a gone plugin's): the claim is still prepared, its unit not offered.
	if err := os.RemoveAll(heldFile); err != nil {
		t.Fatal(err)
	}
	d2, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	client2 := fakeAPI(d2.Objects().Node)
	k2, ctx := startOn(t, d2, cfg, reg, client2)
	publishedDevices(t, client2, without("gpu0", 28))

	// The kubelet's retry completes: the record first, then the spec and the metadata.
	if got := unprepare(t, k2, vm0); got != "" {
		t.Fatalf("the kubelet's retry with the disk writable: %q", got)
	}
	if b, err := os.ReadFile(heldFile); err != nil || string(b) != `{"version":1,"verified":0,"units":{"gpu0":{"generation":7,"state":"withheld","attempts":0}}}` {
		t.Fatalf("%s: %q %v, want gpu0 withheld under generation 7", heldFile, b, err)
	}
	if m, _ := filepath.Glob(filepath.Join(cdiDir, "*uid-vm0*")); len(m) != 0 {
		t.Fatalf("unprepare left CDI specs %v", m)
	}
	if _, err := os.Stat(metadata); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unprepare left the metadata: %v", err)
	}
	publishedDevices(t, client2, without("gpu0", 28))
	// Withheld through another restart and a reload of the same generation.
	d3, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := offers(d3); !without("gpu0", 28)(got) {
		t.Fatalf("a restarted plugin offers %v", got)
	}
	if err := d2.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	publishedDevices(t, client2, without("gpu0", 28))
	// Generation 8 (after recycle) offers it again.
	r.M.Generation = 8
	r.Sign(t)
	if err := d2.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	publishedDevices(t, client2, countIs(32))
	if b, err := os.ReadFile(heldFile); err != nil || string(b) != `{"version":1,"verified":0,"units":{}}` {
		t.Fatalf("%s after generation 8: %q %v, want no unit withheld", heldFile, b, err)
	}
}

// TestReleaseUnderNewestGeneration: a unit prepared under generation 7 and released
// after generation 8 was signed (another unit recycled while the tenant held it) is
// withheld under 8, not offered at once; generation 9 offers it.
func TestReleaseUnderNewestGeneration(t *testing.T) {
	r := newRig(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data}
	d, client, k, ctx := start(t, cfg, reg)
	vm0 := claim(t, client, d, "vm0", "gpu0")
	if got := prepare(t, k, vm0); got.Error != "" || len(got.Devices) != 4 {
		t.Fatalf("prepare vm0: %+v", got)
	}
	r.M.Generation = 8
	r.Sign(t)
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if got := unprepare(t, k, vm0); got != "" {
		t.Fatalf("unprepare vm0: %q", got)
	}
	// Verified again (a reload, a restart), generation 8 does not let it go.
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if got := offers(d); !without("gpu0", 28)(got) {
		t.Fatalf("after a reload of generation 8 the plugin offers %v", got)
	}
	restarted, err := plugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := offers(restarted); !without("gpu0", 28)(got) {
		t.Fatalf("a restarted plugin offers %v", got)
	}
	publishedDevices(t, client, without("gpu0", 28))
	r.M.Generation = 9
	r.Sign(t)
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	publishedDevices(t, client, countIs(32))
}

// TestReleaseBeforeReload: generation 8 (another unit recycled while the tenant held
// gpu0) signed, and the claim released before the plugin's next reload (--reload, 30 s
// by default) verified it: gpu0 is withheld under 8 all the same, since unprepare
// verifies the manifest on disk before it records, and the next reload does not offer
// it; generation 9 does. Recorded under the generation verified last (7), the reload of
// 8 would offer gpu0 to the next tenant without a recycle.
func TestReleaseBeforeReload(t *testing.T) {
	r := newRig(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data}
	d, client, k, ctx := start(t, cfg, reg)
	vm0 := claim(t, client, d, "vm0", "gpu0")
	if got := prepare(t, k, vm0); got.Error != "" || len(got.Devices) != 4 {
		t.Fatalf("prepare vm0: %+v", got)
	}
	r.M.Generation = 8
	r.Sign(t)
	if got := unprepare(t, k, vm0); got != "" {
		t.Fatalf("unprepare vm0: %q", got)
	}
	if b, err := os.ReadFile(filepath.Join(data, "units.json")); err != nil || !strings.Contains(string(b), `"gpu0":{"generation":8,"state":"withheld"`) {
		t.Fatalf("units.json: %q %v, want gpu0 withheld under generation 8, the newest signed", b, err)
	}
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	publishedDevices(t, client, without("gpu0", 28))
	r.M.Generation = 9
	r.Sign(t)
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	publishedDevices(t, client, countIs(32))
}

// TestHookExportFailureKeepsPrepare (issue 40, finding 3, the plugin's half), through the
// DRA gRPC: a directory planted where the plugin exports the manifest for the hook makes
// every export fail; the plugin starts, publishes and prepares all the same, logging each
// failure with the path and the error and counting it; once the directory is gone, the
// next verification exports again. Before the fix the plugin refused to start, and every
// prepare on the node failed.
func TestHookExportFailureKeepsPrepare(t *testing.T) {
	r := newRig(t)
	cdiDir, reg, data := filepath.Join(r.Dir, "cdi"), filepath.Join(r.Dir, "registry"), filepath.Join(r.Dir, "plugin")
	hookDir := filepath.Join(r.Dir, "hook")
	planted := filepath.Join(hookDir, plugin.HookManifest)
	if err := os.MkdirAll(filepath.Join(planted, "planted"), 0o755); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var logged []string
	prom := filepath.Join(t.TempDir(), "passage-dra.prom")
	cfg := plugin.Config{Manifest: r.Path, Source: resources.Source{Keys: r.Keys}, Root: r.Root, CDIDir: cdiDir, StateDir: data, HookDir: hookDir,
		MetricsFile: prom, Logf: func(format string, args ...any) {
			mu.Lock()
			defer mu.Unlock()
			logged = append(logged, fmt.Sprintf(format, args...))
		}}
	d, client, k, ctx := start(t, cfg, reg)
	publishedDevices(t, client, countIs(32))
	if n := d.HookExportFailures(); n != 1 {
		t.Fatalf("%d export failures counted at start, want 1", n)
	}
	vm0 := claim(t, client, d, "vm0", "gpu0")
	if got := prepare(t, k, vm0); got.Error != "" || len(got.Devices) != 4 {
		t.Fatalf("prepare with the hook's manifest path a directory: %+v", got)
	}
	if n := d.HookExportFailures(); n != 2 {
		t.Fatalf("%d export failures counted after a prepare, want 2", n)
	}
	mu.Lock()
	for i, line := range logged {
		if !strings.Contains(line, hookDir) || !strings.Contains(line, planted) || !strings.Contains(line, fmt.Sprintf("(%d failures so far)", i+1)) {
			t.Errorf("log line %d %q: want the hook dir, the path that failed and the count", i, line)
		}
	}
	if len(logged) != 2 {
		t.Errorf("logged %q, want the two failures", logged)
	}
	mu.Unlock()
	// The counter, as node_exporter's textfile collector reads it: promtool judges the
	// exposition.
	text, err := os.ReadFile(prom)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(text), "\npassage_dra_hook_export_failures_total 2\n") {
		t.Errorf("%s:\n%s\nwant passage_dra_hook_export_failures_total 2", prom, text)
	}
	bin, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (image/deps.sh installs Debian's prometheus): %v", err)
	}
	cmd := exec.Command(bin, "check", "metrics")
	cmd.Stdin = bytes.NewReader(text)
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) != 0 {
		t.Errorf("promtool check metrics: %v\n%s\non:\n%s", err, out, text)
	}

	if err := os.RemoveAll(planted); err != nil {
		t.Fatal(err)
	}
	if err := d.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(planted); err != nil || !strings.Contains(string(b), "payload") {
		t.Fatalf("the next verification did not export: %.40q %v", b, err)
	}
	if n := d.HookExportFailures(); n != 2 {
		t.Fatalf("%d export failures counted after a good export, want 2", n)
	}
}
