//go:build !cgo

package fabricmanager

import "errors"

// ErrNoCgo is every Client call's error in a binary built with CGO_ENABLED=0: libnvfm
// is loaded through cgo (go-nvfm).
var ErrNoCgo = errors.New("fm: fabric manager support needs cgo (this binary was built with CGO_ENABLED=0)")

// Client is FM's client; without cgo it cannot be opened.
type Client struct{}

// Open fails: without cgo there is no libnvfm.
func Open(Options) (*Client, error) { return nil, ErrNoCgo }

func (*Client) Partitions() ([]Partition, error) { return nil, ErrNoCgo }
func (*Client) Activate(uint32) error            { return ErrNoCgo }
func (*Client) Deactivate(uint32) error          { return ErrNoCgo }
func (*Client) SetActivated([]uint32) error      { return ErrNoCgo }
func (*Client) Close() error                     { return nil }
