package boot

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/stages"
)

// TestBootHostname runs whole boots of the reference node, named each way a node can be
// named and not at all: the kernel argument first (no wait for the network), a name the
// kernel already has, DHCP option 12 (the network stage before the manifest), and none
// (the hostname stage degraded, the manifest signed with an empty hostname and the
// error, never "(none)"). The kernel's hostname is a file of the tree, set through the
// injected sethostname, which writes it as the kernel would.
func TestBootHostname(t *testing.T) {
	dead := func(ctx context.Context, ifs []string) ([]netboot.Lease, error) {
		<-ctx.Done()
		return nil, fmt.Errorf("net %s: no carrier: %w", ifs[0], ctx.Err())
	}
	lease := func(name string) func(context.Context, []string) ([]netboot.Lease, error) {
		return func(_ context.Context, ifs []string) ([]netboot.Lease, error) {
			return []netboot.Lease{{Iface: ifs[0], MAC: "52:54:00:00:00:01", CIDR: "10.0.2.15/24", Server: net.IPv4(10, 0, 2, 2), Hostname: name}}, nil
		}
	}
	pcie := []string{"modules", "scan", "decide", "acs", "erase", "vfio", "host"}
	for _, tc := range []struct {
		name     string
		cmdline  string
		kernel   string // the tree's proc/sys/kernel/hostname; "" = no file
		netUp    func(context.Context, []string) ([]netboot.Lease, error)
		setErr   error
		want     string   // the manifest's node.hostname
		set      []string // sethostname calls
		order    []string // the stages the manifest carries
		status   stages.Status
		finding  string // in the hostname stage's findings or changes
		netAfter bool   // the network stage ran after the manifest
	}{
		{name: "kernel argument, DHCP's name ignored", cmdline: "passage.hostname=B300-R07-N3", kernel: "(none)", netUp: lease("from-dhcp"),
			want: "b300-r07-n3", set: []string{"b300-r07-n3"}, order: append(slices.Clone(pcie), "hostname"), status: stages.OK,
			finding: "hostname b300-r07-n3 (passage.hostname=; was (none))", netAfter: true},
		{name: "kernel argument, dead network: not waited for", cmdline: "passage.hostname=b300-r07-n3 passage.net_timeout=50ms", kernel: "(none)", netUp: dead,
			want: "b300-r07-n3", set: []string{"b300-r07-n3"}, order: append(slices.Clone(pcie), "hostname"), status: stages.OK, netAfter: true},
		{name: "named by the kernel", kernel: "b300-r07-n3", netUp: lease("from-dhcp"),
			want: "b300-r07-n3", order: append(slices.Clone(pcie), "hostname"), status: stages.OK, finding: "hostname b300-r07-n3 (kernel)", netAfter: true},
		{name: "DHCP option 12", kernel: "(none)", netUp: lease("b300-r07-n3"),
			want: "b300-r07-n3", set: []string{"b300-r07-n3"}, order: append(slices.Clone(pcie), "network", "hostname"), status: stages.OK,
			finding: "hostname b300-r07-n3 (DHCP option 12; was (none))"},
		{name: "DHCP option 12, no hostname file", netUp: lease("b300-r07-n3"),
			want: "b300-r07-n3", set: []string{"b300-r07-n3"}, order: append(slices.Clone(pcie), "network", "hostname"), status: stages.OK},
		{name: "DHCP without option 12", kernel: "(none)", netUp: lease(""),
			order: append(slices.Clone(pcie), "network", "hostname"), status: stages.Degraded,
			finding: "no hostname: no passage.hostname=, the kernel's hostname is (none), and no DHCP option 12: eth0 (server 10.0.2.2) sent none"},
		{name: "DHCP option 12 not a host name", kernel: "(none)", netUp: lease("node_7"),
			order: append(slices.Clone(pcie), "network", "hostname"), status: stages.Degraded, finding: `DHCP option 12 "node_7" on eth0 (server 10.0.2.2) passed over`},
		{name: "dead network: the manifest waits its deadline, then signs no name", cmdline: "passage.net_timeout=50ms", kernel: "(none)", netUp: dead,
			order: append(slices.Clone(pcie), "network", "hostname"), status: stages.Degraded, finding: "and no DHCP lease"},
		{name: "no network, no name", cmdline: "passage.net=off", kernel: "(none)",
			order: append(slices.Clone(pcie), "hostname"), status: stages.Degraded, finding: "no hostname", netAfter: true},
		{name: "sethostname refused", cmdline: "passage.hostname=b300-r07-n3", kernel: "(none)", netUp: lease(""), setErr: errors.New("operation not permitted"),
			set: []string{"b300-r07-n3"}, order: append(slices.Clone(pcie), "hostname"), status: stages.Failed, finding: "sethostname b300-r07-n3 (passage.hostname=): operation not permitted", netAfter: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bn := newBootNode(t)
			file := filepath.Join(bn.node.Root, hostnameFile)
			os.Remove(file)
			if tc.kernel != "" {
				if err := os.WriteFile(file, []byte(tc.kernel+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			b := bn.boot(bootCmdline + " " + tc.cmdline)
			var mu sync.Mutex
			var set []string
			b.SetHostname = func(name string) error {
				mu.Lock()
				set = append(set, name)
				mu.Unlock()
				if tc.setErr != nil {
					return tc.setErr
				}
				return os.WriteFile(file, []byte(name+"\n"), 0o644)
			}
			b.LinkUp = func(string) error { return nil }
			var netAfterManifest bool
			netUp := tc.netUp
			b.NetUp = func(ctx context.Context, ifs []string) ([]netboot.Lease, error) {
				_, err := bn.envelopeOnDisk()
				netAfterManifest = err == nil
				return netUp(ctx, ifs)
			}
			rs, err := (&stages.Runner{Stages: b.Stages()}).Run(context.Background(), &stages.State{})
			if err != nil {
				t.Fatal(err)
			}
			if r := resultOf(rs, "manifest"); r.Status != stages.OK {
				t.Fatalf("manifest %s %v %v", r.Status, r.Err, r.Findings)
			}
			m, err := bn.envelopeOnDisk()
			if err != nil {
				t.Fatal(err)
			}
			if m.Node.Hostname != tc.want {
				t.Errorf("signed hostname %q, want %q", m.Node.Hostname, tc.want)
			}
			noName := slices.ContainsFunc(m.Errors, func(e string) bool { return strings.Contains(e, "no hostname") })
			if noName != (tc.want == "") {
				t.Errorf("manifest errors %q: a no-hostname error %v, want %v", m.Errors, noName, tc.want == "")
			}
			if !slices.Equal(set, tc.set) {
				t.Errorf("sethostname %q, want %q", set, tc.set)
			}
			if got := stageNames(m); !slices.Equal(got, tc.order) {
				t.Errorf("manifest stages %v, want %v", got, tc.order)
			}
			h := resultOf(rs, "hostname")
			if h.Status != tc.status {
				t.Errorf("hostname stage %s %v %q, want %s", h.Status, h.Err, h.Findings, tc.status)
			}
			said := strings.Join(slices.Concat(h.Findings, h.Changes, []string{fmt.Sprint(h.Err)}), "\n")
			if !strings.Contains(said, tc.finding) {
				t.Errorf("hostname stage said\n%s\nwant %q", said, tc.finding)
			}
			// The manifest carries the hostname stage's result: the finding is signed.
			for _, s := range m.Stages {
				if s.Name == "hostname" && s.Status != string(tc.status) {
					t.Errorf("manifest's hostname stage %s, want %s", s.Status, tc.status)
				}
			}
			if tc.netUp != nil && netAfterManifest != tc.netAfter {
				t.Errorf("network stage after the manifest: %v, want %v", netAfterManifest, tc.netAfter)
			}
		})
	}
}

// TestHostnameDryRun: a dry run sets no hostname, and one whose name would come from DHCP
// says so instead of calling the node unnamed.
func TestHostnameDryRun(t *testing.T) {
	for _, tc := range []struct{ cmdline, kernel, finding string }{
		{"passage.hostname=b300-r07-n3", "(none)", "dry run: would set the hostname b300-r07-n3 (passage.hostname=)"},
		{"", "(none)", "a boot would take DHCP option 12"},
	} {
		root := t.TempDir()
		os.MkdirAll(filepath.Join(root, "proc/sys/kernel"), 0o755)
		os.WriteFile(filepath.Join(root, hostnameFile), []byte(tc.kernel+"\n"), 0o644)
		b := &Boot{Root: root, DryRun: true, Config: initramfs.ParseCmdline(tc.cmdline)}
		b.SetHostname = func(string) error { t.Error("dry run set the hostname"); return nil }
		rs, _ := run(t, b, "hostname")
		if r := rs[0]; r.Status != stages.OK || !slices.ContainsFunc(r.Findings, func(f string) bool { return strings.Contains(f, tc.finding) }) {
			t.Errorf("%q: hostname %s %q, want %q", tc.cmdline, r.Status, r.Findings, tc.finding)
		}
	}
}
