// Package simnode is the simulated hardware of a synthetic node (package noderig) that a
// passage-dra process drives: vfiotest's kernel over the node's sysfs tree, and an
// erasetest NVMe controller per NVMe function whose blocks live in files under the
// node's root, so that the test that wrote a tenant's data and the plugin process that
// erases it (and the same plugin started again after a kill) see one device. Only a
// passage-dra built with -tags passagesim uses it; nothing in a production build does.
package simnode

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// Dir is where the simulated devices' state is, under the node's root.
const Dir = "passagesim"

// The one namespace of each controller: 64 Ki blocks of 512 bytes.
const (
	NSID      = 1
	BlockSize = 512
	blocks    = 1 << 16
)

// Files of a controller's directory: fault (present: the controller does not answer),
// latency (a Go duration each admin command takes: a real Format NVM is seconds).
const (
	faultFile   = "fault"
	latencyFile = "latency"
)

func nvmeDir(root string, a pci.Address) string {
	return filepath.Join(root, Dir, "nvme", a.String())
}

func blockDir(root string, a pci.Address) string {
	return filepath.Join(nvmeDir(root, a), "ns"+strconv.Itoa(NSID))
}

// Kernel is vfiotest's kernel over root's tree with the modules a recycle loads.
func Kernel(root string) (*vfiotest.Kernel, error) {
	k, err := vfiotest.New(root)
	if err != nil {
		return nil, err
	}
	if err := k.Load(vfiobind.Modules...); err != nil {
		return nil, err
	}
	return k, nil
}

// controller is an erasetest controller whose blocks are mirrored in files.
type controller struct {
	*erasetest.Controller
	dir string
}

// Admin runs the command; what it erased is erased on disk before it returns.
func (c *controller) Admin(ctx context.Context, cmd erase.Command, buf []byte) error {
	err := c.Controller.Admin(ctx, cmd, buf)
	// erasetest's Format NVM and Sanitize drop a namespace's blocks whole: a namespace
	// with no block in memory has none on disk either.
	if c.Dirty(NSID) == 0 {
		if rerr := os.RemoveAll(c.dir); rerr != nil && err == nil {
			err = fmt.Errorf("simulated nvme: %w", rerr)
		}
	}
	return err
}

// open loads the controller of a from its files.
func open(root string, a pci.Address) (*controller, error) {
	d := nvmeDir(root, a)
	if _, err := os.Stat(filepath.Join(d, faultFile)); err == nil {
		return nil, fmt.Errorf("nvme %s: controller does not answer", a)
	}
	// Format NVM only (no Sanitize): the erase is a format, as on most data-centre
	// drives' cheapest path.
	c := &controller{Controller: erasetest.New("S"+a.String(), 0, 0, true, erasetest.Namespace{NSID: NSID, Blocks: blocks}), dir: blockDir(root, a)}
	if b, err := os.ReadFile(filepath.Join(d, latencyFile)); err == nil {
		if c.Faults.Latency, err = time.ParseDuration(strings.TrimSpace(string(b))); err != nil {
			return nil, fmt.Errorf("simulated nvme %s: %s: %w", a, latencyFile, err)
		}
	}
	ents, err := os.ReadDir(c.dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	for _, e := range ents {
		lba, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("simulated nvme %s: block file %s: %w", a, e.Name(), err)
		}
		b, err := os.ReadFile(filepath.Join(c.dir, e.Name()))
		if err != nil {
			return nil, err
		}
		c.Write(NSID, lba, b)
	}
	return c, nil
}

// Opener opens the simulated controller of each NVMe function under root.
func Opener(root string) erase.Opener {
	return func(_ context.Context, a pci.Address) (erase.Controller, string, error) {
		c, err := open(root, a)
		if err != nil {
			return nil, "", err
		}
		return c, "nvme-sim-" + a.String(), nil
	}
}

// Write stores block lba of a's namespace as a tenant left it.
func Write(root string, a pci.Address, lba uint64, b []byte) error {
	if len(b) != BlockSize || lba >= blocks {
		return fmt.Errorf("simulated nvme %s: block %d of %d bytes: want < %d and %d", a, lba, len(b), blocks, BlockSize)
	}
	d := blockDir(root, a)
	if err := os.MkdirAll(d, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(d, strconv.FormatUint(lba, 10)), b, 0o644)
}

// Read reads block lba of a's namespace back through the controller's Read, as the
// erase's verification does.
func Read(ctx context.Context, root string, a pci.Address, lba uint64) ([]byte, error) {
	c, err := open(root, a)
	if err != nil {
		return nil, err
	}
	buf := make([]byte, BlockSize)
	return buf, c.Read(ctx, NSID, lba, BlockSize, buf)
}

// SetFault makes a's controller not answer (on) or answer again.
func SetFault(root string, a pci.Address, on bool) error {
	p := filepath.Join(nvmeDir(root, a), faultFile)
	if !on {
		return os.RemoveAll(p)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return os.WriteFile(p, nil, 0o644)
}

// SetLatency makes every admin command of a's controller take d from its next open (0:
// none).
func SetLatency(root string, a pci.Address, d time.Duration) error {
	p := filepath.Join(nvmeDir(root, a), latencyFile)
	if d == 0 {
		return os.RemoveAll(p)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return os.WriteFile(p, []byte(d.String()), 0o644)
}
