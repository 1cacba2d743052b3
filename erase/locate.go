package erase

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/passage-boot/passage/pci"
)

// DeviceOpener opens controllers through the kernel under root ("/" on a node): it
// waits (up to wait) for the nvme driver to bring the controller live
// (/sys/class/nvme/nvmeN/state), then opens /dev/nvmeN; a namespace's block device is
// found when first read (/sys/block/*/nsid), the driver's namespace scan running behind
// its probe.
func DeviceOpener(root string, wait time.Duration) Opener {
	return func(ctx context.Context, a pci.Address) (Controller, string, error) {
		deadline := time.Now().Add(wait)
		var name string
		for {
			n, state, err := controllerOf(root, a)
			name = n
			if err == nil && state == "live" {
				break
			}
			if time.Now().After(deadline) {
				if err == nil {
					err = fmt.Errorf("controller %s is %q, not live", n, state)
				}
				return nil, name, fmt.Errorf("%s: nvme controller not ready after %v: %w", a, wait, err)
			}
			select {
			case <-ctx.Done():
				return nil, name, ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
		}
		f, err := os.OpenFile(filepath.Join(root, "dev", name), os.O_RDWR, 0)
		if err != nil {
			return nil, name, err
		}
		d := &Device{f: f, Namespaces: map[uint32]string{}}
		d.blockDev = func(ctx context.Context, nsid uint32) (string, error) {
			for {
				dev, err := blockOf(root, name, nsid)
				if err == nil || time.Now().After(deadline.Add(wait)) {
					return dev, err
				}
				select {
				case <-ctx.Done():
					return "", ctx.Err()
				case <-time.After(20 * time.Millisecond):
				}
			}
		}
		return d, name, nil
	}
}

// controllerOf names the function's controller (nvmeN under its sysfs directory) and
// its state.
func controllerOf(root string, a pci.Address) (name, state string, err error) {
	dir := filepath.Join(root, pci.DevicesDir, a.String(), "nvme")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", "", err
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "nvme") {
			name = e.Name()
			b, err := os.ReadFile(filepath.Join(dir, name, "state"))
			return name, strings.TrimSpace(string(b)), err
		}
	}
	return "", "", fmt.Errorf("%s: %w", dir, ErrNoController)
}

// blockOf finds the block device of namespace nsid of controller ctrl: a disk whose
// device is the controller, or (native multipath) the subsystem the controller is in,
// and whose nsid attribute is nsid.
func blockOf(root, ctrl string, nsid uint32) (string, error) {
	ents, err := os.ReadDir(filepath.Join(root, "sys/block"))
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		n := e.Name()
		if !strings.HasPrefix(n, "nvme") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(root, "sys/block", n, "nsid"))
		if err != nil {
			continue
		}
		if id, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32); err != nil || uint32(id) != nsid {
			continue
		}
		t, err := filepath.EvalSymlinks(filepath.Join(root, "sys/block", n, "device"))
		if err != nil {
			continue
		}
		if filepath.Base(t) == ctrl {
			return filepath.Join(root, "dev", n), nil
		}
		if strings.HasPrefix(filepath.Base(t), "nvme-subsys") {
			if _, err := os.Lstat(filepath.Join(t, ctrl)); err == nil {
				return filepath.Join(root, "dev", n), nil
			}
		}
	}
	return "", fmt.Errorf("namespace %d of %s: no block device", nsid, ctrl)
}
