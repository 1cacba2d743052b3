//go:build cgo

package fabricmanager

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvfm/pkg/nvfm"
)

// Client is one connection to FM through libnvfm. Its calls are one at a time, and
// each ends in one of three outcomes: FM did it (nil); FM answered no (*Error, its
// code); FM did not answer (*UnreachableError). A call answered with a code a dead or
// stale connection gives (noAnswer) is not taken for FM's word: the connection is
// dropped, made again within Options.Reconnect, and the call made once more on it.
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
	err = c.connect("connect")
	c.mu.Unlock()
	if err != nil {
		lib.release()
		return nil, err
	}
	return c, nil
}

// noAnswer are the codes a call's connection, rather than FM, may have given: libnvfm
// answers a connection FM restarted under with CONNECTION_NOT_VALID or UNINITIALIZED
// (the code the guide also gives a deactivation of a partition that is not active),
// and what it answers a socket whose peer is gone is not documented (a TIMEOUT, a
// GENERIC_ERROR). None is taken as FM's answer until a new connection gives it again.
func noAnswer(r Return) bool {
	switch r {
	case FM_ST_CONNECTION_NOT_VALID, FM_ST_UNINITIALIZED, FM_ST_TIMEOUT, FM_ST_GENERIC_ERROR:
		return true
	}
	return false
}

// drop lets go of the connection, presumed broken; c.mu held.
func (c *Client) drop() {
	if c.h != nil {
		c.h.Disconnect() // nothing to act on: the next call connects again
		c.h = nil
	}
}

// connect makes a new connection, trying again until Options.Reconnect has passed
// while FM does not answer; c.mu held. FM out of reach is an *UnreachableError; a
// connection FM refuses (a library of another version, a bad parameter) its *Error.
func (c *Client) connect(op string) error {
	c.drop()
	opts := []nvfm.ConnectOption{nvfm.WithTimeoutMs(uint32(c.o.Timeout.Milliseconds()))}
	if c.o.Socket != "" {
		opts = append(opts, nvfm.WithUnixSocket(c.o.Socket))
	} else {
		opts = append(opts, nvfm.WithAddress(c.o.Address))
	}
	start := time.Now()
	deadline := start.Add(c.o.Reconnect)
	for n := 1; ; n++ {
		h, r := c.lib.lib.Connect(opts...)
		switch {
		case r == nvfm.SUCCESS:
			c.h = h
			return nil
		case !noAnswer(Return(r)):
			return &Error{Op: "connect " + c.o.where(), Code: Return(r)}
		}
		left := time.Until(deadline)
		if left <= 0 {
			return &UnreachableError{Op: op, Where: c.o.where(), Connect: Return(r), Attempts: n, For: time.Since(start), Within: c.o.Reconnect}
		}
		time.Sleep(min(left, reconnectPause))
	}
}

// reconnectPause is the wait between two connects to an FM that did not answer.
const reconnectPause = 100 * time.Millisecond

// do runs call on the connection. An answer in noAnswer drops it, and the call is made
// once more on a new one: FM's answer there is the call's, but for CONNECTION_NOT_VALID
// and TIMEOUT on a connection just made, which are FM not answering.
func (c *Client) do(op string, call func(nvfm.Handle) nvfm.Return) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var first Return
	if c.h != nil {
		r := Return(call(c.h))
		switch {
		case r == FM_ST_SUCCESS:
			return nil
		case !noAnswer(r):
			return &Error{Op: op, Code: r}
		}
		first = r
	}
	if err := c.connect(op); err != nil {
		if u, ok := err.(*UnreachableError); ok {
			u.Answered = first
		}
		return err
	}
	r := Return(call(c.h))
	if r == FM_ST_SUCCESS {
		return nil
	}
	if noAnswer(r) {
		c.drop()
	}
	if r == FM_ST_CONNECTION_NOT_VALID || r == FM_ST_TIMEOUT {
		return &UnreachableError{Op: op, Where: c.o.where(), Answered: r, Attempts: 1}
	}
	return &Error{Op: op, Code: r}
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
