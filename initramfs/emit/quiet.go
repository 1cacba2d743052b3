package emit

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// QuietKernel lowers the kernel's console log level to 1 (emergencies only) for as long
// as the blocks are written: a printk reaching the serial console in the middle of a
// base64 line (a "hrtimer: interrupt took ..." warning under TCG, say) corrupts the block,
// and the reader can only drop it. The returned function restores the previous level.
// root is "/" in the initramfs; the setting is the first field of
// /proc/sys/kernel/printk (console_loglevel), which a one-number write changes alone.
func QuietKernel(root string) (restore func() error, err error) {
	p := filepath.Join(root, "proc", "sys", "kernel", "printk")
	b, err := os.ReadFile(p)
	if err != nil {
		return func() error { return nil }, fmt.Errorf("emit: console log level: %w", err)
	}
	fields := strings.Fields(string(b))
	if len(fields) == 0 {
		return func() error { return nil }, fmt.Errorf("emit: console log level: %s is empty", p)
	}
	prev := fields[0]
	if err := os.WriteFile(p, []byte("1\n"), 0o644); err != nil {
		return func() error { return nil }, fmt.Errorf("emit: console log level: %w", err)
	}
	return func() error {
		if err := os.WriteFile(p, []byte(prev+"\n"), 0o644); err != nil {
			return fmt.Errorf("emit: restore console log level %s: %w", prev, err)
		}
		return nil
	}, nil
}
