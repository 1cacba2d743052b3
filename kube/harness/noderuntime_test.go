package harness_test

import (
	"bufio"
	"bytes"
	"os/exec"
	"strings"
	"testing"
)

// TestNodeRuntimeAtReleasePins: every module noderuntime/build.sh compiles for the node's
// containerd, CNI plugins and runc is at the version that program's release requires in
// its own go.mod, so the binaries are built from what each project released and tested,
// not from versions minimum version selection chose for a mix. That is why they are three
// modules: in one, the CNI plugins' requirements (hcsshim for Windows, grpc, otel) moved
// containerd's, and containerd's moved runc's (selinux, cilium/ebpf, go-criu). The error
// names each module and both versions.
func TestNodeRuntimeAtReleasePins(t *testing.T) {
	const cd, cni = "github.com/containerd/containerd/v2", "github.com/containernetworking/plugins"
	for _, m := range []struct {
		dir, release string
		pkgs         []string
	}{
		{"noderuntime/containerd", cd, []string{cd + "/cmd/containerd", cd + "/cmd/containerd-shim-runc-v2", cd + "/cmd/ctr"}},
		{"noderuntime/cni", cni, []string{cni + "/plugins/main/ptp", cni + "/plugins/main/bridge", cni + "/plugins/ipam/host-local",
			cni + "/plugins/main/loopback", cni + "/plugins/meta/portmap"}},
		{"noderuntime/runc", "github.com/opencontainers/runc", []string{"github.com/opencontainers/runc"}},
	} {
		t.Run(m.dir, func(t *testing.T) {
			version := goOut(t, m.dir, "list", "-mod=readonly", "-m", "-f", "{{.Version}}", m.release)
			from := m.release + "@" + strings.TrimSpace(version)
			requires := map[string]string{}
			sc := bufio.NewScanner(strings.NewReader(goOut(t, m.dir, "mod", "graph")))
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				if len(f) == 2 && f[0] == from {
					path, v, _ := strings.Cut(f[1], "@")
					requires[path] = v
				}
			}
			if len(requires) < 10 {
				t.Fatalf("%s requires %d modules in the module graph: the graph or the release is not what it seems", from, len(requires))
			}
			compiled := compiledModules(t, m.dir, false, m.pkgs...)
			if compiled[m.release] == "" {
				t.Fatalf("%s compiles no package of %s", m.dir, m.release)
			}
			for path, v := range compiled {
				switch want, ok := requires[path]; {
				case path == m.release:
				case !ok:
					t.Errorf("%s compiles %s %s, which %s's go.mod does not require", m.dir, path, v, from)
				case want != v:
					t.Errorf("%s compiles %s %s, %s requires %s: keep the module to the release's pins", m.dir, path, v, from, want)
				}
			}
		})
	}
}

func goOut(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go %s in %s: %v\n%s", strings.Join(args, " "), dir, err, stderr.Bytes())
	}
	return string(out)
}
