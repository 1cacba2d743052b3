package emit

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/passage-boot/passage/initramfs"
)

// OpenConsoles opens the TTYs of the kernel's console= arguments (as u-root's init does)
// for the boot (or a test double) to write its report to directly. The uinit's own stdout is a pipe that
// init copies to those TTYs from a goroutine (libinit.WithMultiTTY): output still in that
// copy when passage powers off is lost, and a pipe cannot be drained; a TTY can. None
// opened (no console=, a synthetic root): the caller keeps stdout.
func OpenConsoles(root string) []*os.File {
	b, err := os.ReadFile(filepath.Join(root, "proc/cmdline"))
	if err != nil {
		return nil
	}
	var out []*os.File
	seen := map[string]bool{}
	for _, a := range initramfs.SplitCmdline(strings.TrimSpace(string(b))) {
		if a.Key != "console" {
			continue
		}
		name, _, _ := strings.Cut(a.Value, ",")
		if name == "" || seen[name] || strings.ContainsAny(name, "/.") {
			continue
		}
		seen[name] = true
		f, err := os.OpenFile(filepath.Join(root, "dev", name), os.O_WRONLY|unix.O_NOCTTY, 0)
		if err != nil {
			continue
		}
		out = append(out, f)
	}
	return out
}

// Drain waits until the console has sent everything written to it. The UART sends
// from a kernel buffer; a power-off before that buffer is empty loses it (seen under
// QEMU: the last file block, PASSAGE-DONE and the handoff marker cut off by "reboot:
// Power down"). tcdrain(3) is TCSBRK with a non-zero argument; it can fail (EINTR from
// the Go runtime's preemption signals, EIO for a background process of the console's
// session), so the output queue (TIOCOUTQ) is also polled until empty, within a bound.
// Not a terminal: nothing to wait for.
func Drain(w io.Writer) error {
	f, ok := w.(*os.File)
	if !ok {
		return nil
	}
	fd := int(f.Fd())
	var err error
	for i := 0; i < 100; i++ {
		if err = unix.IoctlSetInt(fd, unix.TCSBRK, 1); err != unix.EINTR {
			break
		}
	}
	if err != nil {
		err = fmt.Errorf("console: tcdrain: %w", err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		n, qerr := unix.IoctlGetInt(fd, unix.TIOCOUTQ)
		if qerr != nil {
			if errors.Is(qerr, unix.ENOTTY) {
				return nil
			}
			return errors.Join(err, fmt.Errorf("console: TIOCOUTQ: %w", qerr))
		}
		if n == 0 {
			return err
		}
		if time.Now().After(deadline) {
			return errors.Join(err, fmt.Errorf("console: %d bytes still queued after 3 s", n))
		}
		time.Sleep(5 * time.Millisecond)
	}
}
