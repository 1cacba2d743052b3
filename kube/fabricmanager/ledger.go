package fabricmanager

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"path/filepath"
	"slices"

	"github.com/passage-boot/passage/manifest"
)

// LedgerFile is the ledger in the state directory.
const LedgerFile = "fabric.json"

const (
	ledgerVersion = 1
	// maxLedger bounds the file read back: 64 partitions at most are active at once.
	maxLedger = 1 << 20
)

// The states of a claim's partition in the ledger. Each is written before FM is asked
// to make it so: a process that dies in between finds on restart what it was doing.
const (
	// StateActivating: the partition was about to be activated, or FM's answer did not
	// say whether it was.
	StateActivating = "activating"
	// StateActive: FM activated the partition for the claim.
	StateActive = "active"
	// StateDeactivating: the claim was released; the partition was about to be
	// deactivated, or FM would not (LastError). It stays the claim's until FM says it is
	// not active.
	StateDeactivating = "deactivating"
)

// Entry is one claim's partition.
type Entry struct {
	Partition uint32 `json:"partition"`
	Modules   []int  `json:"modules"` // sorted Module IDs, as FM listed the partition
	State     string `json:"state"`
	LastError string `json:"last_error,omitempty"`
}

// ledger is the file's content: claims by UID.
type ledger struct {
	Version int               `json:"version"`
	Claims  map[string]*Entry `json:"claims"`
}

func (l *ledger) clone() *ledger {
	c := &ledger{Version: ledgerVersion, Claims: map[string]*Entry{}}
	for k, e := range l.Claims {
		ce := *e
		ce.Modules = slices.Clone(e.Modules)
		c.Claims[k] = &ce
	}
	return c
}

// claims are the claim UIDs, sorted.
func (l *ledger) claims() []string { return slices.Sorted(maps.Keys(l.Claims)) }

// readLedger reads dir's ledger strictly (its version, no unknown field, each entry in
// a known state); none there is an empty ledger. Anything else is refused: guessing
// would let a partition's GPUs be reset under it, or be given twice.
func readLedger(dir string) (*ledger, error) {
	p := filepath.Join(dir, LedgerFile)
	b, err := manifest.ReadRegular(p, maxLedger)
	if errors.Is(err, fs.ErrNotExist) {
		return &ledger{Version: ledgerVersion, Claims: map[string]*Entry{}}, nil
	}
	if err == nil {
		var l *ledger
		if l, err = decodeLedger(b); err == nil {
			return l, nil
		}
	}
	return nil, fmt.Errorf("fabric ledger %s: %w (the partitions it names may be active: repair it against FM's list, passage-dra fabric check)", p, err)
}

func decodeLedger(b []byte) (*ledger, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var l ledger
	if err := dec.Decode(&l); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("data after the object")
	}
	if l.Version != ledgerVersion {
		return nil, fmt.Errorf("version %d, this plugin reads %d", l.Version, ledgerVersion)
	}
	if l.Claims == nil {
		return nil, errors.New("no claims object")
	}
	for c, e := range l.Claims {
		switch {
		case c == "":
			return nil, errors.New("an empty claim UID")
		case e == nil:
			return nil, fmt.Errorf("claim %s: null", c)
		case e.State != StateActivating && e.State != StateActive && e.State != StateDeactivating:
			return nil, fmt.Errorf("claim %s: state %q", c, manifest.Printable(e.State))
		case len(e.Modules) == 0 || !slices.IsSorted(e.Modules):
			return nil, fmt.Errorf("claim %s: modules %v", c, e.Modules)
		}
	}
	return &l, nil
}

// writeLedger records l atomically (manifest.WriteAtomic: a temporary file, fsync,
// rename, the directory fsynced), before FM is asked to act on it.
func writeLedger(dir string, l *ledger) error {
	l.Version = ledgerVersion
	b, err := json.MarshalIndent(l, "", "  ")
	if err == nil && len(b) > maxLedger {
		err = fmt.Errorf("%d bytes, more than the %d read back", len(b), maxLedger)
	}
	if err == nil {
		err = manifest.WriteAtomic(dir, LedgerFile, append(b, '\n'))
	}
	if err != nil {
		return fmt.Errorf("fabric ledger %s: %w", filepath.Join(dir, LedgerFile), err)
	}
	return nil
}
