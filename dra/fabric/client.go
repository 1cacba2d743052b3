//go:build cgo

package fabric

import (
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvfm/pkg/nvfm"
)

// Client is one connection to FM through libnvfm. Its calls are one at a time; a call
// FM answers FM_ST_CONNECTION_NOT_VALID or FM_ST_UNINITIALIZED (FM restarted under the
// connection) is made once more on a new connection, as the Kubernetes DRA driver for
// NVIDIA GPUs does.
type Client struct {
	o   Options
	lib *library
	mu  sync.Mutex
	h   nvfm.Handle
}

// library is one loaded libnvfm. fmLibInit is once per process (a second is answered
// FM_ST_IN_USE, nv_fm_agent.h), so every Client of a process shares the one of its
// path, and the last Close shuts it down: the only package-level state, because the
// library's own is per process.
type library struct {
	path  string
	lib   nvfm.Interface
	users int
}

var libraries = struct {
	sync.Mutex
	m map[string]*library
}{m: map[string]*library{}}

func loadLibrary(path string) (*library, error) {
	libraries.Lock()
	defer libraries.Unlock()
	if l := libraries.m[path]; l != nil {
		l.users++
		return l, nil
	}
	// go-nvfm reports a failed dlopen as FM_ST_GENERIC_ERROR alone: a path that is not
	// there is named here instead.
	if strings.Contains(path, "/") {
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("fm: load %s: %w", path, err)
		}
	}
	lib := nvfm.New(nvfm.WithLibraryPath(path))
	if r := lib.Init(); r != nvfm.SUCCESS {
		return nil, &Error{Op: "load " + path + " (dlopen, fmLibInit)", Code: Return(r)}
	}
	l := &library{path: path, lib: lib, users: 1}
	libraries.m[path] = l
	return l, nil
}

func (l *library) release() error {
	libraries.Lock()
	defer libraries.Unlock()
	if l.users--; l.users > 0 {
		return nil
	}
	delete(libraries.m, l.path)
	if r := l.lib.Shutdown(); r != nvfm.SUCCESS {
		return &Error{Op: "shut down " + l.path, Code: Return(r)}
	}
	return nil
}

// Open loads the library and connects to FM.
func Open(o Options) (*Client, error) {
	o = o.withDefaults()
	lib, err := loadLibrary(o.Library)
	if err != nil {
		return nil, err
	}
	c := &Client{o: o, lib: lib}
	c.mu.Lock()
	err = c.connect()
	c.mu.Unlock()
	if err != nil {
		lib.release()
		return nil, err
	}
	return c, nil
}

// connect makes a new connection; c.mu held.
func (c *Client) connect() error {
	if c.h != nil {
		c.h.Disconnect() // the connection is presumed broken: nothing to act on
		c.h = nil
	}
	opts := []nvfm.ConnectOption{nvfm.WithTimeoutMs(uint32(c.o.Timeout.Milliseconds()))}
	if c.o.Socket != "" {
		opts = append(opts, nvfm.WithUnixSocket(c.o.Socket))
	} else {
		opts = append(opts, nvfm.WithAddress(c.o.Address))
	}
	h, r := c.lib.lib.Connect(opts...)
	if r != nvfm.SUCCESS {
		return &Error{Op: "connect " + c.o.where(), Code: Return(r)}
	}
	c.h = h
	return nil
}

// do runs call on the connection, once more on a new one after
// FM_ST_CONNECTION_NOT_VALID or FM_ST_UNINITIALIZED.
func (c *Client) do(op string, call func(nvfm.Handle) nvfm.Return) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h == nil {
		if err := c.connect(); err != nil {
			return err
		}
	}
	r := call(c.h)
	if r == nvfm.CONNECTION_NOT_VALID || r == nvfm.UNINITIALIZED {
		if err := c.connect(); err != nil {
			return &Error{Op: op, Code: Return(r), Err: fmt.Errorf("reconnect: %w", err)}
		}
		r = call(c.h)
	}
	if r != nvfm.SUCCESS {
		return &Error{Op: op, Code: Return(r)}
	}
	return nil
}

// Partitions is FM's list of supported partitions (fmGetSupportedFabricPartitions).
func (c *Client) Partitions() ([]Partition, error) {
	var list nvfm.FabricPartitionList
	err := c.do("list partitions", func(h nvfm.Handle) nvfm.Return {
		var r nvfm.Return
		list, r = h.GetSupportedFabricPartitions()
		return r
	})
	if err != nil {
		return nil, err
	}
	// The counts are FM's: bounded by the arrays they index.
	n := min(int(list.NumPartitions), len(list.PartitionInfo))
	out := make([]Partition, n)
	for i := range n {
		p := list.PartitionInfo[i]
		out[i] = Partition{ID: p.PartitionId, Active: p.IsActive != 0}
		for _, g := range p.GpuInfo[:min(int(p.NumGpus), len(p.GpuInfo))] {
			out[i].GPUs = append(out[i].GPUs, GPU{
				PhysicalID: g.PhysicalId, UUID: cString(g.Uuid[:]), PCIBusID: cString(g.PciBusId[:]),
				NumNvLinksAvailable: g.NumNvLinksAvailable, MaxNumNvLinks: g.MaxNumNvLinks, NvlinkLineRateMBps: g.NvlinkLineRateMBps,
			})
		}
	}
	return out, nil
}

// Activate is fmActivateFabricPartition.
func (c *Client) Activate(id uint32) error {
	return c.do(fmt.Sprintf("activate partition %d", id), func(h nvfm.Handle) nvfm.Return {
		return h.ActivateFabricPartition(nvfm.FabricPartitionId(id))
	})
}

// Deactivate is fmDeactivateFabricPartition.
func (c *Client) Deactivate(id uint32) error {
	return c.do(fmt.Sprintf("deactivate partition %d", id), func(h nvfm.Handle) nvfm.Return {
		return h.DeactivateFabricPartition(nvfm.FabricPartitionId(id))
	})
}

// SetActivated is fmSetActivatedFabricPartitions: after an FM --restart, the
// partitions that are active (required even when none is).
func (c *Client) SetActivated(ids []uint32) error {
	fids := make([]nvfm.FabricPartitionId, len(ids))
	for i, id := range ids {
		fids[i] = nvfm.FabricPartitionId(id)
	}
	return c.do(fmt.Sprintf("set activated partitions [%s]", idList(ids)), func(h nvfm.Handle) nvfm.Return {
		return h.SetActivatedFabricPartitions(fids)
	})
}

// Close disconnects and lets go of the library.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lib == nil {
		return nil
	}
	var err error
	if c.h != nil {
		if r := c.h.Disconnect(); r != nvfm.SUCCESS {
			err = &Error{Op: "disconnect " + c.o.where(), Code: Return(r)}
		}
		c.h = nil
	}
	if rerr := c.lib.release(); err == nil {
		err = rerr
	}
	c.lib = nil
	return err
}

func cString(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}
