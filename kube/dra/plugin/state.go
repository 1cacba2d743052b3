package plugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// stateFile is the released units in StateDir, and how far each is in its turnaround. It
// succeeds withheld.json (a bare object of unit -> generation), which is read once when
// it alone is there and removed after the first write of this one.
const (
	stateFile    = "units.json"
	withheldFile = "withheld.json"
	stateVersion = 1
)

// The turnaround states of a released unit. Every one of them keeps the unit out of the
// slices it could be allocated from.
const (
	// StateWithheld: released, waiting for its recycle (or its next try).
	StateWithheld = "withheld"
	// StateRecycling: a recycle was started (a restart recycles it again from the start).
	StateRecycling = "recycling"
	// StateVerifying: recycled ready at generation Final; the control plane has not yet
	// verified a generation at least that new.
	StateVerifying = "verifying"
	// StateQuarantined: Tries recycles failed; published with a NoSchedule taint and
	// never prepared until an operator clears it (ClearAnnotation).
	StateQuarantined = "quarantined"
)

// States are the turnaround states in the order the metrics list them.
var States = []string{StateWithheld, StateRecycling, StateVerifying, StateQuarantined}

// UnitState is one released unit.
type UnitState struct {
	// Generation is the generation the unit was released under.
	Generation uint64 `json:"generation"`
	State      string `json:"state"`
	// Attempts are the recycles that failed since it was released (or last cleared).
	Attempts int `json:"attempts"`
	// Step and LastError are the last failure's step (erase, reset, recycle, attest,
	// verify) and words.
	Step      string `json:"step,omitempty"`
	LastError string `json:"last_error,omitempty"`
	// NextTry is when the next recycle may start (the backoff after a failure).
	NextTry *time.Time `json:"next_try,omitempty"`
	// Final is the generation its recycle signed it ready in (StateVerifying).
	Final uint64 `json:"final,omitempty"`
}

// units is the file's content.
type units struct {
	Version int `json:"version"`
	// Verified is the newest generation the control plane verified for the plugin's
	// turnaround: a recycled unit comes back only on a verified generation.
	Verified uint64                `json:"verified"`
	Units    map[string]*UnitState `json:"units"`
}

func (u *units) clone() *units {
	c := &units{Version: stateVersion, Verified: u.Verified, Units: map[string]*UnitState{}}
	for k, v := range u.Units {
		s := *v
		c.Units[k] = &s
	}
	return c
}

// decodeUnits is units.json, decoded strictly: the version this plugin writes, no field
// it does not know, every unit named and in a known state. Anything else is refused at
// start: guessing would offer a released unit unrecycled.
func decodeUnits(b []byte) (*units, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var u units
	if err := dec.Decode(&u); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("data after the object")
	}
	if u.Version != stateVersion {
		return nil, fmt.Errorf("version %d, this plugin reads %d", u.Version, stateVersion)
	}
	if u.Units == nil {
		return nil, errors.New("no units object")
	}
	for id, s := range u.Units {
		switch {
		case id == "":
			return nil, errors.New("an empty unit ID")
		case s == nil:
			return nil, fmt.Errorf("unit %s: null", id)
		case s.Attempts < 0:
			return nil, fmt.Errorf("unit %s: %d attempts", id, s.Attempts)
		}
		known := false
		for _, st := range States {
			known = known || s.State == st
		}
		if !known {
			return nil, fmt.Errorf("unit %s: state %q", id, manifest.Printable(s.State))
		}
	}
	return &u, nil
}

// decodeHeld is withheld.json: a JSON object of unit IDs to generations. Anything else
// (null, another type, an empty unit) is refused at start.
func decodeHeld(b []byte) (map[string]uint64, error) {
	var held map[string]uint64
	if err := json.Unmarshal(b, &held); err != nil {
		return nil, err
	}
	if held == nil {
		return nil, errors.New("not a JSON object of units (null)")
	}
	for u := range held {
		if u == "" {
			return nil, errors.New("an empty unit ID")
		}
	}
	return held, nil
}

// readUnits reads units.json, or withheld.json when it alone is there (each of its units
// withheld, no attempt made).
func (d *Driver) readUnits() error {
	d.units = &units{Version: stateVersion, Units: map[string]*UnitState{}}
	if d.cfg.StateDir == "" {
		return nil
	}
	p := filepath.Join(d.cfg.StateDir, stateFile)
	b, err := manifest.ReadRegular(p, MaxFile)
	if err == nil {
		if d.units, err = decodeUnits(b); err == nil {
			return nil
		}
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("released units %s: %w (the units it names would be offered unrecycled: repair or remove it once the node is recycled)", p, err)
	}
	p = filepath.Join(d.cfg.StateDir, withheldFile)
	b, err = manifest.ReadRegular(p, MaxFile)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var held map[string]uint64
	if err == nil {
		held, err = decodeHeld(b)
	}
	if err != nil {
		return fmt.Errorf("withheld units %s: %w (the released units it names would be offered unrecycled: repair or remove it once the node is recycled)", p, err)
	}
	for id, gen := range held {
		d.units.Units[id] = &UnitState{Generation: gen, State: StateWithheld}
	}
	return nil
}

// writeUnits records u, before anything is let go of or done on its strength: a restart
// must find every released unit, and how far its turnaround got.
func (d *Driver) writeUnits(u *units) error {
	if d.cfg.StateDir == "" {
		return nil
	}
	u.Version = stateVersion
	b, err := json.Marshal(u)
	if err == nil && len(b) > MaxFile {
		err = fmt.Errorf("%d bytes, more than the %d the plugin reads back", len(b), MaxFile)
	}
	if err == nil {
		err = manifest.WriteAtomic(d.cfg.StateDir, stateFile, b)
	}
	if err != nil {
		return fmt.Errorf("released units %s: %w", filepath.Join(d.cfg.StateDir, stateFile), err)
	}
	if err := os.Remove(filepath.Join(d.cfg.StateDir, withheldFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		d.logf("%s: not removed after %s was written: %v", withheldFile, stateFile, err)
	}
	return nil
}

// held are the released units' IDs.
func (u *units) held() map[string]bool {
	out := map[string]bool{}
	for id := range maps.Keys(u.Units) {
		out[id] = true
	}
	return out
}
