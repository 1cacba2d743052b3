package fabricmanager

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// Fabric is the plugin's FM: a ledger of which claim holds which partition, kept in a
// state directory, and a connection to FM made when first needed (and made again after
// a failure). Every change is written to the ledger before FM is asked to make it, and
// what FM answered is written after; a claim is given a partition only when both say so.
type Fabric struct {
	dir string
	o   Options
	mu  sync.Mutex
	c   *Client
	l   *ledger // as written last
}

// New reads the ledger in dir (LedgerFile); nothing is asked of FM yet. A ledger that
// cannot be read is refused.
func New(dir string, o Options) (*Fabric, error) {
	if dir == "" {
		return nil, errors.New("fabric: no state directory for the ledger")
	}
	l, err := readLedger(dir)
	if err != nil {
		return nil, err
	}
	return &Fabric{dir: dir, o: o, l: l}, nil
}

// Close lets go of the connection to FM.
func (f *Fabric) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.c == nil {
		return nil
	}
	err := f.c.Close()
	f.c = nil
	return err
}

func (f *Fabric) client() (*Client, error) {
	if f.c == nil {
		c, err := Open(f.o)
		if err != nil {
			return nil, err
		}
		f.c = c
	}
	return f.c, nil
}

// save records l, then makes it the Fabric's; f.mu held.
func (f *Fabric) save(l *ledger) error {
	if err := writeLedger(f.dir, l); err != nil {
		return err
	}
	f.l = l
	return nil
}

// restartedIDs are the partitions FM is told are active after its --restart: those
// the ledger gives to a claim, or to a released claim FM did not deactivate. One still
// being activated is not: its claim was not answered, no VM runs on it.
func (l *ledger) restartedIDs() []uint32 {
	ids := []uint32{} // FM wants the list even when it is empty
	for _, e := range l.Claims {
		if e.State != StateActivating && !slices.Contains(ids, e.Partition) {
			ids = append(ids, e.Partition)
		}
	}
	slices.Sort(ids)
	return ids
}

// partitions is FM's list. An FM waiting for the active list after a --restart
// (FM_ST_NOT_CONFIGURED) is handed the ledger's first (handed, non-nil then); f.mu held.
func (f *Fabric) partitions(c *Client) (ps []Partition, handed []uint32, err error) {
	ps, err = c.Partitions()
	if r, ok := Code(err); ok && r == FM_ST_NOT_CONFIGURED {
		handed = f.l.restartedIDs()
		if err := c.SetActivated(handed); err != nil {
			return nil, nil, err
		}
		ps, err = c.Partitions()
	}
	return ps, handed, err
}

// again runs op once more after FM_ST_NOT_CONFIGURED, once FM (restarted since the
// list was read) was handed the ledger's active list; f.mu held.
func (f *Fabric) again(c *Client, err error, op func() error) error {
	if r, ok := Code(err); !ok || r != FM_ST_NOT_CONFIGURED {
		return err
	}
	if _, _, lerr := f.partitions(c); lerr != nil {
		return err
	}
	return op()
}

// exact is FM's partition whose members are exactly modules (sorted).
func exact(ps []Partition, modules []int) (Partition, bool) {
	for _, p := range ps {
		if slices.Equal(p.Modules(), modules) {
			return p, true
		}
	}
	return Partition{}, false
}

func sets(ps []Partition) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = strconv.FormatUint(uint64(p.ID), 10) + ":{" + moduleList(p.Modules()) + "}"
	}
	return strings.Join(s, " ")
}

func overlaps(a, b []int) bool {
	return slices.ContainsFunc(a, func(m int) bool { return slices.Contains(b, m) })
}

// Activate gives claim FM's partition whose members are exactly the GPU Module IDs
// modules: it is written to the ledger as activating, FM activates it, and the ledger
// says active before Activate returns. It is refused, FM untouched, when FM offers no
// such partition, when one of its GPUs has NVLinks down, when another claim of the
// ledger holds one of the modules, or when FM already has it active for no claim of
// the ledger. FM's refusal, or FM out of reach, is the error (naming FM's return code),
// the ledger left as FM's list says: the intent dropped when the partition is not
// active, kept when FM cannot say. Activating a claim's partition again is a no-op.
func (f *Fabric) Activate(claim string, modules []int) (Partition, error) {
	want := slices.Sorted(slices.Values(modules))
	if len(want) == 0 {
		return Partition{}, errors.New("fm: no GPU module to activate a partition for")
	}
	for i, m := range want {
		if m <= 0 {
			return Partition{}, fmt.Errorf("fm: module ID %d: not a GPU Module ID", m)
		}
		if i > 0 && want[i-1] == m {
			return Partition{}, fmt.Errorf("fm: module %d given twice", m)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	// What the ledger alone refuses is refused before FM is asked anything.
	e := f.l.Claims[claim]
	if e != nil && e.State == StateDeactivating {
		return Partition{}, fmt.Errorf("fm: claim %s was released: partition %d is being deactivated", claim, e.Partition)
	}
	if e == nil {
		for _, other := range f.l.claims() {
			if o := f.l.Claims[other]; overlaps(o.Modules, want) {
				return Partition{}, fmt.Errorf("fm: modules %s: claim %s holds partition %d (modules %s, %s)", moduleList(want), other, o.Partition, moduleList(o.Modules), o.State)
			}
		}
	}
	c, err := f.client()
	if err != nil {
		return Partition{}, err
	}
	ps, _, err := f.partitions(c)
	if err != nil {
		return Partition{}, err
	}
	p, ok := exact(ps, want)
	if !ok {
		return Partition{}, fmt.Errorf("fm: none of FM's %d partitions has exactly modules %s (FM's: %s)", len(ps), moduleList(want), sets(ps))
	}
	if d := p.Degraded(); len(d) > 0 {
		return p, fmt.Errorf("fm: %s is degraded: %s", p, strings.Join(d, ", "))
	}
	switch {
	case e != nil && e.Partition != p.ID:
		return p, fmt.Errorf("fm: claim %s holds partition %d (modules %s), not %d", claim, e.Partition, moduleList(e.Modules), p.ID)
	case e != nil && p.Active:
		// Activated for the claim before: now, or by a process that stopped before it
		// wrote FM's answer down.
		return p, f.settled(claim, StateActive, nil)
	case p.Active:
		return p, fmt.Errorf("fm: %s is active in FM and no claim of the ledger holds it (activated outside passage-dra?): refused", p)
	}
	l := f.l.clone()
	l.Claims[claim] = &Entry{Partition: p.ID, Modules: want, State: StateActivating}
	if err := f.save(l); err != nil {
		return p, err
	}
	act := func() error { return c.Activate(p.ID) }
	err = f.again(c, act(), act)
	if err == nil {
		p.Active = true
		return p, f.settled(claim, StateActive, nil)
	}
	// FM said no, or could not be asked: its list says whether the partition is active.
	r, _ := Code(err)
	ps, lerr := c.Partitions()
	q, listed := exact(ps, want)
	switch {
	case lerr != nil || !listed:
		return p, errors.Join(err, f.settled(claim, StateActivating, err))
	case !q.Active:
		return p, errors.Join(err, f.settled(claim, "", nil))
	case r == FM_ST_PARTITION_ID_IN_USE || r == FM_ST_IN_USE:
		// Already active (current FMs say -17, the guide documents IN_USE), and the
		// ledger had it as this claim's first.
		return q, f.settled(claim, StateActive, nil)
	}
	return p, errors.Join(err, f.settled(claim, StateActivating, err))
}

// settled records claim's entry in state (dropped when ""), with the error FM gave;
// f.mu held.
func (f *Fabric) settled(claim, state string, ferr error) error {
	msg := ""
	if ferr != nil {
		msg = ferr.Error()
	}
	e := f.l.Claims[claim]
	if (e == nil && state == "") || (e != nil && e.State == state && e.LastError == msg) {
		return nil
	}
	l := f.l.clone()
	if state == "" {
		delete(l.Claims, claim)
	} else {
		l.Claims[claim].State, l.Claims[claim].LastError = state, msg
	}
	return f.save(l)
}

// Deactivate releases claim's partition: the ledger says deactivating, FM deactivates
// it (a partition FM confirms is not active counts as done: deactivate), and the claim
// leaves the ledger. FM's refusal, or FM out of reach, is the error, the claim left
// deactivating with it:
// the partition stays the claim's (its GPUs must not be reset or given to another), and
// Resume asks FM again. A claim the ledger does not hold is done.
func (f *Fabric) Deactivate(claim string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	e := f.l.Claims[claim]
	if e == nil {
		return nil
	}
	if e.State != StateDeactivating {
		if err := f.settled(claim, StateDeactivating, nil); err != nil {
			return err
		}
	}
	err := f.deactivate(e.Partition)
	if err == nil {
		return f.settled(claim, "", nil)
	}
	return errors.Join(err, f.settled(claim, StateDeactivating, err))
}

// deactivate asks FM to deactivate id; nil only when FM confirmed it is not active
// after: FM did it, or answered FM_ST_PARTITION_ID_NOT_IN_USE (current FMs' "not
// active", NVLINK.md §2), or answered otherwise and its list, read now, has it not
// active. The guide's own "not active", FM_ST_UNINITIALIZED, is also what a connection
// FM restarted under answers, so it is never taken alone; FM not answering is never
// "not active": its GPUs may still be in the partition. f.mu held.
func (f *Fabric) deactivate(id uint32) error {
	c, err := f.client()
	if err != nil {
		return err
	}
	deact := func() error { return c.Deactivate(id) }
	err = f.again(c, deact(), deact)
	r, answered := Code(err)
	switch {
	case err == nil || (answered && r == FM_ST_PARTITION_ID_NOT_IN_USE):
		return nil
	case !answered:
		return err
	}
	ps, _, lerr := f.partitions(c)
	if lerr != nil {
		return fmt.Errorf("%w; partition %d's state unknown: %w", err, id, lerr)
	}
	i := slices.IndexFunc(ps, func(p Partition) bool { return p.ID == id })
	switch {
	case i < 0:
		return fmt.Errorf("%w; partition %d is not in FM's list", err, id)
	case ps[i].Active:
		return fmt.Errorf("%w; FM lists %s", err, ps[i])
	}
	return nil
}

// Holding are the claims of the ledger whose partitions have any of modules, sorted.
func (f *Fabric) Holding(modules []int) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, c := range f.l.claims() {
		if overlaps(f.l.Claims[c].Modules, modules) {
			out = append(out, c)
		}
	}
	return out
}

// Entries are the ledger's claims, by UID.
func (f *Fabric) Entries() map[string]Entry {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]Entry{}
	for c, e := range f.l.Claims {
		ce := *e
		ce.Modules = slices.Clone(e.Modules)
		out[c] = ce
	}
	return out
}

// Report is what Resume did and found.
type Report struct {
	// Handed are the partitions FM was told are active (fmSetActivatedFabricPartitions)
	// because it was waiting for them after a --restart; nil when it was not waiting.
	Handed []uint32
	// Settled are the ledger's entries FM's list settled: activations that never took,
	// releases FM had done or did now.
	Settled []string
	// Differences are where FM and the ledger still disagree, each naming the
	// partition and the claim.
	Differences []string
	// Partitions is FM's partition list as Resume read it.
	Partitions []Partition
}

// Lines are the report's sentences, for a log.
func (r Report) Lines() []string {
	var out []string
	if r.Handed != nil {
		out = append(out, fmt.Sprintf("FM was waiting for the active partitions after a restart: handed [%s]", idList(r.Handed)))
	}
	out = append(out, r.Settled...)
	return append(out, r.Differences...)
}

// Resume brings the ledger and FM together, at the plugin's start and periodically
// after (an FM restart waits 60 s at most for its list): FM waiting after a --restart
// is handed the ledger's active partitions; activations FM does not have are dropped;
// released claims whose partition FM still has active are deactivated again; and what
// still differs is named: partitions active in FM that no claim holds, claims whose
// partition FM does not have active, degraded partitions in use. FM out of reach is the
// error, the ledger untouched.
func (f *Fabric) Resume() (Report, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var r Report
	c, err := f.client()
	if err != nil {
		return r, err
	}
	ps, handed, err := f.partitions(c)
	r.Handed = handed
	if err != nil {
		return r, err
	}
	r.Partitions = ps
	byID := map[uint32]Partition{}
	for _, p := range ps {
		byID[p.ID] = p
	}
	l := f.l.clone()
	held := map[uint32]bool{}
	for _, claim := range l.claims() {
		e := l.Claims[claim]
		p, ok := byID[e.Partition]
		held[e.Partition] = true
		switch {
		case !ok:
			r.Differences = append(r.Differences, fmt.Sprintf("claim %s: partition %d (%s) is not in FM's list", claim, e.Partition, e.State))
			continue
		case !slices.Equal(p.Modules(), e.Modules):
			r.Differences = append(r.Differences, fmt.Sprintf("claim %s: partition %d has modules %s in FM, %s in the ledger", claim, e.Partition, moduleList(p.Modules()), moduleList(e.Modules)))
		}
		switch e.State {
		case StateActivating:
			if !p.Active {
				delete(l.Claims, claim)
				r.Settled = append(r.Settled, fmt.Sprintf("claim %s: partition %d was never activated (its claim was not answered): dropped", claim, e.Partition))
			} else {
				r.Differences = append(r.Differences, fmt.Sprintf("claim %s: %s is active in FM, its activation not confirmed (a prepare of the claim takes it, its unprepare releases it)", claim, p))
			}
		case StateActive:
			if !p.Active {
				r.Differences = append(r.Differences, fmt.Sprintf("claim %s: partition %d (modules %s) is the claim's in the ledger, not active in FM: its VM has no NVLink", claim, e.Partition, moduleList(e.Modules)))
			}
		case StateDeactivating:
			derr := error(nil)
			if p.Active {
				derr = f.deactivate(e.Partition)
			}
			if derr == nil {
				delete(l.Claims, claim)
				r.Settled = append(r.Settled, fmt.Sprintf("claim %s (released): partition %d is not active in FM: dropped", claim, e.Partition))
			} else {
				e.LastError = derr.Error()
				r.Differences = append(r.Differences, fmt.Sprintf("claim %s (released): %s is still active in FM: %v", claim, p, derr))
			}
		}
		if d := p.Degraded(); p.Active && len(d) > 0 {
			r.Differences = append(r.Differences, fmt.Sprintf("claim %s: %s is degraded: %s", claim, p, strings.Join(d, ", ")))
		}
	}
	for _, p := range ps {
		if p.Active && !held[p.ID] {
			r.Differences = append(r.Differences, fmt.Sprintf("%s is active in FM, and no claim of the ledger holds it", p))
		}
	}
	if len(r.Settled) > 0 || !ledgerEqual(l, f.l) {
		if err := f.save(l); err != nil {
			return r, err
		}
	}
	return r, nil
}

func ledgerEqual(a, b *ledger) bool {
	if len(a.Claims) != len(b.Claims) {
		return false
	}
	for c, e := range a.Claims {
		o := b.Claims[c]
		if o == nil || o.Partition != e.Partition || o.State != e.State || o.LastError != e.LastError || !slices.Equal(o.Modules, e.Modules) {
			return false
		}
	}
	return true
}

func idList(ids []uint32) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatUint(uint64(id), 10)
	}
	return strings.Join(s, ",")
}
