package initramfs

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Kmsg mirrors the console into the kernel log, one record a line, so what the initramfs
// printed reaches the booted system's journal (journalctl -k, dmesg) as dracut's messages
// do. Each record reads "passage: ..." at a syslog level of the user facility: err for a
// line that says failed or emergency, warning for degraded, debug otherwise, so that at
// the kernel's default console log level (7) only errors and warnings are printed on the
// console a second time. Timeline
// markers and the file blocks of initramfs/emit are left out: they are the QEMU tests'
// channel, not messages, and would flood the log.
type Kmsg struct {
	w       io.Writer
	settle  func()
	partial []byte
	inBlock bool
}

// kmsgMax bounds a record: the kernel refuses writes over its line limit (1024 bytes with
// the level prefix).
const kmsgMax = 900

// OpenKmsg opens root/dev/kmsg for writing ("/" on the node; tests give a tree holding a
// plain file there). It never creates the file.
func OpenKmsg(root string) (*os.File, error) {
	return os.OpenFile(filepath.Join(root, "dev", "kmsg"), os.O_WRONLY, 0)
}

// NewKmsg mirrors lines written to it into w, the opened /dev/kmsg. settle, when not nil,
// runs before a record the kernel will echo on the console (err, warning): it waits for
// the console's own output to drain, since the kernel prints synchronously while the
// terminal drains passage's lines behind it, and the echo would land inside them.
func NewKmsg(w io.Writer, settle func()) *Kmsg { return &Kmsg{w: w, settle: settle} }

// Write takes console output and writes every complete line to the kernel log. It never
// fails: a kernel log that refuses a record must not cost the console its output (a
// MultiWriter stops at the first error).
func (k *Kmsg) Write(p []byte) (int, error) {
	k.partial = append(k.partial, p...)
	for {
		i := bytes.IndexByte(k.partial, '\n')
		if i < 0 {
			break
		}
		k.line(k.partial[:i])
		k.partial = k.partial[i+1:]
	}
	if len(k.partial) > kmsgMax {
		k.line(k.partial)
		k.partial = k.partial[:0]
	}
	return len(p), nil
}

func (k *Kmsg) line(l []byte) {
	switch {
	case bytes.HasPrefix(l, []byte("===PASSAGE-FILE-BEGIN ")):
		k.inBlock = true
		return
	case bytes.HasPrefix(l, []byte("===PASSAGE-FILE-END ")):
		k.inBlock = false
		return
	case k.inBlock, bytes.HasPrefix(l, []byte("===PASSAGE-")), bytes.HasPrefix(l, []byte("PASSAGE-T ")),
		len(bytes.TrimSpace(l)) == 0:
		return
	}
	msg := bytes.TrimPrefix(l, []byte("passage: "))
	if len(msg) > kmsgMax {
		msg = msg[:kmsgMax]
	}
	const user = 1 << 3 // LOG_USER: the kernel refuses LOG_KERN from user space
	level := 7          // LOG_DEBUG: kept off the console passage already wrote it to
	switch {
	case bytes.Contains(msg, []byte("failed")), bytes.Contains(msg, []byte("emergency")):
		level = 3 // LOG_ERR
	case bytes.Contains(msg, []byte("degraded")):
		level = 4 // LOG_WARNING
	}
	if level < 7 && k.settle != nil {
		k.settle()
	}
	fmt.Fprintf(k.w, "<%d>passage: %s\n", user|level, msg)
}

// KmsgUnlimited lifts the kernel's rate limit on /dev/kmsg writers for the boot
// (/proc/sys/kernel/printk_devkmsg under root: ratelimit -> on): by default a writer gets
// a burst of 10 records every 5 s and the rest are dropped, while a boot prints a hundred
// lines in seconds. restore puts "ratelimit" back before the handoff, so the booted
// system keeps the kernel's default. "off" (printk.devkmsg=off: no writes from user space
// at all) is the operator's choice and is left alone, as is "on".
func KmsgUnlimited(root string) (restore func() error, err error) {
	p := filepath.Join(root, "proc", "sys", "kernel", "printk_devkmsg")
	nothing := func() error { return nil }
	b, err := os.ReadFile(p)
	if err != nil {
		return nothing, fmt.Errorf("kmsg: %w", err)
	}
	if string(bytes.TrimSpace(b)) != "ratelimit" {
		return nothing, nil
	}
	if err := os.WriteFile(p, []byte("on\n"), 0o644); err != nil {
		return nothing, fmt.Errorf("kmsg: %w", err)
	}
	return func() error {
		if err := os.WriteFile(p, []byte("ratelimit\n"), 0o644); err != nil {
			return fmt.Errorf("kmsg: restore printk_devkmsg: %w", err)
		}
		return nil
	}, nil
}
