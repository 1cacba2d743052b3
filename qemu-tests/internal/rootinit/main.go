// Command rootinit is the /sbin/init of the QEMU tests' stand-in real root: it proves that
// passage's switch_root handoff reached it as PID 1 on the new root, says what the
// handoff gave it (/run and what /run/passage holds, the kernel's hostname), then powers
// off. Its lines:
//
//	PASSAGE-ROOT-INIT pid=1 root=disk
//	PASSAGE-ROOT-RUN fstype=tmpfs          the file system mounted on /run (none: not a mount)
//	PASSAGE-ROOT-HOSTNAME b300-r07-n3      /proc/sys/kernel/hostname
//	PASSAGE-ROOT-FILE NAME sha256=HEX      each regular file of /run/passage, by name
//	PASSAGE-ROOT-CGROUP cpu memory ...     the controllers cgroup2 offers the real root
//	PASSAGE-ROOT-END files=N               N files listed (-1: no /run/passage)
package main

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	marker := "missing"
	if b, err := os.ReadFile("/etc/passage-root"); err == nil {
		marker = string(b)
	}
	fmt.Printf("PASSAGE-ROOT-INIT pid=%d root=%s\n", os.Getpid(), marker)
	fmt.Printf("PASSAGE-ROOT-RUN fstype=%s\n", fstypeOf("/run"))
	host := "unreadable"
	if b, err := os.ReadFile("/proc/sys/kernel/hostname"); err == nil {
		host = strings.TrimSpace(string(b))
	}
	fmt.Printf("PASSAGE-ROOT-HOSTNAME %s\n", host)
	// What a real root's init (systemd, a node's) does first: cgroup2 at /sys/fs/cgroup.
	ctl := "unmountable"
	if err := unix.Mount("cgroup2", "/sys/fs/cgroup", "cgroup2", 0, ""); err != nil {
		ctl = "mount: " + err.Error()
	} else if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		ctl = strings.TrimSpace(string(b))
	}
	fmt.Printf("PASSAGE-ROOT-CGROUP %s\n", ctl)
	n := -1
	if ents, err := os.ReadDir("/run/passage"); err == nil {
		n = 0
		sort.Slice(ents, func(i, j int) bool { return ents[i].Name() < ents[j].Name() })
		for _, e := range ents {
			// The boot's own dot files (a write's temporary, the generation lock) are not
			// among the files it emits.
			if !e.Type().IsRegular() || strings.HasPrefix(e.Name(), ".") {
				continue
			}
			b, err := os.ReadFile(filepath.Join("/run/passage", e.Name()))
			if err != nil {
				fmt.Printf("PASSAGE-ROOT-FILE %s error=%v\n", e.Name(), err)
				continue
			}
			sum := sha256.Sum256(b)
			fmt.Printf("PASSAGE-ROOT-FILE %s sha256=%s\n", e.Name(), hex.EncodeToString(sum[:]))
			n++
		}
	}
	fmt.Printf("PASSAGE-ROOT-END files=%d\n", n)
	unix.Sync()
	// Let the UART drain before the power goes.
	time.Sleep(500 * time.Millisecond)
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		fmt.Printf("PASSAGE-ROOT-INIT poweroff: %v\n", err)
	}
	select {}
}

// fstypeOf is the file system mounted at dir, from /proc/self/mountinfo (the last mount
// there: the one that is seen), or "none".
func fstypeOf(dir string) string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "unreadable"
	}
	defer f.Close()
	fs := "none"
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 || fields[4] != dir {
			continue
		}
		for i, w := range fields {
			if w == "-" && i+1 < len(fields) {
				fs = fields[i+1]
			}
		}
	}
	return fs
}
