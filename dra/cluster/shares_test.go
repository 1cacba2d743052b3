package cluster_test

import (
	"bufio"
	"bytes"
	"os/exec"
	"sort"
	"strings"
	"testing"
)

// TestControlPlaneSharesDra: every module whose packages both the control plane's build
// (build.sh: kube-apiserver, kube-scheduler, kube-controller-manager from kube/go.mod)
// and the dra module compile is at one version in both. build.sh builds as dra's tests
// do (cgo as the go command defaults, no -trimpath), so those packages are then the
// same Go build-cache entries: make test's unit phase compiles them once, and the
// control plane's cold build, about a third smaller, does not compile them again. A
// version that differs compiles its whole dependent graph twice; the error says which
// to align.
func TestControlPlaneSharesDra(t *testing.T) {
	kube := compiledModules(t, "kube", "k8s.io/kubernetes/cmd/kube-apiserver",
		"k8s.io/kubernetes/cmd/kube-scheduler", "k8s.io/kubernetes/cmd/kube-controller-manager")
	dra := compiledModules(t, "..", "./...")
	shared := 0
	for path, kv := range kube {
		dv, both := dra[path]
		if !both {
			continue
		}
		shared++
		if dv != kv {
			t.Errorf("%s: dra compiles %s, the control plane %s: require one version in both dra/go.mod and dra/cluster/kube/go.mod (go get %s@<the newer>)", path, dv, kv, path)
		}
	}
	// k8s.io/api, apimachinery, client-go, apiserver, component-base, grpc, protobuf,
	// golang.org/x/*, ...: fewer means a list went wrong, not that nothing is shared.
	if shared < 20 {
		t.Fatalf("%d modules compiled by both: want the Kubernetes client libraries among them", shared)
	}
}

// TestHookSharesDra: every module whose packages both dra/hook (the KubeVirt hook
// sidecar, a module of its own) and dra compile is at one version in both, as for the
// control plane above. make test vets and race-tests both modules with the same flags,
// so their Kubernetes, grpc, protobuf and golang.org/x packages are then the same Go
// build-cache entries, compiled once. dra/hook/go.mod's replace block is KubeVirt
// v1.9.0's with its k8s.io pins moved to dra's versions: a version that differs (a
// KubeVirt bump that brings its own pins back, a dra bump not made in dra/hook) compiles
// that module and everything above it twice; the error says which to align.
func TestHookSharesDra(t *testing.T) {
	hook := compiledModules(t, "../hook", "./...")
	dra := compiledModules(t, "..", "./...")
	paths := make([]string, 0, len(hook))
	for path := range hook {
		paths = append(paths, path)
	}
	sort.Strings(paths)
	shared := 0
	for _, path := range paths {
		hv := hook[path]
		dv, both := dra[path]
		if !both {
			continue
		}
		shared++
		if dv != hv {
			t.Errorf("%s: dra compiles %s, dra/hook %s: require (or, for k8s.io/*, replace) one version in both dra/go.mod and dra/hook/go.mod", path, dv, hv)
		}
	}
	// k8s.io/api, apimachinery, grpc, protobuf, golang.org/x/*, ...: fewer means a list
	// went wrong, not that nothing is shared.
	if shared < 20 {
		t.Fatalf("%d modules compiled by both: want the Kubernetes client libraries among them", shared)
	}
}

// compiledModules lists the modules (path → version, after replacements) whose
// packages go build would compile for pkgs in dir, test dependencies included.
func compiledModules(t *testing.T, dir string, pkgs ...string) map[string]string {
	t.Helper()
	args := append([]string{"list", "-mod=readonly", "-deps", "-test", "-f",
		"{{with .Module}}{{.Path}} {{.Version}}{{with .Replace}} {{.Version}}{{end}}{{end}}"}, pkgs...)
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list in %s: %v\n%s", dir, err, stderr.Bytes())
	}
	mods := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue // the main module: no version
		}
		mods[f[0]] = f[len(f)-1]
	}
	return mods
}
