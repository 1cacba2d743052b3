//go:build node

package images

// make node-import-test: the .oci.tar files make images writes, imported by the containerd
// and ctr the real node runs (kube/harness/noderuntime/build.sh), as the node's init
// imports them. containerd runs as root on this machine for the import alone: its root,
// state and sockets in temporary directories, in a mount namespace of its own (the
// snapshotter's mounts while it unpacks never reach the host's), with the plugins that
// would reach anything else (CRI, NRI's socket, /opt/containerd) off. No container is
// started.

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// TestContainerdImports: for every image make images writes, `ctr -n k8s.io images import
// --digests NAME.oci.tar` (unpacked into the overlayfs snapshotter, as the CRI will) names
// it by the reference its index carries, at the digest NAME.digest says; --digests adds
// a name for each tar's index (import-DATE@DIGEST); ctr images check finds all of every
// image's content, unpacked. PASSAGE_NODE_RUNTIME is noderuntime/build.sh's directory; the images are
// $PASSAGE_BUILD/images (default the work tree's build/images).
func TestContainerdImports(t *testing.T) {
	rt := os.Getenv("PASSAGE_NODE_RUNTIME")
	if rt == "" {
		t.Fatal("PASSAGE_NODE_RUNTIME: the directory kube/harness/noderuntime/build.sh printed (make node-import-test sets it)")
	}
	if os.Geteuid() != 0 {
		t.Fatalf("containerd runs as root (uid %d)", os.Geteuid())
	}
	build := os.Getenv("PASSAGE_BUILD")
	if build == "" {
		build = filepath.Join("..", "..", "build")
	}
	imagesDir := filepath.Join(build, "images")
	ctr := filepath.Join(rt, "ctr")

	// Short paths: a Unix socket's name has 108 bytes at most.
	base, err := os.MkdirTemp("", "ctrd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	root, state := filepath.Join(base, "root"), filepath.Join(base, "state")
	sock := filepath.Join(base, "sock")
	config := filepath.Join(base, "config.toml")
	// containerd's version 3 configuration. Off: the CRI (it would want CNI and runc), NRI
	// (its socket is /var/run/nri/nri.sock) and the opt plugin (/opt/containerd).
	if err := os.WriteFile(config, []byte(fmt.Sprintf(`version = 3
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime",
  "io.containerd.nri.v1.nri", "io.containerd.internal.v1.opt", "io.containerd.podsandbox.controller.v1.podsandbox"]
[grpc]
  address = %q
[ttrpc]
  address = %q
[debug]
  address = ""
[metrics]
  address = ""
`, root, state, sock, sock+".ttrpc")), 0o644); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(base, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	logTail := func() string {
		b, _ := os.ReadFile(log.Name())
		if len(b) > 4000 {
			b = b[len(b)-4000:]
		}
		return string(b)
	}
	cmd := exec.Command(filepath.Join(rt, "containerd"), "--config", config, "--root", root, "--state", state, "--address", sock, "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = log, log
	// Its own mount namespace: whatever it mounts ends with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	})

	run := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		c := exec.CommandContext(ctx, ctr, append([]string{"--address", sock, "-n", "k8s.io"}, args...)...)
		var stderr bytes.Buffer
		c.Stderr = &stderr
		out, err := c.Output()
		if err != nil {
			t.Fatalf("ctr %s: %v\n%s%s\ncontainerd's log:\n%s", strings.Join(args, " "), err, out, stderr.Bytes(), logTail())
		}
		return string(out)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		if c := exec.Command(ctr, "--address", sock, "version"); c.Run() == nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("containerd exited: %v\n%s", err, logTail())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("containerd not serving %s after a minute:\n%s", sock, logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("%s", strings.TrimSpace(run("version")))

	names := map[string]string{}   // reference → digest, as the build says
	indexes := map[string]string{} // the digest of each tar's index.json → image name
	for _, r := range append(Passage(), Node()...) {
		tarPath := filepath.Join(imagesDir, r.Name+".oci.tar")
		b, err := os.ReadFile(filepath.Join(imagesDir, r.Name+".digest"))
		if err != nil {
			t.Fatalf("%v: run make images", err)
		}
		digest := strings.TrimSpace(string(b))
		ref, inTar, index := tarRef(t, tarPath)
		indexes[index] = r.Name
		if inTar != digest {
			t.Fatalf("%s holds %s, %s.digest says %s: run make images", tarPath, inTar, r.Name, digest)
		}
		if i := strings.LastIndex(ref, ":"); i < 0 || !strings.HasSuffix(ref[:i], "/"+r.Name) || strings.ContainsAny(ref[i:], "/@") {
			t.Errorf("%s is named %q, not REGISTRY/%s:TAG", tarPath, ref, r.Name)
		}
		start := time.Now()
		out := run("images", "import", "--digests", tarPath)
		t.Logf("%s: imported in %v: %s", r.Name, time.Since(start).Round(time.Millisecond), strings.TrimSpace(out))
		names[ref] = digest
	}

	// REF TYPE DIGEST SIZE PLATFORMS LABELS, a header first.
	type image struct{ typ, digest string }
	listed := map[string]image{}
	for _, l := range strings.Split(strings.TrimSpace(run("images", "list")), "\n")[1:] {
		f := strings.Fields(l)
		if len(f) < 3 {
			t.Fatalf("ctr images list: %q", l)
		}
		listed[f[0]] = image{f[1], f[2]}
	}
	const manifest, index = "application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json"
	for ref, digest := range names {
		if got := listed[ref]; got != (image{manifest, digest}) {
			t.Errorf("containerd has %s as %+v, the build says %s %s", ref, got, manifest, digest)
		}
	}
	// --digests (without --base-name): one more name for each tar, import-DATE@DIGEST,
	// DIGEST its index.json's.
	byDigest := map[string]bool{}
	for ref, got := range listed {
		if _, named := names[ref]; named {
			continue
		}
		name, d, _ := strings.Cut(ref, "@")
		if !strings.HasPrefix(name, "import-") || d != got.digest || got.typ != index || indexes[d] == "" {
			t.Errorf("containerd has %s as %+v, which the build did not name", ref, got)
		}
		byDigest[indexes[d]] = true
	}
	if len(byDigest) != len(names) {
		t.Errorf("digest references for %d of %d tars: %v", len(byDigest), len(names), listed)
	}
	check := run("images", "check")
	for ref := range names {
		found := false
		for _, l := range strings.Split(check, "\n") {
			if f := strings.Fields(l); len(f) > 3 && f[0] == ref {
				found = true
				if !strings.Contains(l, " complete ") || !strings.HasSuffix(strings.TrimSpace(l), " true") {
					t.Errorf("ctr images check: %s", l)
				}
			}
		}
		if !found {
			t.Errorf("ctr images check does not list %s:\n%s", ref, check)
		}
	}
	t.Logf("ctr images check:\n%s", check)
}

// tarRef is the containerd name and the digest of the one manifest in an OCI layout tar,
// and the digest of its index.json.
func tarRef(t *testing.T, path string) (string, string, string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("%v: run make images", err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s: no index.json (%v)", path, err)
		}
		if h.Name != "index.json" {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		var idx v1.IndexManifest
		if err := json.Unmarshal(b, &idx); err != nil {
			t.Fatalf("%s: index.json: %v", path, err)
		}
		if len(idx.Manifests) != 1 {
			t.Fatalf("%s: %d manifests in index.json", path, len(idx.Manifests))
		}
		m := idx.Manifests[0]
		return m.Annotations[ContainerdName], m.Digest.String(), fmt.Sprintf("sha256:%x", sha256.Sum256(b))
	}
}
