// Command rootinit is the /sbin/init of the QEMU tests' stand-in real root: it proves that
// passage's switch_root handoff reached it as PID 1 on the new root, then powers off.
package main

import (
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	marker := "missing"
	if b, err := os.ReadFile("/etc/passage-root"); err == nil {
		marker = string(b)
	}
	fmt.Printf("PASSAGE-ROOT-INIT pid=%d root=%s\n", os.Getpid(), marker)
	unix.Sync()
	// Let the UART drain before the power goes.
	time.Sleep(500 * time.Millisecond)
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		fmt.Printf("PASSAGE-ROOT-INIT poweroff: %v\n", err)
	}
	select {}
}
