package initramfs

import (
	"bufio"
	"fmt"
	"io"
	"slices"
	"strings"
)

// CgroupRoot is where u-root's init (libinit.CreateRootfs, which passage runs as PID 1)
// mounts a tmpfs and on it one cgroup v1 hierarchy per controller it can bind.
const CgroupRoot = "/sys/fs/cgroup"

// CgroupV1Mounts are the mounts to undo before the handoff so that the real root finds
// every cgroup controller free for cgroup v2, in the order to unmount them: each cgroup
// (v1) mount at or below CgroupRoot, deepest first, then the tmpfs at CgroupRoot when
// nothing else is mounted below it. A controller bound to a v1 hierarchy is absent from
// cgroup2's cgroup.controllers for as long as that hierarchy is mounted: a node's
// systemd, containerd and kubelet then find no cpu controller, and the kubelet cannot
// start a pod ("openat2 .../kubepods/besteffort/cpu.weight: no such file or directory").
// The kernel frees the controllers once the hierarchies, which hold no cgroup of
// passage's, are unmounted. mountinfo is /proc/self/mountinfo.
func CgroupV1Mounts(mountinfo io.Reader) ([]string, error) {
	type mnt struct{ dir, fs string }
	var under []mnt
	sc := bufio.NewScanner(mountinfo)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
		f := strings.Fields(sc.Text())
		sep := slices.Index(f, "-")
		if len(f) < 5 || sep < 5 || sep+1 >= len(f) {
			continue
		}
		dir := unescapeMountinfo(f[4])
		if dir == CgroupRoot || strings.HasPrefix(dir, CgroupRoot+"/") {
			under = append(under, mnt{dir, f[sep+1]})
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("mountinfo: %w", err)
	}
	var out []string
	others := false
	for _, m := range slices.Backward(under) {
		switch {
		case m.fs == "cgroup":
			out = append(out, m.dir)
		case m.dir == CgroupRoot && m.fs == "tmpfs":
			// Its turn comes last (below).
		default:
			others = true // a cgroup2 (or anything else) someone mounted: left alone
		}
	}
	if !others && slices.ContainsFunc(under, func(m mnt) bool { return m.dir == CgroupRoot && m.fs == "tmpfs" }) {
		out = append(out, CgroupRoot)
	}
	// Deepest first: a hierarchy mounted below another mount goes before it.
	slices.SortStableFunc(out, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	return out, nil
}

// unescapeMountinfo undoes the kernel's octal escapes (\040 for a space) in a path.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var c int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%o", &c); err == nil {
				b.WriteByte(byte(c))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
