package boot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// preManifest are the stages whose results the manifest carries: everything before it,
// when the node's name does not have to come from DHCP.
var preManifest = []string{"modules", "scan", "decide", "acs", "erase", "vfio", "host", "hostname"}

// TestStageOrder: the manifest comes before the network, unless the node's name can come
// only from DHCP (no passage.hostname=, none in the kernel, the network on): then the
// network stage runs first, and the manifest after it, Always and needing nothing, so a
// dead network costs it the network's deadline and never the manifest.
func TestStageOrder(t *testing.T) {
	named := t.TempDir()
	os.MkdirAll(filepath.Join(named, "proc/sys/kernel"), 0o755)
	os.WriteFile(filepath.Join(named, "proc/sys/kernel/hostname"), []byte("b300-r07-n3\n"), 0o644)
	unnamed := t.TempDir()
	os.MkdirAll(filepath.Join(unnamed, "proc/sys/kernel"), 0o755)
	os.WriteFile(filepath.Join(unnamed, "proc/sys/kernel/hostname"), []byte("(none)\n"), 0o644)
	pcie := []string{"modules", "scan", "decide", "acs", "erase", "vfio", "host"}
	after := []string{"manifest", "network", "publish", "push"}
	for _, tc := range []struct {
		name, root, cmdline string
		want                []string
	}{
		{"named by the kernel argument", unnamed, "passage.hostname=b300-r07-n3", slices.Concat(pcie, []string{"hostname"}, after)},
		{"named by the kernel", named, "", slices.Concat(pcie, []string{"hostname"}, after)},
		{"no network", unnamed, "passage.net=off", slices.Concat(pcie, []string{"hostname"}, after)},
		{"named by DHCP", unnamed, "", slices.Concat(pcie, []string{"network", "hostname", "manifest", "publish", "push"})},
		{"no hostname file: named by DHCP", t.TempDir(), "", slices.Concat(pcie, []string{"network", "hostname", "manifest", "publish", "push"})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &Boot{Root: tc.root, Config: initramfs.ParseCmdline(tc.cmdline)}
			list := b.Stages()
			var names []string
			byName := map[string]stages.Stage{}
			for _, s := range list {
				names = append(names, s.Name)
				byName[s.Name] = s
			}
			if !reflect.DeepEqual(names, tc.want) {
				t.Fatalf("stages %v, want %v", names, tc.want)
			}
			if err := (&stages.Runner{Stages: list}).Validate(); err != nil {
				t.Fatal(err)
			}
			if m := byName["manifest"]; !m.Always || len(m.Needs) > 0 {
				t.Errorf("manifest Always %v, needs %v: a cancelled run or a failed stage would leave no manifest", m.Always, m.Needs)
			}
			if n := byName["hostname"].Needs; len(n) > 0 {
				t.Errorf("hostname needs %v: a dead network must leave the node unnamed, not the stage skipped", n)
			}
			for _, name := range []string{"publish", "push"} {
				// With passage.net=off publish goes to a loopback URL only, and needs no network.
				if n := byName[name].Needs; !slices.Contains(n, "manifest") || !slices.Contains(n, "network") && (name == "push" || b.Config.Net != initramfs.NetOff) {
					t.Errorf("%s needs %v, want network and manifest", name, n)
				}
			}
			// Nothing is written before the decision, and nothing bound unless the acs stage
			// completed: a vfio stage after a failed acs stage would bind units whose isolation
			// was never written.
			for name, want := range map[string][]string{"decide": {"scan"}, "acs": {"decide"}, "vfio": {"decide", "acs"}} {
				if n := byName[name].Needs; !reflect.DeepEqual(n, want) {
					t.Errorf("%s needs %v, want %v", name, n, want)
				}
			}
			if byName["network"].Timeout != b.Config.NetTimeout || b.Config.NetTimeout <= 0 {
				t.Errorf("network timeout %v, want passage.net_timeout (%v)", byName["network"].Timeout, b.Config.NetTimeout)
			}
		})
	}
}

// bootNode is a synthetic B300 with what a whole boot needs and nothing that reaches the
// machine: modules that are all built in (no finit_module), a simulated vfio kernel, a
// signing key, and two netdevs: eth0 on the management NIC mgmt0 and eth1 on a unit's
// CX-8 PF.
type bootNode struct {
	node *pcitest.Node
	kern *vfiotest.Kernel
	ver  manifest.Verifier
}

func newBootNode(t *testing.T) *bootNode {
	t.Helper()
	return newBootNodeOf(t, pcitest.B300())
}

// newBootNodeOf is newBootNode on another spec.
func newBootNodeOf(t *testing.T, spec pcitest.Spec) *bootNode {
	t.Helper()
	n := pcitest.New(t, spec)
	root := n.Root
	files := map[string]string{
		"proc/sys/kernel/osrelease":      "6.12.0-passage\n",
		"proc/sys/kernel/random/boot_id": "b00705de\n",
		// Named before passage runs (the kernel's own hostname= argument): the manifest
		// keeps its place before the network (hostname_test.go has the other ways).
		"proc/sys/kernel/hostname": "b300-r07-n3\n",
		"lib/modules/6.12.0-passage/modules.builtin": "kernel/drivers/vfio/vfio.ko\nkernel/drivers/vfio/vfio_iommu_type1.ko\n" +
			"kernel/drivers/vfio/pci/vfio-pci.ko\nkernel/drivers/net/ethernet/broadcom/bnxt/bnxt_en.ko\n",
	}
	for p, c := range files {
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for name, fn := range map[string]string{"eth0": "mgmt0", "eth1": "nic0.0"} {
		dir := filepath.Join(root, "sys/class/net", name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("../../../bus/pci/devices/"+n.Addr(fn).String(), filepath.Join(dir, "device")); err != nil {
			t.Fatal(err)
		}
	}
	keyDir := filepath.Join(root, "etc/passage")
	os.MkdirAll(keyDir, 0o755)
	_, pub, err := manifest.GenerateKey(keyDir)
	if err != nil {
		t.Fatal(err)
	}
	v, err := manifest.LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Load("vfio-pci"); err != nil {
		t.Fatal(err)
	}
	return &bootNode{node: n, kern: k, ver: v}
}

const bootCmdline = "passage.profile=b300 passage.tpm=off passage.key=/etc/passage/passage.key passage.host_modules=bnxt_en"

// boot is a boot of the node without the erase stage (erase_test.go has its own):
// b300's default passage.erase=require would fail every unit of a tree with no NVMe
// controller behind its functions.
func (bn *bootNode) boot(cmdline string) *Boot {
	return &Boot{Root: bn.node.Root, Config: initramfs.ParseCmdline("passage.erase=off " + cmdline), Sysfs: bn.kern}
}

// envelopeOnDisk verifies the envelope the manifest stage left in /run/passage.
func (bn *bootNode) envelopeOnDisk() (*manifest.Manifest, error) {
	env, err := os.ReadFile(filepath.Join(bn.node.Root, "run/passage", EnvelopeName))
	if err != nil {
		return nil, err
	}
	ver, err := manifest.Verify(env, bn.ver, manifest.VerifyOptions{})
	if err != nil {
		return nil, err
	}
	return ver.Manifest, nil
}

func stageNames(m *manifest.Manifest) []string {
	var out []string
	for _, s := range m.Stages {
		out = append(out, s.Name)
	}
	return out
}

func resultOf(rs []stages.Result, name string) stages.Result {
	for _, r := range rs {
		if r.Name == name {
			return r
		}
	}
	return stages.Result{Name: name, Status: "missing"}
}

// events is what the boot did to the (fake) network, in order.
type events struct {
	mu sync.Mutex
	ev []string
}

func (e *events) add(format string, a ...any) {
	e.mu.Lock()
	e.ev = append(e.ev, fmt.Sprintf(format, a...))
	e.mu.Unlock()
}

func (e *events) list() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.ev)
}

// TestBootManifestBeforeNetwork runs every stage of a boot. The network stage finds the
// signed manifest already on disk, without a network result in it; the early link-up
// reached the management NIC only, before the network stage; the lease goes to the
// runner's results and the readback, not the manifest.
func TestBootManifestBeforeNetwork(t *testing.T) {
	bn := newBootNode(t)
	b := bn.boot(bootCmdline)
	var ev events
	// The early link-up runs in the background: one that takes until the manifest is on
	// disk must not hold the manifest back (were it in the host stage's path, this would
	// wait out its bound and the test fail).
	b.LinkUp = func(iface string) error {
		for i := 0; i < 2000; i++ {
			if _, err := bn.envelopeOnDisk(); err == nil {
				ev.add("link-up %s after the manifest", iface)
				return nil
			}
			time.Sleep(5 * time.Millisecond)
		}
		ev.add("link-up %s: no manifest in 10 s", iface)
		return errors.New("no manifest")
	}
	var atNetwork *manifest.Manifest
	b.NetUp = func(_ context.Context, ifs []string) ([]netboot.Lease, error) {
		ev.add("net-up %s", strings.Join(ifs, ","))
		m, err := bn.envelopeOnDisk()
		if err != nil {
			return nil, fmt.Errorf("no verified manifest on disk when the network stage ran: %w", err)
		}
		atNetwork = m
		return []netboot.Lease{{Iface: ifs[0], MAC: "52:54:00:00:00:01", CIDR: "10.0.2.15/24"}}, nil
	}
	st := &stages.State{}
	rs, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), st)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range append(slices.Clone(preManifest), "manifest", "network") {
		if r := resultOf(rs, name); r.Status != stages.OK && r.Status != stages.Degraded && (name != "erase" || r.Status != stages.Skipped) {
			t.Errorf("stage %s: %s %v %v", name, r.Status, r.Err, r.Findings)
		}
	}
	if r := resultOf(rs, "publish"); r.Status != stages.Skipped || !strings.Contains(fmt.Sprint(r.Err), "passage.url") {
		t.Errorf("publish %s %v, want skipped for passage.url", r.Status, r.Err)
	}
	if got, want := ev.list(), []string{"link-up eth0 after the manifest", "net-up eth0"}; !reflect.DeepEqual(got, want) {
		t.Errorf("network events %q, want %q (management NIC only, early link-up joined before DHCP)", got, want)
	}
	if h := resultOf(rs, "host"); !slices.ContainsFunc(h.Changes, func(c string) bool { return strings.HasPrefix(c, "link-up of eth0 started") }) {
		t.Errorf("host stage changes %q, want eth0's early link-up started", h.Changes)
	}
	if n := resultOf(rs, "network"); !slices.ContainsFunc(n.Findings, func(f string) bool { return strings.HasPrefix(f, "early link-up eth0: up in") }) {
		t.Errorf("network findings %q, want the early link-up's outcome", n.Findings)
	}
	if atNetwork == nil {
		t.Fatal("the network stage saw no manifest")
	}
	if got := stageNames(atNetwork); !reflect.DeepEqual(got, preManifest) {
		t.Errorf("manifest stages %v, want %v (network and publish come after it)", got, preManifest)
	}
	if got := stageNames(b.Manifest); !reflect.DeepEqual(got, preManifest) {
		t.Errorf("b.Manifest stages %v, want %v", got, preManifest)
	}
	// A whole boot of the reference node passes every unit through: ready in the signed
	// manifest, the verdicts and the runner's state, every function on vfio-pci.
	if len(atNetwork.Units) != 8 || len(b.Verdicts) != 8 {
		t.Fatalf("%d units in the manifest, %d verdicts, want 8", len(atNetwork.Units), len(b.Verdicts))
	}
	for i, u := range atNetwork.Units {
		if u.Status != string(topology.StatusReady) || b.Verdicts[i].Status != topology.StatusReady || UnitID(b.Verdicts[i].Unit) != u.ID {
			t.Errorf("unit %s: %s %q, verdict %+v", u.ID, u.Status, u.Reasons, b.Verdicts[i])
		}
		for _, f := range u.Functions {
			if f.DriverAfter != "vfio-pci" {
				t.Errorf("unit %s: %s on %q", u.ID, f.BDF, f.DriverAfter)
			}
		}
	}
	for _, u := range st.Units() {
		if u.Status != stages.OK {
			t.Errorf("unit %s in the runner's state: %s %q", u.ID, u.Status, u.Reasons)
		}
	}
	if n := resultOf(rs, "network"); !slices.ContainsFunc(n.Changes, func(c string) bool { return strings.Contains(c, "10.0.2.15/24") }) {
		t.Errorf("network changes %q, want the lease", n.Changes)
	}
	// eth1 sits on a unit's NIC PF: the network stage says why it left it out.
	if n := resultOf(rs, "network"); !slices.ContainsFunc(n.Findings, func(f string) bool { return strings.Contains(f, "eth1") }) {
		t.Errorf("network findings %q, want eth1 named as a passthrough function", n.Findings)
	}
	// The readback, written after the stages, still carries the lease.
	if err := b.WriteReadback(); err != nil {
		t.Fatal(err)
	}
	var rb Readback
	j, err := os.ReadFile(filepath.Join(bn.node.Root, "run/passage", ReadbackName))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(j, &rb); err != nil {
		t.Fatal(err)
	}
	if len(rb.Leases) != 1 || !strings.Contains(rb.Leases[0], "eth0 52:54:00:00:00:01: 10.0.2.15/24") {
		t.Errorf("readback leases %q", rb.Leases)
	}
}

// TestBootDeadNetworkKeepsManifest: a network stage that never gets carrier runs into
// passage.net_timeout after the manifest is signed; publish is skipped.
func TestBootDeadNetworkKeepsManifest(t *testing.T) {
	bn := newBootNode(t)
	b := bn.boot(bootCmdline + " passage.net_timeout=50ms")
	b.LinkUp = func(string) error { return nil }
	b.NetUp = func(ctx context.Context, ifs []string) ([]netboot.Lease, error) {
		<-ctx.Done()
		return nil, fmt.Errorf("net %s: no carrier: %w", ifs[0], ctx.Err())
	}
	rs, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{})
	if err != nil {
		t.Fatal(err)
	}
	if r := resultOf(rs, "manifest"); r.Status != stages.OK {
		t.Fatalf("manifest %s %v %v", r.Status, r.Err, r.Findings)
	}
	if r := resultOf(rs, "network"); r.Status != stages.Failed || !errors.Is(r.Err, context.DeadlineExceeded) {
		t.Errorf("network %s %v, want failed at passage.net_timeout", r.Status, r.Err)
	}
	if r := resultOf(rs, "publish"); r.Status != stages.Skipped || !strings.Contains(fmt.Sprint(r.Err), "needs network") {
		t.Errorf("publish %s %v, want skipped: needs network", r.Status, r.Err)
	}
	m, err := bn.envelopeOnDisk()
	if err != nil {
		t.Fatal(err)
	}
	if got := stageNames(m); !reflect.DeepEqual(got, preManifest) {
		t.Errorf("manifest stages %v, want %v", got, preManifest)
	}
}

// TestHostEarlyLinkUp: the host stage sets the network stage's links up after loading the
// host drivers, only when the network stage will run, and a refusal is a finding.
func TestHostEarlyLinkUp(t *testing.T) {
	refused := errors.New("operation not permitted")
	tests := []struct {
		name       string
		cmdline    string
		dryRun     bool
		fail       error
		wantStatus stages.Status
		wantCalls  []string
		wantChange string // prefix of a host stage change
		wantFind   string // substring of a host stage finding
		wantJoin   string // prefix of what the network stage's join reports
	}{
		{name: "auto picks the management NIC", cmdline: bootCmdline,
			wantStatus: stages.OK, wantCalls: []string{"eth0"}, wantChange: "link-up of eth0 started", wantJoin: "early link-up eth0: up in"},
		{name: "named interface", cmdline: bootCmdline + " passage.net=eno1",
			wantStatus: stages.OK, wantCalls: []string{"eno1"}, wantChange: "link-up of eno1 started", wantJoin: "early link-up eno1: up in"},
		{name: "refused is a finding", cmdline: bootCmdline, fail: refused,
			wantStatus: stages.OK, wantCalls: []string{"eth0"}, wantChange: "link-up of eth0 started",
			wantJoin: "early link-up eth0: operation not permitted"},
		{name: "net off", cmdline: bootCmdline + " passage.net=off",
			wantStatus: stages.OK, wantFind: "module bnxt_en: already loaded or built in"},
		{name: "dry run", cmdline: bootCmdline, dryRun: true,
			wantStatus: stages.OK, wantFind: "dry run: would load bnxt_en"},
		{name: "no host modules, built-in NIC driver", cmdline: bootCmdline + " passage.host_modules=",
			wantStatus: stages.OK, wantCalls: []string{"eth0"}, wantChange: "link-up of eth0 started", wantJoin: "early link-up eth0: up in"},
		{name: "no host modules, net off", cmdline: bootCmdline + " passage.host_modules= passage.net=off",
			wantStatus: stages.Skipped},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bn := newBootNode(t)
			b := bn.boot(tt.cmdline)
			b.DryRun = tt.dryRun
			var calls []string
			b.LinkUp = func(iface string) error {
				calls = append(calls, iface)
				return tt.fail
			}
			rs, _ := run(t, b, "scan", "decide", "host")
			h := rs[2]
			if h.Status != tt.wantStatus {
				t.Fatalf("host %s %v %v, want %s", h.Status, h.Err, h.Findings, tt.wantStatus)
			}
			// The link-up runs in the background; the network stage joins it.
			joined := &stages.Result{}
			b.joinEarlyLinks(context.Background(), joined)
			if tt.wantJoin != "" && !slices.ContainsFunc(joined.Findings, func(f string) bool { return strings.HasPrefix(f, tt.wantJoin) }) {
				t.Errorf("joined %q, want %q", joined.Findings, tt.wantJoin)
			}
			if tt.wantJoin == "" && len(joined.Findings) > 0 {
				t.Errorf("joined %q, want no early link-up", joined.Findings)
			}
			if !reflect.DeepEqual(calls, tt.wantCalls) {
				t.Errorf("link-up calls %q, want %q", calls, tt.wantCalls)
			}
			if tt.wantChange != "" && !slices.ContainsFunc(h.Changes, func(c string) bool { return strings.HasPrefix(c, tt.wantChange) }) {
				t.Errorf("changes %q, want %q", h.Changes, tt.wantChange)
			}
			if tt.wantChange == "" && slices.ContainsFunc(h.Changes, func(c string) bool { return strings.HasPrefix(c, "link-up ") }) {
				t.Errorf("changes %q, want no link brought up", h.Changes)
			}
			if tt.wantFind != "" && !slices.ContainsFunc(h.Findings, func(f string) bool { return strings.Contains(f, tt.wantFind) }) {
				t.Errorf("findings %q, want %q", h.Findings, tt.wantFind)
			}
		})
	}
}

// TestHostEarlyLinkUpWithoutNetdevs: a node whose /sys/class/net cannot be read still
// finishes the host stage; the finding names the directory.
func TestHostEarlyLinkUpWithoutNetdevs(t *testing.T) {
	bn := newBootNode(t)
	if err := os.RemoveAll(filepath.Join(bn.node.Root, "sys/class/net")); err != nil {
		t.Fatal(err)
	}
	b := bn.boot(bootCmdline)
	b.LinkUp = func(iface string) error {
		t.Errorf("link-up %s without a netdev", iface)
		return nil
	}
	rs, _ := run(t, b, "scan", "decide", "host")
	h := rs[2]
	if h.Status != stages.OK || !slices.ContainsFunc(h.Findings, func(f string) bool {
		return strings.Contains(f, "early link-up") && strings.Contains(f, "class/net")
	}) {
		t.Errorf("host %s %v, findings %q", h.Status, h.Err, h.Findings)
	}
}

// TestEarlyLinkUpOutlivesNetworkDeadline: a link-up still running when the network stage's
// time is up is a finding; the stage does not wait past its deadline for it.
func TestEarlyLinkUpOutlivesNetworkDeadline(t *testing.T) {
	bn := newBootNode(t)
	b := bn.boot(bootCmdline)
	release := make(chan struct{})
	b.LinkUp = func(string) error {
		<-release
		return nil
	}
	defer close(release)
	if rs, _ := run(t, b, "scan", "decide", "host"); rs[2].Status != stages.OK {
		t.Fatalf("host %s %v", rs[2].Status, rs[2].Err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	r := &stages.Result{}
	b.joinEarlyLinks(ctx, r)
	if !slices.ContainsFunc(r.Findings, func(f string) bool { return strings.Contains(f, "still running") }) {
		t.Errorf("findings %q, want the early link-up still running", r.Findings)
	}
}
