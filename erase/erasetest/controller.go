// Package erasetest simulates an NVMe controller at the passthrough ioctl boundary:
// it answers Identify, Get Log Page (Sanitize Status), Sanitize and Format NVM the way
// the Base Specification says, holds its namespaces' data in memory, and fails the way a
// test asks (a command it does not implement, an error status, a sanitize that never
// completes, an erase that leaves data, the device vanishing, latency).
package erasetest

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/passage-boot/passage/erase"
)

// Namespace is one simulated namespace: Blocks blocks of 1<<LBADS bytes.
type Namespace struct {
	NSID   uint32
	Blocks uint64
	LBADS  uint8 // 9 (512 B) when 0
	DLFEAT uint8
	// Inactive is allocated but not attached to the controller: only the allocated
	// namespace list (CNS 10h) shows it, a Format NVM does not reach it, a Sanitize
	// does (it covers the whole NVM subsystem), and it cannot be read.
	Inactive bool
}

// Faults are the failures the controller simulates.
type Faults struct {
	// Refuse answers these opcodes with Invalid Command Opcode even when the Identify
	// data advertises them (a controller that lies about SANICAP).
	Refuse map[uint8]bool
	// ErrorStatus completes these opcodes with the status (e.g. 0x4006 internal error).
	ErrorStatus map[uint8]erase.Status
	// SanitizeStuck keeps every sanitize in progress forever.
	SanitizeStuck bool
	// SanitizeFails ends every sanitize in the failed state.
	SanitizeFails bool
	// KeepData makes sanitize and format succeed without touching the data.
	KeepData bool
	// VanishAfter makes every command after the first N fail with ENODEV (0: never).
	VanishAfter int
	// Latency is added to every admin command; SanitizeTime is how long a sanitize
	// stays in progress. Both use the real clock unless Sleep is set.
	Latency      time.Duration
	SanitizeTime time.Duration
}

// Controller is a simulated controller. Data is kept sparse: a block never written
// reads as the namespace's deallocated pattern.
type Controller struct {
	Model, Serial, Firmware string
	SANICAP                 uint32
	FNA                     uint8
	Format                  bool // OACS: Format NVM supported
	NSManagement            bool // OACS: Namespace Management supported (CNS 10h/11h answered)
	Namespaces              []Namespace
	Faults                  Faults
	// Sleep waits for latency; nil is time.Sleep bounded by ctx.
	Sleep func(ctx context.Context, d time.Duration) error

	mu          sync.Mutex
	data        map[uint32]map[uint64][]byte
	commands    []erase.Command
	sanitizeEnd time.Time
	sanitizeBeg time.Time
	sanitizing  bool
	sstat       erase.SanitizeState
	closed      bool
}

// New returns a controller with Samsung-like Identify strings and the given capabilities.
func New(serial string, sanicap uint32, fna uint8, format bool, nss ...Namespace) *Controller {
	return &Controller{Model: "SAMSUNG MZWLO3T8HCLS-00A07", Serial: serial, Firmware: "OPPA4B5Q",
		SANICAP: sanicap, FNA: fna, Format: format, Namespaces: nss, data: map[uint32]map[uint64][]byte{}}
}

// Write stores a block's bytes (what a tenant left).
func (c *Controller) Write(nsid uint32, lba uint64, b []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.data[nsid] == nil {
		c.data[nsid] = map[uint64][]byte{}
	}
	c.data[nsid][lba] = append([]byte(nil), b...)
}

// Dirty returns how many blocks of nsid still hold written data.
func (c *Controller) Dirty(nsid uint32) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.data[nsid])
}

// Commands returns every admin command received, in order.
func (c *Controller) Commands() []erase.Command {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]erase.Command(nil), c.commands...)
}

// Closed says Close was called.
func (c *Controller) Closed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

func (c *Controller) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	return nil
}

func (c *Controller) wait(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	if c.Sleep != nil {
		return c.Sleep(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (c *Controller) ns(id uint32) *Namespace {
	for i := range c.Namespaces {
		if c.Namespaces[i].NSID == id {
			return &c.Namespaces[i]
		}
	}
	return nil
}

func lbads(n *Namespace) uint8 {
	if n.LBADS == 0 {
		return 9
	}
	return n.LBADS
}

func status(sc uint8) error {
	return &erase.StatusError{Status: erase.Status(1<<14 | uint16(sc))}
}

func (c *Controller) Admin(ctx context.Context, cmd erase.Command, buf []byte) error {
	if err := c.wait(ctx, c.Faults.Latency); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.commands = append(c.commands, cmd)
	if n := c.Faults.VanishAfter; n > 0 && len(c.commands) > n {
		return fmt.Errorf("ioctl: %w", syscall.ENODEV)
	}
	fail := func(err error) error {
		if se, ok := err.(*erase.StatusError); ok {
			se.Opcode = cmd.Opcode
		}
		return err
	}
	if c.Faults.Refuse[cmd.Opcode] {
		return fail(status(0x01))
	}
	if s, ok := c.Faults.ErrorStatus[cmd.Opcode]; ok {
		return &erase.StatusError{Opcode: cmd.Opcode, Status: s}
	}
	switch cmd.Opcode {
	case erase.OpIdentify:
		clear(buf)
		switch cmd.CDW10 & 0xff {
		case erase.CNSController:
			binary.LittleEndian.PutUint16(buf[0:], 0x144d)
			pad(buf[4:24], c.Serial)
			pad(buf[24:64], c.Model)
			pad(buf[64:72], c.Firmware)
			var oacs uint16
			if c.Format {
				oacs |= erase.OACSFormat
			}
			if c.NSManagement {
				oacs |= erase.OACSNSManagement
			}
			binary.LittleEndian.PutUint16(buf[256:], oacs)
			binary.LittleEndian.PutUint32(buf[328:], c.SANICAP)
			binary.LittleEndian.PutUint32(buf[516:], uint32(len(c.Namespaces)))
			buf[524] = c.FNA
		case erase.CNSActiveNSList, erase.CNSAllocatedNSList:
			if cmd.CDW10&0xff == erase.CNSAllocatedNSList && !c.NSManagement {
				return fail(status(0x02))
			}
			i := 0
			for _, n := range c.Namespaces {
				if n.Inactive && cmd.CDW10&0xff == erase.CNSActiveNSList {
					continue
				}
				binary.LittleEndian.PutUint32(buf[4*i:], n.NSID)
				i++
			}
		case erase.CNSNamespace, erase.CNSAllocatedNamespace:
			if cmd.CDW10&0xff == erase.CNSAllocatedNamespace && !c.NSManagement {
				return fail(status(0x02))
			}
			n := c.ns(cmd.NSID)
			if n == nil {
				return fail(status(0x0b))
			}
			if n.Inactive && cmd.CDW10&0xff == erase.CNSNamespace {
				// An inactive NSID reads as zeroes through CNS 00h (Figure 273).
				return nil
			}
			binary.LittleEndian.PutUint64(buf[0:], n.Blocks)
			binary.LittleEndian.PutUint64(buf[8:], n.Blocks)
			binary.LittleEndian.PutUint64(buf[16:], uint64(len(c.data[n.NSID])))
			buf[33] = n.DLFEAT
			buf[128+2] = lbads(n)
		default:
			return fail(status(0x02))
		}
		return nil
	case erase.OpGetLogPage:
		if cmd.CDW10&0xff != erase.LogSanitizeStatus || c.SANICAP == 0 {
			return fail(status(0x02))
		}
		clear(buf)
		st := c.sstat
		if c.sanitizing {
			if !c.Faults.SanitizeStuck && !time.Now().Before(c.sanitizeEnd) {
				c.sanitizing = false
				c.sstat = erase.SanitizeCompleted
				if c.Faults.SanitizeFails {
					c.sstat = erase.SanitizeFailed
				} else if !c.Faults.KeepData {
					c.data = map[uint32]map[uint64][]byte{}
				}
			}
			st = c.sstat
			if c.sanitizing {
				st = erase.SanitizeInProgress
				// SPROG: the fraction of SanitizeTime gone, in 65536ths (a quarter when
				// the sanitize never ends).
				sprog := uint16(0x4000)
				if total := c.sanitizeEnd.Sub(c.sanitizeBeg); total > 0 && !c.Faults.SanitizeStuck {
					sprog = uint16(min(65535, int64(time.Since(c.sanitizeBeg))*65536/int64(total)))
				}
				binary.LittleEndian.PutUint16(buf[0:], sprog)
			}
		}
		binary.LittleEndian.PutUint16(buf[2:], uint16(st))
		return nil
	case erase.OpSanitize:
		act := cmd.CDW10 & 0x7
		bit := map[uint32]uint32{erase.SanactCrypto: erase.SANICAPCES, erase.SanactBlock: erase.SANICAPBES, erase.SanactOverwrite: erase.SANICAPOWS}[act]
		if c.SANICAP == 0 {
			return fail(status(0x01))
		}
		if bit == 0 || c.SANICAP&bit == 0 {
			return fail(status(0x02))
		}
		if c.sanitizing {
			return fail(status(0x1d))
		}
		c.sanitizing = true
		c.sanitizeBeg = time.Now()
		c.sanitizeEnd = c.sanitizeBeg.Add(c.Faults.SanitizeTime)
		return nil
	case erase.OpFormatNVM:
		if !c.Format {
			return fail(status(0x01))
		}
		ses := cmd.CDW10 >> 9 & 0x7
		if ses == erase.SESCrypto && c.FNA&erase.FNACrypto == 0 {
			return fail(status(0x02))
		}
		if c.Faults.KeepData {
			return nil
		}
		if cmd.NSID == erase.NSIDAll {
			// Every attached namespace; an inactive one keeps its data.
			for _, n := range c.Namespaces {
				if !n.Inactive {
					delete(c.data, n.NSID)
				}
			}
		} else if n := c.ns(cmd.NSID); n == nil || n.Inactive {
			return fail(status(0x0b))
		} else {
			delete(c.data, cmd.NSID)
		}
		return nil
	}
	return fail(status(0x01))
}

func pad(dst []byte, s string) {
	for i := range dst {
		dst[i] = ' '
	}
	copy(dst, s)
}

func (c *Controller) Read(ctx context.Context, nsid uint32, lba uint64, blockSize int, buf []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := c.Faults.VanishAfter; n > 0 && len(c.commands) >= n {
		return fmt.Errorf("read: %w", syscall.ENODEV)
	}
	n := c.ns(nsid)
	if n == nil || n.Inactive || lba >= n.Blocks || blockSize != 1<<lbads(n) {
		return fmt.Errorf("read ns %d lba %d: %w", nsid, lba, syscall.EINVAL)
	}
	if b, ok := c.data[nsid][lba]; ok {
		copy(buf, b)
		return nil
	}
	fill := byte(0)
	if n.DLFEAT&7 == 2 {
		fill = 0xff
	}
	for i := range buf {
		buf[i] = fill
	}
	return nil
}
