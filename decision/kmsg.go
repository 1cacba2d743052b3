package decision

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/passage-boot/passage/pci"
	"golang.org/x/sys/unix"
)

// KernelLogFile is where the kernel log is read, beneath the root.
const KernelLogFile = "dev/kmsg"

// Bounds on reading the kernel log: its ring buffer is a few hundred KiB on a
// distribution kernel (CONFIG_LOG_BUF_SHIFT), a record at most 8 KiB (PRINTK_MESSAGE_MAX
// plus the prefix).
const (
	maxKernelLog    = 16 << 20
	maxKernelRecord = 8 << 10
)

// ReadKernelLog returns the lines of the kernel log (beneath root) that speak of ACS, so
// the decision can say what the kernel did with pci=config_acs=. A character device
// (/dev/kmsg) is read record by record from the oldest the ring still holds until it
// has no more, never waiting; a regular file (a tree's stand-in, a saved dmesg) line by
// line. nil without a log; a log that cannot be read is an error naming it.
func ReadKernelLog(root string) ([]string, error) {
	f, char, err := pci.OpenStream(root, KernelLogFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := []string{}
	keep := func(record string) {
		if line := kmsgMessage(record); strings.Contains(line, "ACS") {
			out = append(out, line)
		}
	}
	if !char {
		sc := bufio.NewScanner(io.LimitReader(f, maxKernelLog))
		sc.Buffer(make([]byte, maxKernelRecord), maxKernelRecord)
		for sc.Scan() {
			keep(sc.Text())
		}
		if err := sc.Err(); err != nil {
			return nil, fmt.Errorf("%s: %w", f.Name(), err)
		}
		return out, nil
	}
	// Raw reads: the runtime's poller would wait on EAGAIN for the next message, and
	// Fd() would make the descriptor blocking.
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	buf := make([]byte, maxKernelRecord)
	for total, records := 0, 0; total < maxKernelLog && records < 1<<20; records++ {
		var n int
		var err error
		if cerr := rc.Read(func(fd uintptr) bool {
			n, err = unix.Read(int(fd), buf)
			return true
		}); cerr != nil {
			return nil, fmt.Errorf("%s: %w", f.Name(), cerr)
		}
		switch {
		case err == unix.EAGAIN || err == nil && n == 0:
			return out, nil
		case err == unix.EPIPE || err == unix.EINTR:
			// The ring overwrote the record about to be read: go on with the next.
			continue
		case err != nil:
			return nil, fmt.Errorf("%s: %w", f.Name(), err)
		}
		total += n
		keep(string(buf[:n]))
	}
	return out, nil
}

// kmsgMessage is a /dev/kmsg record's message line: the record goes on with the device
// it concerns as indented "KEY=value" lines (Documentation/ABI/testing/dev-kmsg).
func kmsgMessage(record string) string {
	line, _, _ := strings.Cut(record, "\n")
	return line
}
