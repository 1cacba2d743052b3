// Command nodeinit is /sbin/init of the real node the QEMU e2e boots (kube/harness
// TestRealNode): passage hands off to it by switch_root, and it makes the machine a
// Kubernetes node the way a node's OS does at boot — file systems, cgroup v2, the kernel
// modules containerd and the CNI plugins need, pod traffic masqueraded out of the
// management NIC — then starts containerd, imports the images the test built (no
// registry), and starts the kubelet. It stays PID 1, reaping orphans, until the test
// ends the guest. It is the only stand-in on the node: what it starts are the real
// programs (containerd, runc, the CNI plugins, kubelet) at the versions a node runs.
//
// Its console lines, which the test follows:
//
//	NODE-INIT <step> ok|<error>        each step of the bring-up
//	NODE-IMAGE <ref>                   an image imported into containerd's k8s.io namespace
//	NODE-READY                         containerd and the kubelet are started
//	NODE-EXIT <program> <status>       containerd or the kubelet ended (the node is lost)
//	containerd: ... / kubelet: ...     their logs (warnings and errors; kubelet -v=0)
package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/initramfs/kmod"
)

// The node's layout, as the test writes its root (kube/harness/realnode_test.go, writeNodeRoot).
const (
	containerdConfig = "/etc/containerd/config.toml"
	containerdSock   = "/run/containerd/containerd.sock"
	kubeletConfig    = "/var/lib/kubelet/config.yaml"
	imagesDir        = "/images"
	// argsFile holds the kubelet's other flags, one a line: its kubeconfigs (the
	// bootstrap's and where its own goes), --cert-dir, node labels, node IP.
	argsFile = "/etc/kubernetes/kubelet.args"
	// podCIDR is the CNI plugin's range (/etc/cni/net.d): masqueraded out of the node.
	podCIDR = "10.88.0.0/16"
)

// modules are what the node's programs need that the image's kernel has as modules:
// overlayfs (containerd's snapshotter), veth (the ptp CNI plugin), nftables NAT (the
// masquerade below).
var modules = []string{"overlay", "veth", "nf_tables", "nft_chain_nat", "nft_masq"}

var console sync.Mutex

func say(format string, a ...any) {
	console.Lock()
	defer console.Unlock()
	fmt.Printf(format+"\n", a...)
}

func step(name string, err error) bool {
	if err != nil {
		say("NODE-INIT %s %v", name, err)
		return false
	}
	say("NODE-INIT %s ok", name)
	return true
}

func main() {
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "nodeinit: not PID 1")
		os.Exit(2)
	}
	os.Setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	ok := step("mounts", mounts()) &&
		step("cgroups", cgroups()) &&
		step("modules", loadModules()) &&
		step("sysctl", sysctls()) &&
		step("masquerade", masquerade()) &&
		step("lo", setLoUp())
	var procs map[int]string
	if ok {
		procs, ok = run()
	}
	if !ok {
		say("NODE-INIT failed")
	}
	reap(procs)
}

func mounts() error {
	for _, m := range []struct {
		src, dir, fs, opts string
		flags              uintptr
	}{
		{"proc", "/proc", "proc", "", 0},
		{"sysfs", "/sys", "sysfs", "", 0},
		{"devtmpfs", "/dev", "devtmpfs", "mode=0755", 0},
		{"tmpfs", "/run", "tmpfs", "mode=0755", 0},
		{"cgroup2", "/sys/fs/cgroup", "cgroup2", "", 0},
		{"devpts", "/dev/pts", "devpts", "newinstance,ptmxmode=0666,mode=0620", 0},
		{"tmpfs", "/dev/shm", "tmpfs", "mode=1777", 0},
		{"mqueue", "/dev/mqueue", "mqueue", "", 0},
		{"tmpfs", "/tmp", "tmpfs", "mode=1777", 0},
	} {
		if mounted(m.dir) == m.fs {
			continue
		}
		if err := os.MkdirAll(m.dir, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.dir, m.fs, m.flags, m.opts); err != nil {
			return fmt.Errorf("mount %s on %s: %w", m.fs, m.dir, err)
		}
	}
	// The root is an ext4 mounted read-write by passage's switch_root; the kubelet
	// needs its mounts to propagate (mountPropagation, the CSI and DRA plugin
	// directories), as systemd makes every mount shared.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make / rshared: %w", err)
	}
	if _, err := os.Lstat("/var/run"); os.IsNotExist(err) {
		if err := os.Symlink("/run", "/var/run"); err != nil {
			return err
		}
	}
	return nil
}

// mounted is the file system type of the last mount on dir ("": none), from
// /proc/self/mountinfo ("ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE ...").
func mounted(dir string) string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	fs := ""
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 5 || f[4] != dir {
			continue
		}
		for i, x := range f {
			if x == "-" && i+1 < len(f) {
				fs = f[i+1]
			}
		}
	}
	return fs
}

// cgroups delegates every controller the root has to its children (systemd does the
// same): the kubelet's kubepods hierarchy needs cpu, memory, pids and the rest.
func cgroups() error {
	b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers")
	if err != nil {
		return err
	}
	var want []string
	for _, c := range strings.Fields(string(b)) {
		want = append(want, "+"+c)
	}
	return os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte(strings.Join(want, " ")), 0o644)
}

func loadModules() error {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return err
	}
	rel := unix.ByteSliceToString(u.Release[:])
	ix, err := kmod.Open(filepath.Join("/lib/modules", rel))
	if err != nil {
		return err
	}
	res, err := ix.Load(modules...)
	for _, r := range res {
		if r.Err != nil && !r.AlreadyLoaded {
			return fmt.Errorf("%s: %w", r.Name, r.Err)
		}
	}
	return err
}

func sysctls() error {
	for k, v := range map[string]string{
		"net/ipv4/ip_forward": "1",
		// The kubelet's own (it sets them itself unless told to protect the kernel's).
		"vm/overcommit_memory": "1",
		"kernel/panic_on_oops": "1",
	} {
		if err := os.WriteFile("/proc/sys/"+k, []byte(v), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// masquerade makes pod traffic leaving the node look like the node's: QEMU's user
// network answers only its guest's address. A node's CNI plugin does this with
// iptables (ptp's ipMasq); the node has no iptables, so the OS sets one nftables rule:
// table ip passage-node, postrouting nat, saddr podCIDR daddr != podCIDR masquerade.
func masquerade() error {
	_, cidr, err := net.ParseCIDR(podCIDR)
	if err != nil {
		return err
	}
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "passage-node"})
	ch := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	mask := []byte(cidr.Mask)
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
		// ip saddr & mask == net
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: cidr.IP.To4()},
		// ip daddr & mask != net
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: cidr.IP.To4()},
		&expr.Masq{},
	}})
	return c.Flush()
}

// run starts containerd, imports the images, starts the kubelet: the programs that
// keep running, by PID.
func run() (map[int]string, bool) {
	procs := map[int]string{}
	ctrd, err := start("containerd", "/usr/bin/containerd", "--config", containerdConfig, "--log-level", "warn")
	if !step("containerd", err) {
		return procs, false
	}
	procs[ctrd] = "containerd"
	if !step("containerd-socket", waitSocket(containerdSock, 120*time.Second, ctrd)) {
		return procs, false
	}
	tars, _ := filepath.Glob(filepath.Join(imagesDir, "*.tar"))
	sort.Strings(tars)
	ctr := func(args ...string) ([]byte, error) {
		out, err := exec.Command("/usr/bin/ctr", append([]string{"--address", containerdSock, "-n", "k8s.io"}, args...)...).CombinedOutput()
		if err != nil {
			return out, fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
		}
		return out, nil
	}
	for _, tar := range tars {
		if _, err := ctr("images", "import", "--no-unpack", tar); err != nil {
			say("NODE-INIT import %s: %v", filepath.Base(tar), err)
			return procs, false
		}
	}
	// A pull by digest names the image <repository>@<digest>, which is how the deploy
	// files refer to it (kustomize's images: digest); an import names it as the archive
	// does (<repository>:<tag>), so the pull's name is added.
	out, err := ctr("images", "list")
	if !step("images", err) {
		return procs, false
	}
	for _, l := range strings.Split(string(out), "\n")[1:] {
		f := strings.Fields(l)
		// The CRI's own entries are named by the image's ID (sha256:...).
		// Names by digest are a pull's already (an earlier boot of the same root tagged
		// them).
		if len(f) < 3 || !strings.HasPrefix(f[2], "sha256:") || strings.HasPrefix(f[0], "sha256:") || strings.Contains(f[0], "@") {
			continue
		}
		repo := f[0]
		if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
			repo = repo[:i]
		}
		byDigest := repo + "@" + f[2]
		if _, err := ctr("images", "tag", "--force", f[0], byDigest); err != nil {
			say("NODE-INIT tag %s: %v", f[0], err)
			return procs, false
		}
		say("NODE-IMAGE %s %s", f[0], byDigest)
	}
	args := []string{"--config=" + kubeletConfig}
	if b, err := os.ReadFile(argsFile); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if l = strings.TrimSpace(l); l != "" {
				args = append(args, l)
			}
		}
	}
	kubelet, err := start("kubelet", "/usr/bin/kubelet", args...)
	if !step("kubelet", err) {
		return procs, false
	}
	procs[kubelet] = "kubelet"
	go tailPodLogs()
	say("NODE-READY")
	return procs, true
}

func setLoUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// start runs a program with its output on the console, each line prefixed with its
// name, and returns its PID. It is never waited for with exec.Cmd.Wait: PID 1's reaper
// (reap) collects it with every orphan.
func start(name, path string, args ...string) (int, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return 0, err
	}
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = w, w
	err = cmd.Start()
	w.Close()
	if err != nil {
		r.Close()
		return 0, err
	}
	go func() {
		defer r.Close()
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			say("%s: %s", name, sc.Text())
		}
	}()
	return cmd.Process.Pid, nil
}

func waitSocket(path string, d time.Duration, pid int) error {
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		var ws unix.WaitStatus
		if p, _ := unix.Wait4(pid, &ws, unix.WNOHANG, nil); p == pid {
			return fmt.Errorf("exited (status %d) before %s was served", ws.ExitStatus(), path)
		}
		if c, err := net.Dial("unix", path); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("no %s within %v", path, d)
}

// reap is PID 1's other duty: orphans (containerd's shims re-parent to it) are waited
// for, forever; containerd's or the kubelet's end is said.
func reap(procs map[int]string) {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, 0, nil)
		if err == unix.ECHILD {
			time.Sleep(time.Second)
			continue
		}
		if name, ok := procs[pid]; ok {
			say("NODE-EXIT %s status=%d signal=%v", name, ws.ExitStatus(), ws.Signal())
		}
	}
}

// tailPodLogs puts what the pods' containers write (the kubelet's /var/log/pods, which
// containerd fills) on the console, each line prefixed "pod <namespace>_<pod>/<container>:":
// the test reads passage-dra's own words there.
func tailPodLogs() {
	offsets := map[string]int64{}
	for {
		files, _ := filepath.Glob("/var/log/pods/*/*/*.log")
		sort.Strings(files)
		for _, f := range files {
			fh, err := os.Open(f)
			if err != nil {
				continue
			}
			if _, err := fh.Seek(offsets[f], 0); err == nil {
				sc := bufio.NewScanner(fh)
				sc.Buffer(make([]byte, 64<<10), 1<<20)
				rel := strings.Split(strings.TrimPrefix(f, "/var/log/pods/"), "/")
				pod := rel[0]
				if i := strings.LastIndex(pod, "_"); i > 0 {
					pod = pod[:i] // the pod's UID
				}
				for sc.Scan() {
					offsets[f] += int64(len(sc.Bytes())) + 1
					// CRI log lines: TIME STREAM TAG MESSAGE
					l := sc.Text()
					if p := strings.SplitN(l, " ", 4); len(p) == 4 {
						l = p[3]
					}
					say("pod %s/%s: %s", pod, rel[1], l)
				}
			}
			fh.Close()
		}
		time.Sleep(2 * time.Second)
	}
}
