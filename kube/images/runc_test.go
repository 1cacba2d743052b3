package images

// The passage-dra image run by a real OCI runtime (runc), as a node's containerd would
// run it: its own glibc, the host's library directory mounted read-only, and libnvfm
// dlopen'ed from there. The library is fmstub.c, passage's stand-in (package
// fabrictest); no FM is involved.

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/passage-boot/passage/kube/fabricmanager/fabrictest"
	"github.com/passage-boot/passage/kube/internal/noderig"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// TestRuncRunsDRA builds passage-dra with cgo (buildDRA), its image on
// the glibc base kube/images/glibc-base names (Debian's packages, which make deps
// fetches into the build directory: glibcBase), writes and reads back the layout, unpacks it into
// a bundle and runs it with runc: passage-dra fabric check, the library given as the
// daemonset gives it (--fm-lib under the read-only host mount), answers that FM's
// partitions and the manifest agree, and the stand-in logged the calls. Then the same
// without the mount (the load fails, naming the path: nothing else in the container
// has a libnvfm), and without the image's libc.so.6 (passage-dra does not start: its
// libc is the image's, not the host's).
func TestRuncRunsDRA(t *testing.T) {
	runc, err := exec.LookPath("runc")
	if err != nil {
		t.Fatalf("runc: %v: image/deps.sh installs it (Debian's runc)", err)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("runc run needs root (uid %d): the test makes a container as a node's runtime does", os.Geteuid())
	}
	start := time.Now()
	debs := glibcBase(t)
	bin := buildDRA(t)
	t.Logf("base (%d packages) and passage-dra ready after %v", len(debs), time.Since(start).Round(time.Millisecond))

	s := Spec{Recipe: Passage()[0], Binary: bin, Debs: debs, Arch: runtime.GOARCH}
	img, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "passage-dra")
	if _, err := Write(dir, img, "latest"); err != nil {
		t.Fatal(err)
	}
	t.Logf("image built and written after %v", time.Since(start).Round(time.Millisecond))
	if img, err = Read(dir); err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	bundle := t.TempDir()
	rootfs := filepath.Join(bundle, "rootfs")
	unpack(t, img, rootfs)
	t.Logf("read back and unpacked after %v", time.Since(start).Round(time.Millisecond))

	// A B300 node's manifest with the Module IDs and the layout FM's partitions are held
	// to, as passage-dra's TestFabricCheckCommand signs it; the stand-in FM serving.
	keys := filepath.Join(t.TempDir(), "keys")
	uuid := manifesttest.NodeUUID(5)
	r := noderig.New(t, uuid, "b300-fm", 4, keys)
	for i := range r.M.Units {
		r.M.Units[i].ModuleID, r.M.Units[i].ModuleSource = i+1, "test"
	}
	r.M.NVLink = &manifest.NVLink{Partitions: [][]int{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4}, {5, 6, 7, 8},
		{1, 2}, {3, 4}, {5, 6}, {7, 8}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}}, Source: "FM User Guide, HGX B200/B300"}
	r.Sign(t)
	fm := fabrictest.New(t)
	// The host's library directory: the stand-in as libnvfm.so.1, as FM's dev package
	// installs it in /usr/lib/x86_64-linux-gnu.
	hostLib := t.TempDir()
	lib, err := os.ReadFile(fabrictest.Library(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hostLib, "libnvfm.so.1"), lib, 0o644); err != nil {
		t.Fatal(err)
	}
	const libDir = "/host/usr/lib/x86_64-linux-gnu" // daemonset.yaml's fm-lib mount
	bind := func(src, dst string, ro bool) specs.Mount {
		o := []string{"rbind", "nosuid", "nodev"}
		if ro {
			o = append(o, "ro")
		}
		return specs.Mount{Destination: dst, Type: "bind", Source: src, Options: o}
	}
	mounts := []specs.Mount{
		bind(keys, "/keys", true),
		bind(r.Dir, "/passage", true),
		bind(filepath.Dir(fm.Path), "/fm", false), // the stand-in's state and log
	}
	args := append(append([]string{}, cf.Config.Entrypoint...), "fabric", "check", "--pub", "/keys", "--node-uuid", uuid,
		"--fm-lib", libDir+"/libnvfm.so.1", "/passage/"+filepath.Base(r.Path))
	env := append(append([]string{}, cf.Config.Env...), fabrictest.StateEnv+"=/fm/"+filepath.Base(fm.Path))

	code, out, errs := runBundle(t, runc, bundle, cf.Config, args, env, append(mounts, bind(hostLib, libDir, true)))
	if code != 0 || !strings.Contains(out, "FM's 15 partitions and manifest generation 7 of node b300-fm agree") {
		t.Fatalf("passage-dra fabric check in the container: exit %d\n%s%s", code, out, errs)
	}
	if calls := fm.Calls(t, "list"); len(calls) == 0 {
		t.Fatalf("the stand-in libnvfm logged no list call: %q", fm.Log(t))
	}
	t.Logf("in the container: %s", strings.SplitN(out, "\n", 2)[0])

	code, out, errs = runBundle(t, runc, bundle, cf.Config, args, env, mounts)
	if code != 1 || !strings.Contains(errs, "fm: load "+libDir+"/libnvfm.so.1: ") {
		t.Errorf("without the host's library directory: exit %d\n%s%s", code, out, errs)
	}

	if err := os.Remove(filepath.Join(rootfs, "lib/x86_64-linux-gnu/libc.so.6")); err != nil {
		t.Fatal(err)
	}
	code, out, errs = runBundle(t, runc, bundle, cf.Config, []string{cf.Config.Entrypoint[0], "help"}, env, mounts)
	if code == 0 || !strings.Contains(errs, "libc.so.6") {
		t.Errorf("without the image's libc.so.6: exit %d\n%s%s", code, out, errs)
	}
	t.Logf("took %v", time.Since(start).Round(time.Millisecond))
}

// glibcBase are the packages glibc-base names, as make images takes them: fetched by
// make deps (image/deps.sh runs debs.sh into $PASSAGE_BUILD/images/debs, default the
// work tree's build/, and names them in glibc-base.list there), never downloaded here.
// A list made from another glibc-base than this one is refused as absent.
func glibcBase(t *testing.T) []*Deb {
	t.Helper()
	build := os.Getenv("PASSAGE_BUILD")
	if build == "" {
		build = filepath.Join("..", "..", "build")
	}
	dir := filepath.Join(build, "images", "debs")
	base, err := os.ReadFile("glibc-base")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(base)
	want := "# kube/images/glibc-base sha256:" + hex.EncodeToString(sum[:])
	list, err := os.ReadFile(filepath.Join(dir, "glibc-base.list"))
	if err != nil {
		t.Fatalf("passage-dra's base packages: %v: run make deps (image/deps.sh fetches them)", err)
	}
	first, names, _ := strings.Cut(string(list), "\n")
	if first != want {
		t.Fatalf("%s was made from another glibc-base (%q, this one's is %q): run make deps", filepath.Join(dir, "glibc-base.list"), first, want)
	}
	var debs []*Deb
	for _, n := range strings.Fields(names) {
		d, err := OpenDeb(filepath.Join(dir, n))
		if err != nil {
			t.Fatalf("%v: run make deps (image/deps.sh fetches passage-dra's base packages)", err)
		}
		debs = append(debs, d)
	}
	if len(debs) < 3 {
		t.Fatalf("%s names %d packages: run make deps", filepath.Join(dir, "glibc-base.list"), len(debs))
	}
	return debs
}

// buildDRA builds passage-dra with cgo, as the go command defaults and as make unit's
// go vet compiles the kube module's packages before the tests run: passage-dra's link
// is then all that is new (with make images's -trimpath every package would be
// compiled again, minutes on 2 cores). -s -w, as make images (a link flag: no package
// is compiled again for it), leave out a third of the binary the image would carry;
// -trimpath and -buildvcs=false change the paths the binary names, not what it loads.
func buildDRA(t *testing.T) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "passage-dra")
	cmd := exec.Command("go", "build", "-ldflags=-s -w", "-o", out, "./cmd/passage-dra")
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build passage-dra: %v\n%s", err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// unpack writes the image's flattened file system (mutate.Extract: upper layers
// first, what they hide left out) below root, owners and modes kept. A name whose
// parent is a symbolic link is refused: it would write outside root.
func unpack(t *testing.T, img v1.Image, root string) {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	type dirMode struct {
		path string
		mode os.FileMode
	}
	var dirs []dirMode
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(root, filepath.FromSlash(h.Name))
		for d := filepath.Dir(p); d != root && len(d) > len(root); d = filepath.Dir(d) {
			if fi, err := os.Lstat(d); err == nil && fi.Mode()&os.ModeSymlink != 0 {
				t.Fatalf("unpack %s: %s is a symbolic link", h.Name, d)
			}
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		mode := os.FileMode(h.Mode & 0o777)
		if h.Mode&0o1000 != 0 {
			mode |= os.ModeSticky
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			dirs = append(dirs, dirMode{p, mode}) // after its files are written
		case tar.TypeReg:
			f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.Copy(f, tr); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, mode); err != nil {
				t.Fatal(err)
			}
		case tar.TypeSymlink:
			if err := os.Symlink(h.Linkname, p); err != nil {
				t.Fatal(err)
			}
		case tar.TypeLink:
			if err := os.Link(filepath.Join(root, filepath.FromSlash(h.Linkname)), p); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("unpack %s: type %q", h.Name, h.Typeflag)
		}
		if err := os.Lchown(p, h.Uid, h.Gid); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range dirs {
		if err := os.Chmod(d.path, d.mode); err != nil {
			t.Fatal(err)
		}
	}
}

// runBundle runs args in the bundle's rootfs with runc, as the image's config says
// (user, working directory; the spec's defaults otherwise: namespaces, a read-only
// root, no capabilities but runc's three), mounts added; its exit code and output.
func runBundle(t *testing.T, runc, bundle string, c v1.Config, args, env []string, mounts []specs.Mount) (int, string, string) {
	t.Helper()
	cfg := filepath.Join(bundle, "config.json")
	os.Remove(cfg)
	if b, err := exec.Command(runc, "spec", "--bundle", bundle).CombinedOutput(); err != nil {
		t.Fatalf("runc spec: %v\n%s", err, b)
	}
	b, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	uid, gid, err := numericUser(c.User)
	if err != nil {
		t.Fatal(err)
	}
	spec.Process.Terminal = false
	spec.Process.Args, spec.Process.Env, spec.Process.Cwd = args, env, c.WorkingDir
	spec.Process.User = specs.User{UID: uid, GID: gid}
	spec.Root = &specs.Root{Path: "rootfs", Readonly: true}
	spec.Hostname = "passage-dra"
	spec.Mounts = append(spec.Mounts, mounts...)
	if b, err = json.MarshalIndent(&spec, "", "\t"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg, b, 0o644); err != nil {
		t.Fatal(err)
	}
	state := t.TempDir() // runc's state, not the host's /run/runc
	id := fmt.Sprintf("passage-images-%d-%d", os.Getpid(), time.Now().UnixNano())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, runc, "--root", state, "run", "--bundle", bundle, id)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	exec.Command(runc, "--root", state, "delete", "--force", id).Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, stdout.String(), stderr.String()
	case errors.As(err, &exit) && ctx.Err() == nil:
		return exit.ExitCode(), stdout.String(), stderr.String()
	}
	t.Fatalf("runc run %s: %v\n%s%s", strings.Join(args, " "), err, stdout.Bytes(), stderr.Bytes())
	return 0, "", ""
}

// numericUser is an image config's User as runc takes it: "UID[:GID]", numbers only
// (the image's /etc/passwd is not read).
func numericUser(u string) (uint32, uint32, error) {
	us, gs, _ := strings.Cut(u, ":")
	uid, err := strconv.ParseUint(us, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("image user %q is not numeric", u)
	}
	gid := uid
	if gs != "" {
		if gid, err = strconv.ParseUint(gs, 10, 32); err != nil {
			return 0, 0, fmt.Errorf("image user %q is not numeric", u)
		}
	}
	return uint32(uid), uint32(gid), nil
}
