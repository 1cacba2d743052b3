// Package erase removes one tenant's data from a unit's NVMe before the next tenant gets
// it, and reports what it did: the strongest method the controller advertises, in NIST
// SP 800-88 order (Sanitize crypto erase, Sanitize block erase, Format NVM with crypto
// erase, Format NVM with user data erase; Sanitize overwrite only when asked), the
// Sanitize Status log polled to a deadline, and a sample of logical blocks in every
// namespace read back. It also resets every passthrough function through the kernel.
//
// It reports and judges nothing: whether a unit may be passed through after what it
// reports is package decision's call (Decision.Conclude, Decision.Bindable).
package erase

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Method is how a controller was erased, in the record's words.
type Method string

const (
	SanitizeCrypto    Method = "sanitize-crypto-erase"
	SanitizeBlock     Method = "sanitize-block-erase"
	SanitizeOverwrite Method = "sanitize-overwrite"
	FormatCrypto      Method = "format-crypto-erase"
	FormatUserData    Method = "format-user-data-erase"
)

// Options tune Erase. The zero value is what a node uses.
type Options struct {
	// Overwrite allows Sanitize overwrite, after every other method (hours on a large
	// drive): only when the policy names it.
	Overwrite bool
	// SanitizeTimeout bounds the wait for a sanitize to complete (default 2h; ctx bounds
	// it too).
	SanitizeTimeout time.Duration
	// PollInterval is the step of that wait (default 1s).
	PollInterval time.Duration
	// Samples is how many logical blocks of each namespace are read back (default 64):
	// the first, the last, and the rest spread evenly between.
	Samples int
	// Sleep waits for d or until ctx ends; nil is a timer. Tests step a fake clock.
	Sleep func(ctx context.Context, d time.Duration) error
	// Now is the clock; nil is time.Now.
	Now func() time.Time
	// Progress, when set, is told each step as it starts ("identify", a method, each
	// Sanitize Status poll with the controller's SPROG, "verify"): an erase can run for
	// hours, and a console that says nothing meanwhile looks like a hung node.
	Progress func(step string)
}

func (o Options) withDefaults() Options {
	if o.SanitizeTimeout <= 0 {
		o.SanitizeTimeout = 2 * time.Hour
	}
	if o.PollInterval <= 0 {
		o.PollInterval = time.Second
	}
	if o.Samples <= 0 {
		o.Samples = 64
	}
	if o.Progress == nil {
		o.Progress = func(string) {}
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Sleep == nil {
		o.Sleep = func(ctx context.Context, d time.Duration) error {
			t := time.NewTimer(d)
			defer t.Stop()
			select {
			case <-t.C:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	return o
}

// Namespace is one namespace as erased and verified.
type Namespace struct {
	NSID      uint32 `json:"nsid"`
	Blocks    uint64 `json:"blocks"`     // NSZE
	BlockSize int    `json:"block_size"` // bytes
	DLFEAT    uint8  `json:"dlfeat"`
	Verified  int    `json:"verified_lbas"`
}

// Attempt is one method tried: what the controller answered.
type Attempt struct {
	Method Method `json:"method"`
	Status string `json:"status"` // the completion status, or the error
}

// Result is what erasing one controller did.
type Result struct {
	Model    string      `json:"model"`
	Serial   string      `json:"serial"`
	Firmware string      `json:"firmware"`
	SANICAP  uint32      `json:"sanicap"`
	FNA      uint8       `json:"fna"`
	NS       []Namespace `json:"namespaces"`
	// Method is the method that erased the controller; "" when none did.
	Method   Method    `json:"method,omitempty"`
	Attempts []Attempt `json:"attempts,omitempty"`
	// SanitizeLog is SSTAT's state after a sanitize ("completed", ...).
	SanitizeLog string        `json:"sanitize_status,omitempty"`
	Duration    time.Duration `json:"duration_ns"`
	// VerifiedLBAs is how many blocks were read back as the deallocated pattern.
	VerifiedLBAs int `json:"verified_lbas"`
	// Err is why the controller is not known to be erased; "" when it was erased and
	// every sampled block read back clean.
	Err string `json:"error,omitempty"`
}

// Erased says the controller was erased and verified.
func (r *Result) Erased() bool { return r.Err == "" && r.Method != "" }

// Erase erases every namespace of the controller by the strongest method it offers and
// verifies the result. It never returns without a Result; Err says what went wrong.
func Erase(ctx context.Context, c Controller, opts Options) (r Result) {
	opts = opts.withDefaults()
	start := opts.Now()
	defer func() { r.Duration = opts.Now().Sub(start) }()
	fail := func(err error) Result {
		r.Err = err.Error()
		return r
	}
	buf := make([]byte, IdentifySize)
	opts.Progress("identify")
	if err := c.Admin(ctx, Command{Opcode: OpIdentify, CDW10: CNSController}, buf); err != nil {
		return fail(fmt.Errorf("identify controller: %w", err))
	}
	id, err := ParseIDController(buf)
	if err != nil {
		return fail(err)
	}
	r.Model, r.Serial, r.Firmware, r.SANICAP, r.FNA = id.Model, id.Serial, id.Firmware, id.SANICAP, id.FNA

	nss, ids, err := namespaces(ctx, c)
	if err != nil {
		return fail(err)
	}
	for i, n := range nss {
		r.NS = append(r.NS, Namespace{NSID: ids[i], Blocks: n.NSZE, BlockSize: n.BlockSize(), DLFEAT: n.DLFEAT})
	}
	// Namespaces allocated but not attached hold a tenant's data as well, and no active
	// list names them.
	inactive, err := inactiveNamespaces(ctx, c, id, ids)
	if err != nil {
		return fail(err)
	}
	r.NS = append(r.NS, inactive...)

	var methods []Method
	if id.SANICAP&SANICAPCES != 0 {
		methods = append(methods, SanitizeCrypto)
	}
	if id.SANICAP&SANICAPBES != 0 {
		methods = append(methods, SanitizeBlock)
	}
	if id.OACS&OACSFormat != 0 {
		if id.FNA&FNACrypto != 0 {
			methods = append(methods, FormatCrypto)
		}
		methods = append(methods, FormatUserData)
	}
	if opts.Overwrite && id.SANICAP&SANICAPOWS != 0 {
		methods = append(methods, SanitizeOverwrite)
	}
	if len(methods) == 0 {
		return fail(fmt.Errorf("no erase method: SANICAP 0x%08x, Format NVM %s", id.SANICAP, supported(id.OACS&OACSFormat != 0)))
	}
	for _, m := range methods {
		if (m == FormatCrypto || m == FormatUserData) && len(inactive) > 0 {
			// Format NVM reaches attached namespaces only; a Sanitize covers them all.
			r.Attempts = append(r.Attempts, Attempt{Method: m, Status: "not tried: " + notAttached(inactive) + ", which Format NVM does not reach"})
			continue
		}
		opts.Progress(string(m))
		err := run(ctx, c, m, id, nss, ids, opts, &r)
		a := Attempt{Method: m, Status: "success"}
		if err != nil {
			a.Status = err.Error()
		}
		r.Attempts = append(r.Attempts, a)
		var se *StatusError
		if err == nil {
			r.Method = m
			break
		}
		if errors.As(err, &se) && se.Status.Unsupported() && (se.Opcode == OpSanitize || se.Opcode == OpFormatNVM) {
			continue // refused as not supported: the next method
		}
		return fail(fmt.Errorf("%s: %w", m, err))
	}
	if r.Method == "" {
		if len(inactive) > 0 {
			return fail(fmt.Errorf("%s: only a Sanitize reaches them, and none was done", notAttached(inactive)))
		}
		return fail(errors.New("every erase method was refused"))
	}
	opts.Progress("verify")
	n, err := verify(ctx, c, nss, ids, opts, r.NS)
	r.VerifiedLBAs = n
	if err != nil {
		return fail(fmt.Errorf("verify after %s: %w", r.Method, err))
	}
	if n == 0 {
		// Nothing read back is nothing known: a controller with no active namespace (its
		// data in one not attached), or one of 0 blocks, is not erased on its word.
		r.Method = ""
		return fail(errors.New("no block read back (no active namespace with blocks): not known erased"))
	}
	return r
}

// inactiveNamespaces are the namespaces allocated on a controller with Namespace
// Management and not in its active list (ids): Identify CNS 10h, then 11h for each.
// Without Namespace Management every namespace is attached and there are none.
func inactiveNamespaces(ctx context.Context, c Controller, id IDController, active []uint32) ([]Namespace, error) {
	if id.OACS&OACSNSManagement == 0 {
		return nil, nil
	}
	buf := make([]byte, IdentifySize)
	if err := c.Admin(ctx, Command{Opcode: OpIdentify, CDW10: CNSAllocatedNSList}, buf); err != nil {
		return nil, fmt.Errorf("identify allocated namespaces: %w", err)
	}
	isActive := map[uint32]bool{}
	for _, a := range active {
		isActive[a] = true
	}
	var out []Namespace
	for _, nsid := range ParseNSList(buf) {
		if isActive[nsid] {
			continue
		}
		b := make([]byte, IdentifySize)
		if err := c.Admin(ctx, Command{Opcode: OpIdentify, NSID: nsid, CDW10: CNSAllocatedNamespace}, b); err != nil {
			return nil, fmt.Errorf("identify allocated namespace %d: %w", nsid, err)
		}
		n, err := ParseIDNamespace(b)
		if err != nil {
			return nil, fmt.Errorf("allocated namespace %d: %w", nsid, err)
		}
		out = append(out, Namespace{NSID: nsid, Blocks: n.NSZE, BlockSize: n.BlockSize(), DLFEAT: n.DLFEAT})
	}
	return out, nil
}

func notAttached(nss []Namespace) string {
	var ids []string
	for _, n := range nss {
		ids = append(ids, fmt.Sprint(n.NSID))
	}
	return "allocated namespace " + strings.Join(ids, ", ") + " not attached"
}

func supported(b bool) string {
	if b {
		return "supported"
	}
	return "not supported"
}

// namespaces identifies every active namespace.
func namespaces(ctx context.Context, c Controller) ([]IDNamespace, []uint32, error) {
	buf := make([]byte, IdentifySize)
	if err := c.Admin(ctx, Command{Opcode: OpIdentify, CDW10: CNSActiveNSList}, buf); err != nil {
		return nil, nil, fmt.Errorf("identify active namespaces: %w", err)
	}
	ids := ParseNSList(buf)
	var out []IDNamespace
	for _, id := range ids {
		b := make([]byte, IdentifySize)
		if err := c.Admin(ctx, Command{Opcode: OpIdentify, NSID: id, CDW10: CNSNamespace}, b); err != nil {
			return nil, nil, fmt.Errorf("identify namespace %d: %w", id, err)
		}
		n, err := ParseIDNamespace(b)
		if err != nil {
			return nil, nil, fmt.Errorf("namespace %d: %w", id, err)
		}
		if n.BlockSize() == 0 {
			return nil, nil, fmt.Errorf("namespace %d: LBA format %d has no usable block size", id, n.FormatIndex())
		}
		out = append(out, n)
	}
	return out, ids, nil
}

func run(ctx context.Context, c Controller, m Method, id IDController, nss []IDNamespace, ids []uint32, opts Options, r *Result) error {
	switch m {
	case SanitizeCrypto, SanitizeBlock, SanitizeOverwrite:
		act := map[Method]uint32{SanitizeCrypto: SanactCrypto, SanitizeBlock: SanactBlock, SanitizeOverwrite: SanactOverwrite}[m]
		cdw10 := act
		var cdw11 uint32
		if m == SanitizeOverwrite {
			cdw10 |= 1 << 4 // OWPASS: one pass; the pattern in CDW11 is zero
		}
		if err := c.Admin(ctx, Command{Opcode: OpSanitize, CDW10: cdw10, CDW11: cdw11}, nil); err != nil {
			return err
		}
		st, err := waitSanitize(ctx, c, m, opts)
		if st != nil {
			r.SanitizeLog = st.State().String()
		}
		return err
	case FormatCrypto, FormatUserData:
		ses := uint8(SESUserData)
		if m == FormatCrypto {
			ses = SESCrypto
		}
		if len(nss) == 0 {
			return nil // nothing holds data
		}
		if id.FNA&(FNAFormatAll|FNAEraseAll) != 0 {
			// One format covers every namespace; each must keep its own format, which a
			// broadcast takes from the CDW10 of the first.
			return c.Admin(ctx, Command{Opcode: OpFormatNVM, NSID: NSIDAll, CDW10: nss[0].FormatCDW10(ses)}, nil)
		}
		for i, n := range nss {
			if err := c.Admin(ctx, Command{Opcode: OpFormatNVM, NSID: ids[i], CDW10: n.FormatCDW10(ses)}, nil); err != nil {
				return fmt.Errorf("namespace %d: %w", ids[i], err)
			}
		}
		return nil
	}
	return fmt.Errorf("unknown method %q", m)
}

// waitSanitize polls the Sanitize Status log until the sanitize is no longer in
// progress, the deadline passes, or ctx ends.
func waitSanitize(ctx context.Context, c Controller, m Method, opts Options) (*SanitizeStatus, error) {
	deadline := opts.Now().Add(opts.SanitizeTimeout)
	buf := make([]byte, 512)
	var last *SanitizeStatus
	for {
		// NUMDL (CDW10 bits 31:16) is zero-based, in dwords; LID in bits 7:0.
		numd := uint32(len(buf)/4 - 1)
		if err := c.Admin(ctx, Command{Opcode: OpGetLogPage, NSID: NSIDAll, CDW10: numd<<16 | LogSanitizeStatus}, buf); err != nil {
			return last, fmt.Errorf("sanitize status log: %w", err)
		}
		st, err := ParseSanitizeStatus(buf)
		if err != nil {
			return last, err
		}
		last = &st
		if st.State() == SanitizeInProgress {
			opts.Progress(fmt.Sprintf("%s %d%% (SPROG %d/65536)", m, int(st.SPROG)*100/65536, st.SPROG))
		}
		switch st.State() {
		case SanitizeCompleted, SanitizeCompletedNDA:
			return last, nil
		case SanitizeFailed:
			return last, errors.New("sanitize status log: the sanitize failed")
		case SanitizeNever:
			return last, errors.New("sanitize status log: no sanitize recorded after the command completed")
		}
		if !opts.Now().Before(deadline) {
			return last, fmt.Errorf("sanitize still in progress (%d/65536) after %v", st.SPROG, opts.SanitizeTimeout)
		}
		if err := opts.Sleep(ctx, opts.PollInterval); err != nil {
			return last, fmt.Errorf("sanitize in progress (%d/65536): %w", st.SPROG, err)
		}
	}
}

// sampleLBAs are the blocks read back from a namespace of n blocks: the first, the last,
// and the rest spread evenly between, each moved within its stretch by a hash of its
// index so a pattern that repeats at a power of two is not always missed.
func sampleLBAs(n uint64, k int) []uint64 {
	if n == 0 {
		return nil
	}
	if uint64(k) >= n {
		out := make([]uint64, n)
		for i := range out {
			out[i] = uint64(i)
		}
		return out
	}
	out := []uint64{0}
	step := n / uint64(k-1)
	for i := 1; i < k-1; i++ {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], uint64(i)*0x9e3779b97f4a7c15)
		jitter := binary.LittleEndian.Uint64(b[:]) % max(step, 1)
		out = append(out, uint64(i)*step+jitter/2)
	}
	return append(out, n-1)
}

// verify reads the sampled blocks of every namespace: each must read as a deallocated
// block does (DLFEAT). It counts the blocks read clean.
func verify(ctx context.Context, c Controller, nss []IDNamespace, ids []uint32, opts Options, rec []Namespace) (int, error) {
	total := 0
	for i, n := range nss {
		bs := n.BlockSize()
		want := n.Deallocated()
		buf := make([]byte, bs)
		for _, lba := range sampleLBAs(n.NSZE, opts.Samples) {
			if err := c.Read(ctx, ids[i], lba, bs, buf); err != nil {
				return total, fmt.Errorf("namespace %d lba %d: %w", ids[i], lba, err)
			}
			for off, b := range buf {
				if b != want {
					return total, fmt.Errorf("namespace %d lba %d: byte %d is 0x%02x, want 0x%02x: data remains", ids[i], lba, off, b, want)
				}
			}
			total++
			rec[i].Verified++
		}
	}
	return total, nil
}
