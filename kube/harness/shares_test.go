package harness_test

import (
	"bufio"
	"bytes"
	"os/exec"
	"sort"
	"strings"
	"testing"

	"golang.org/x/mod/semver"
)

// The control plane's Kubernetes commands, as build.sh builds them from kubernetes/go.mod.
var kubeCommands = []string{"k8s.io/kubernetes/cmd/kube-apiserver",
	"k8s.io/kubernetes/cmd/kube-scheduler", "k8s.io/kubernetes/cmd/kube-controller-manager"}

// TestControlPlaneSharesKube: every module whose packages both the control plane's build
// (build.sh: kube-apiserver, kube-scheduler, kube-controller-manager from
// kubernetes/go.mod) and the kube module compile is at one version in both. build.sh
// builds as kube's tests
// do (cgo as the go command defaults, no -trimpath), so those packages are then the
// same Go build-cache entries: make test's unit phase compiles them once, and the
// control plane's cold build, about a third smaller, does not compile them again. A
// version that differs compiles its whole dependent graph twice; the error says which
// to align.
func TestControlPlaneSharesKube(t *testing.T) {
	cp := compiledModules(t, "kubernetes", false, kubeCommands...)
	kube := compiledModules(t, "..", true, "./...") // make test compiles kube's tests
	// k8s.io/api, apimachinery, client-go, apiserver, component-base, grpc, protobuf,
	// golang.org/x/*, ...: fewer means a list went wrong, not that nothing is shared.
	sameVersions(t, "kube", kube, "the control plane", cp, false,
		"require one version in both kube/go.mod and kube/harness/kubernetes/go.mod")
}

// TestHookSharesKube: every module whose packages both kube/kubevirthook (the KubeVirt
// hook sidecar, a module of its own) and kube compile is at one version in both, as for the
// control plane above. make test vets and race-tests both modules with the same flags,
// so their Kubernetes, grpc, protobuf and golang.org/x packages are then the same Go
// build-cache entries, compiled once. kube/kubevirthook/go.mod's replace block is
// KubeVirt v1.9.0's with its k8s.io pins moved to kube's versions: a version that differs (a
// KubeVirt bump that brings its own pins back, a kube bump not made in kube/kubevirthook) compiles
// that module and everything above it twice; the error says which to align.
func TestHookSharesKube(t *testing.T) {
	hook := compiledModules(t, "../kubevirthook", true, "./...")
	kube := compiledModules(t, "..", true, "./...")
	sameVersions(t, "kube/kubevirthook", hook, "kube", kube, false,
		"require (or, for k8s.io/*, replace) one version in both kube/go.mod and kube/kubevirthook/go.mod")
}

// TestEtcdSharesControlPlane: build.sh builds etcd (from etcd/go.mod) as it builds the
// Kubernetes commands, so every module etcd compiles at the control plane's version is
// a Go build-cache hit when etcd's turn comes (the standard library, protobuf,
// prometheus, x/sys, ...). etcd v3.7.3 requires newer versions of some (grpc, otel,
// x/net, its own client and api) than Kubernetes v1.37.2 does; raising those in
// kubernetes/go.mod would raise them in kube/go.mod too, so they are left: etcd compiles them
// and what stands on them itself. What the test holds: etcd never compiles a module at
// an older version than the control plane does (that one etcd/go.mod can raise).
func TestEtcdSharesControlPlane(t *testing.T) {
	etcd := compiledModules(t, "etcd", false, "go.etcd.io/etcd/server/v3")
	cp := compiledModules(t, "kubernetes", false, kubeCommands...)
	sameVersions(t, "etcd", etcd, "the control plane", cp, true,
		"raise it in kube/harness/etcd/go.mod (go get MODULE@<the control plane's>)")
}

// sameVersions fails naming every module a and b both compile at different versions (if
// newerOK, only those a compiles at an older version than b), in order, with fix; and
// fails if they share fewer than 20 modules: the Kubernetes client libraries, grpc,
// protobuf, golang.org/x/*, ... are among them, and fewer means a list went wrong, not
// that nothing is shared.
func sameVersions(t *testing.T, aName string, a map[string]string, bName string, b map[string]string, newerOK bool, fix string) {
	t.Helper()
	var paths []string
	for path := range a {
		if _, both := b[path]; both {
			paths = append(paths, path)
		}
	}
	sort.Strings(paths)
	for _, path := range paths {
		av, bv := a[path], b[path]
		if av == bv || newerOK && semver.Compare(av, bv) > 0 {
			continue
		}
		t.Errorf("%s: %s compiles %s, %s %s: %s", path, aName, av, bName, bv, fix)
	}
	if len(paths) < 20 {
		t.Fatalf("%d modules compiled by both %s and %s: want at least 20", len(paths), aName, bName)
	}
}

// compiledModules lists the modules (path → version, after replacements) whose
// packages go build would compile for pkgs in dir, with tests their test dependencies.
func compiledModules(t *testing.T, dir string, tests bool, pkgs ...string) map[string]string {
	t.Helper()
	args := []string{"list", "-mod=readonly", "-deps", "-f",
		"{{with .Module}}{{.Path}} {{.Version}}{{with .Replace}} {{.Version}}{{end}}{{end}}"}
	if tests {
		args = append(args, "-test")
	}
	cmd := exec.Command("go", append(args, pkgs...)...)
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
