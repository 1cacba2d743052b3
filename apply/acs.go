// Package apply executes the ACS plan: for each planned port it reads ACS Control,
// computes (ctl &^ mask) | flags, writes the 16-bit register through pci.WriteRegister
// (which reads it back), and records before, target and after. It judges no unit: a
// failure on one port stops that unit's later ports and never the other units, and the
// decision reads the report; no failure leaves a port with SV, RR, CR or UF cleared.
package apply

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"syscall"
	"time"

	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/topology"
)

// Result is what happened to one port. The words are the manifest's too.
type Result string

const (
	ResultApplied    Result = "applied"     // written and read back as the target
	ResultUnchanged  Result = "unchanged"   // already at the target
	ResultVerified   Result = "verified"    // the kernel applied pci=config_acs= from the command line
	ResultWouldApply Result = "would apply" // dry run: differs from the target
	ResultNoACS      Result = "no ACS capability"
	ResultSkipped    Result = "skipped" // not to be written (Change.Note says why)
	ResultLockedDown Result = "locked down"
	ResultMismatch   Result = "mismatch" // written, reads back otherwise
	ResultFailed     Result = "failed"
)

// Change is the record of one port, for the console and the manifest.
type Change struct {
	Addr     pci.Address       `json:"bdf"`
	Unit     topology.UnitID   `json:"unit"`
	Shared   []topology.UnitID `json:"shared,omitempty"` // other units whose paths hold the port
	Position string            `json:"position"`
	Offset   int               `json:"offset"` // config offset of ACS Control
	Mask     pci.ACSBits       `json:"mask"`
	Flags    pci.ACSBits       `json:"flags"`
	Before   pci.ACSBits       `json:"before"`
	Target   pci.ACSBits       `json:"target"`
	After    pci.ACSBits       `json:"after"`
	Result   Result            `json:"result"`
	Attempts int               `json:"attempts,omitempty"` // writes tried
	Error    string            `json:"error,omitempty"`
	Note     string            `json:"note,omitempty"`
	// Read says ACS Control was read: Before and After are values (false: skipped, no
	// capability, or unreadable).
	Read bool `json:"read"`
}

func (c Change) String() string {
	s := fmt.Sprintf("acs %s (%s, %s): ACSCtl 0x%04x -> 0x%04x, reads 0x%04x: %s", c.Addr, c.Unit.String(), c.Position,
		uint16(c.Before), uint16(c.Target), uint16(c.After), c.Result)
	if !c.Read {
		// Never read: no register values to show.
		s = fmt.Sprintf("acs %s (%s, %s): %s", c.Addr, c.Unit.String(), c.Position, c.Result)
	}
	if c.Error != "" {
		s += ": " + c.Error
	}
	if c.Note != "" {
		s += " (" + c.Note + ")"
	}
	return s
}

// Report is the outcome of one ACS run.
type Report struct {
	Changes []Change `json:"changes"`
	// ConfigACS is the whole plan as a kernel argument, for an operator who wants it
	// persistent.
	ConfigACS string `json:"config_acs,omitempty"`
	// Advice says what an operator must do about failures (lockdown).
	Advice []string `json:"advice,omitempty"`
}

// Failed says whether the port did not reach its target and cannot be left as it is.
func (c Change) Failed() bool {
	return c.Result == ResultFailed || c.Result == ResultMismatch || c.Result == ResultLockedDown
}

// Failed says whether any port failed or was refused.
func (r Report) Failed() bool {
	for _, c := range r.Changes {
		if c.Failed() {
			return true
		}
	}
	return false
}

// Writes counts the ports written.
func (r Report) Writes() int {
	n := 0
	for _, c := range r.Changes {
		if c.Result == ResultApplied {
			n++
		}
	}
	return n
}

// Options tune a run. IO is required.
type Options struct {
	IO pci.ConfigIO
	// Cmdline is the kernel command line. A port it configures with the plan's own
	// pci=config_acs= setting is read back: verified when the kernel set the target; when
	// it did not, written (with a note), or under lockdown a mismatch.
	Cmdline string
	// Tree is the scanned tree the ports were planned from: the kernel matches an entry
	// naming functions by IDs or by a path against the function itself (ConfigACS.For).
	// Without it such an entry, read before a port's own, leaves the port unverified.
	Tree *pci.Tree
	// KernelRelease ("6.1.0-57-amd64") goes into the lockdown advice.
	KernelRelease string
	DryRun        bool
	// LockedDown says the kernel refuses config writes from user space
	// (/sys/kernel/security/lockdown): a port that needs a write is reported locked down
	// without one.
	LockedDown bool
	// Retries bounds the retries of a port whose access fails with EIO or EBUSY (0 means
	// DefaultRetries; negative means none). The wait doubles from Backoff each time.
	Retries int
	Backoff time.Duration
	// Sleep waits between retries; nil means a timer that also stops on ctx.
	Sleep func(ctx context.Context, d time.Duration) error
}

// Defaults for Options.
const (
	DefaultRetries = 4
	DefaultBackoff = 5 * time.Millisecond
)

type executor struct {
	opt     Options
	ctx     context.Context
	cmdline *ConfigACS
	stopped map[topology.UnitID]string // unit -> the port whose failure stopped it
}

// ACS executes the plan, port by port in plan order, and reports each; it judges no
// unit (package decision does, from the report). A port whose Skip is set is not
// touched. Once a port of a unit fails, the unit's later ports are skipped: the plan puts
// a unit's DT ports last, so a unit whose isolation could not be finished never gets DT.
// Once ctx is done nothing more is written.
func ACS(ctx context.Context, ports []topology.ACSPort, opt Options) (Report, error) {
	if opt.IO == nil {
		return Report{}, errors.New("acs apply: no config space access")
	}
	switch {
	case opt.Retries == 0:
		opt.Retries = DefaultRetries
	case opt.Retries < 0:
		opt.Retries = 0
	}
	if opt.Backoff <= 0 {
		opt.Backoff = DefaultBackoff
	}
	if opt.Sleep == nil {
		opt.Sleep = sleepCtx
	}
	x := &executor{opt: opt, ctx: ctx, cmdline: ParseConfigACS(opt.Cmdline), stopped: map[topology.UnitID]string{}}
	var write []topology.ACSPort
	for _, p := range ports {
		if p.Skip == "" {
			write = append(write, p)
		}
	}
	rep := Report{ConfigACS: topology.KernelArg(write)}
	var locked []topology.ACSPort
	for _, p := range ports {
		c := x.port(p)
		rep.Changes = append(rep.Changes, c)
		if c.Result == ResultLockedDown {
			locked = append(locked, p)
		}
		if c.Failed() {
			for _, u := range p.Units() {
				if _, ok := x.stopped[u]; !ok {
					x.stopped[u] = p.Addr.String()
				}
			}
		}
	}
	if len(locked) > 0 {
		rep.Advice = append(rep.Advice, LockdownAdvice(topology.KernelArg(locked), opt.KernelRelease))
	}
	return rep, nil
}

// Isolated says whether the port, as last read, holds every isolation bit the plan
// wants: then a refused write costs DT only, not safety.
func (c Change) Isolated() bool {
	want := c.Flags & pci.ACSIsolation
	return c.After&want == want
}

// allStopped says whether every unit whose path holds the port has stopped (and names a
// port that stopped one): a port another unit still relies on is written.
func (x *executor) allStopped(p topology.ACSPort) (string, bool) {
	at := ""
	for _, u := range p.Units() {
		a, ok := x.stopped[u]
		if !ok {
			return "", false
		}
		at = a
	}
	return at, true
}

func (x *executor) fail(c *Change, format string, args ...any) {
	c.Result = ResultFailed
	c.Error = fmt.Sprintf(format, args...)
}

func (x *executor) port(p topology.ACSPort) Change {
	c := Change{Addr: p.Addr, Unit: p.Unit, Shared: p.Shared, Position: p.Position, Mask: p.Mask, Flags: p.Flags}
	if p.Offset == 0 {
		c.Result = ResultNoACS
		c.Note = p.Reason
		return c
	}
	c.Offset = p.CtlOffset()
	if p.Skip != "" {
		c.Result, c.Note = ResultSkipped, p.Skip
		return c
	}
	if at, ok := x.allStopped(p); ok {
		c.Result, c.Note = ResultSkipped, fmt.Sprintf("port %s of the unit failed first", at)
		return c
	}
	if p.Offset < pci.ConventionalSize || c.Offset+2 > pci.ExtendedSize {
		x.fail(&c, "plan names ACS at 0x%03x, outside extended config space", p.Offset)
		return c
	}
	cur, attempts, err := x.read(p.Addr, c.Offset)
	if err != nil {
		x.failAccess(&c, "read ACSCtl", attempts, err)
		return c
	}
	p.Current = cur
	c.Before, c.Target, c.After, c.Read = cur, p.Target(), cur, true

	// The entry the kernel applied to the port: the first that matches it.
	r := x.cmdline.For(x.opt.Tree, p.Addr)
	set := r.Setting
	inCmdline := r.Set && set.Plans(p)
	switch {
	case cur == c.Target && inCmdline:
		c.Result = ResultVerified
		return c
	case cur == c.Target:
		c.Result = ResultUnchanged
		return c
	case inCmdline:
		// The kernel was asked to apply this and did not (a kernel before 6.11 ignores
		// the argument): write it now rather than leave the unit without it.
		c.Note = fmt.Sprintf("kernel did not apply pci=config_acs=%s", set.Entry)
	}
	switch {
	case x.opt.LockedDown && inCmdline:
		// The kernel was asked and did not set it; nothing else may.
		c.Result = ResultMismatch
		c.Error = fmt.Sprintf("pci=config_acs=%s asks 0x%04x, reads 0x%04x (locked down: not written)", set.Entry, uint16(c.Target), uint16(cur))
		c.Note = ""
		return c
	case x.opt.LockedDown:
		c.Result = ResultLockedDown
		c.Error = "the kernel is locked down: config writes from user space are refused"
		return c
	case x.opt.DryRun:
		c.Result = ResultWouldApply
		return c
	case x.ctx.Err() != nil:
		x.fail(&c, "not written: %v", x.ctx.Err())
		return c
	}
	x.write(&c, p)
	return c
}

// read reads ACS Control, retrying transient errors. All-ones is what a function that
// left the bus returns for every register.
func (x *executor) read(a pci.Address, off int) (pci.ACSBits, int, error) {
	var v uint32
	attempts, err := x.retry(func() error {
		var err error
		v, err = pci.ReadRegister(x.opt.IO, a, off, 2)
		return err
	})
	if err == nil && v == 0xffff {
		err = errAllOnes
	}
	return pci.ACSBits(v), attempts, err
}

var errAllOnes = fmt.Errorf("config space reads all ones: %w", syscall.ENODEV)

func (x *executor) write(c *Change, p topology.ACSPort) {
	var w pci.Write
	attempts, err := x.retry(func() error {
		var err error
		w, err = pci.WriteRegister(x.opt.IO, p.Addr, c.Offset, 2, uint32(c.Target))
		return err
	})
	c.Attempts = attempts
	switch {
	case err == nil:
		c.After = pci.ACSBits(w.After)
		c.Result = ResultApplied
		return
	case errors.Is(err, syscall.EPERM):
		// Kernel lockdown (integrity) refuses config writes from user space
		// (pci_write_config in drivers/pci/pci-sysfs.c checks security_locked_down).
		c.Result = ResultLockedDown
		c.Error = fmt.Sprintf("write ACSCtl: %v", err)
	case errors.Is(err, pci.ErrReadBack):
		c.After = pci.ACSBits(w.After)
		c.Result = ResultMismatch
		c.Error = fmt.Sprintf("wrote 0x%04x, reads back 0x%04x", uint16(c.Target), uint16(w.After))
	default:
		x.failAccess(c, "write ACSCtl", attempts, err)
	}
	x.secure(c)
}

func (x *executor) failAccess(c *Change, what string, attempts int, err error) {
	switch {
	case isVanished(err):
		x.fail(c, "device vanished: %s: %v", what, err)
	case isTransient(err) && attempts > 1:
		x.fail(c, "%s: %v (after %d attempts)", what, err, attempts)
	default:
		x.fail(c, "%s: %v", what, err)
	}
}

// secure runs after a write that did not succeed, when part of it may have landed (a
// retried EIO, a register that took some bits): it re-reads the port and puts back any
// isolation bit that was set before or is planned, so a failure never opens peer-to-peer
// paths the IOMMU cannot see.
func (x *executor) secure(c *Change) {
	if x.ctx.Err() != nil {
		// Given up on: nothing more is written. The plan only ever sets isolation bits,
		// so a write cut short cannot have cleared one.
		return
	}
	cur, _, err := x.read(c.Addr, c.Offset)
	if err != nil {
		if !c.Failed() || !isVanished(err) {
			c.Note = joinNote(c.Note, fmt.Sprintf("could not re-read after the failure: %v", err))
		}
		return
	}
	c.After = cur
	need := (c.Before | c.Target) & pci.ACSIsolation
	if cur&need == need {
		return
	}
	restore := cur | need
	w, err := pci.WriteRegister(x.opt.IO, c.Addr, c.Offset, 2, uint32(restore))
	if err == nil || errors.Is(err, pci.ErrReadBack) {
		c.After = pci.ACSBits(w.After)
	}
	if err != nil || c.After&need != need {
		c.Note = joinNote(c.Note, fmt.Sprintf("isolation bits %s clear after the failure; restoring 0x%04x failed: %v", need&^c.After, uint16(restore), err))
		return
	}
	c.Note = joinNote(c.Note, fmt.Sprintf("restored isolation bits: 0x%04x", uint16(c.After)))
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

// retry runs f until it succeeds, fails with something other than EIO/EBUSY/EAGAIN, or
// the retries are spent. It returns how many times f ran.
func (x *executor) retry(f func() error) (int, error) {
	wait := x.opt.Backoff
	for n := 1; ; n++ {
		err := f()
		if err == nil || !isTransient(err) || n > x.opt.Retries {
			return n, err
		}
		if serr := x.opt.Sleep(x.ctx, wait); serr != nil {
			return n, fmt.Errorf("%w (retries stopped: %v)", err, serr)
		}
		wait *= 2
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func isTransient(err error) bool {
	return errors.Is(err, syscall.EIO) || errors.Is(err, syscall.EBUSY) || errors.Is(err, syscall.EAGAIN)
}

// isVanished covers a function removed from sysfs (ENOENT), a device that no longer
// answers (ENODEV, ENXIO) and all-ones reads.
func isVanished(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENODEV) || errors.Is(err, syscall.ENXIO)
}

// Units are every unit whose path holds the port.
func (c Change) Units() []topology.UnitID { return append([]topology.UnitID{c.Unit}, c.Shared...) }
