package initramfs

import (
	"slices"
	"strings"
	"testing"
)

// What u-root's libinit.CreateRootfs left on a QEMU guest of the 6.12 kernel (memory and
// cpuset refused: "Unknown subsys name"), with the rest of the boot's mounts.
const urootMountinfo = `22 1 0:20 / / rw - rootfs rootfs rw
23 22 0:21 / /proc rw,relatime - proc proc rw
24 22 0:22 / /sys rw,relatime - sysfs sysfs rw
25 22 0:5 / /dev rw,relatime - devtmpfs devtmpfs rw,size=1000k
26 22 0:23 / /run rw - tmpfs tmpfs rw
27 24 0:24 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw
28 27 0:25 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
29 27 0:26 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
30 27 0:27 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
31 27 0:28 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
32 27 0:29 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
33 24 0:30 / /sys/kernel/security rw,relatime - securityfs securityfs rw
`

func TestCgroupV1Mounts(t *testing.T) {
	for _, tc := range []struct {
		name, mountinfo string
		want            []string
	}{
		{"u-root's", urootMountinfo, []string{"/sys/fs/cgroup/devices", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/blkio",
			"/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"}},
		{"cgroup2 only", "27 24 0:24 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", nil},
		{"nothing there", "22 1 0:20 / / rw - rootfs rootfs rw\n", nil},
		// Someone's cgroup2 below the tmpfs: the v1 hierarchies go, the tmpfs stays.
		{"a cgroup2 below", urootMountinfo + "40 27 0:40 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
			[]string{"/sys/fs/cgroup/devices", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/blkio", "/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu"}},
		{"an escaped name", "27 24 0:24 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n28 27 0:25 / /sys/fs/cgroup/a\\040b rw - cgroup cgroup rw,cpu\n",
			[]string{"/sys/fs/cgroup/a b", "/sys/fs/cgroup"}},
		{"truncated lines", "27 24 0:24\n28 27 0:25 / /sys/fs/cgroup/cpu rw -\n", nil},
		{"not below", "28 24 0:25 / /sys/fs/cgroupx rw - cgroup cgroup rw,cpu\n", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := CgroupV1Mounts(strings.NewReader(tc.mountinfo))
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}
