package erase_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
)

// A controller's data is in every allocated namespace, attached or not, and nothing
// read back is nothing known: a format-only controller whose tenant data sits in a
// namespace not attached, one with no namespace, or one whose namespace has no blocks
// is never reported erased. A Sanitize, which covers the whole subsystem, erases a
// namespace that is not attached.
func TestEraseEveryAllocatedNamespace(t *testing.T) {
	detached := erasetest.Namespace{NSID: 2, Blocks: 4096, Inactive: true}
	for _, tc := range []struct {
		name    string
		ctrl    func() *erasetest.Controller
		erased  bool
		reason  string
		cleanNS uint32 // namespace whose data must be gone (0: none checked)
	}{
		{"format only, data in a namespace not attached", func() *erasetest.Controller {
			c := erasetest.New("S1", 0, erase.FNAFormatAll, true, detached)
			c.NSManagement = true
			return c
		}, false, "allocated namespace 2 not attached: only a Sanitize reaches them", 0},
		{"format only, one attached and one not", func() *erasetest.Controller {
			c := erasetest.New("S2", 0, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16}, detached)
			c.NSManagement = true
			return c
		}, false, "not attached", 0},
		{"sanitize, one attached and one not", func() *erasetest.Controller {
			c := erasetest.New("S3", erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16}, detached)
			c.NSManagement = true
			return c
		}, true, "", 2},
		{"sanitize, only a namespace not attached", func() *erasetest.Controller {
			c := erasetest.New("S4", erase.SANICAPBES, 0, true, detached)
			c.NSManagement = true
			return c
		}, false, "no block read back", 0},
		{"format only, no namespace", func() *erasetest.Controller {
			return erasetest.New("S5", 0, erase.FNAFormatAll, true)
		}, false, "no block read back", 0},
		{"format only, a namespace of 0 blocks", func() *erasetest.Controller {
			return erasetest.New("S6", 0, 0, true, erasetest.Namespace{NSID: 1, Blocks: 0})
		}, false, "no block read back", 0},
		{"format, namespace management, all attached", func() *erasetest.Controller {
			c := erasetest.New("S7", 0, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16})
			c.NSManagement = true
			return c
		}, true, "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.ctrl()
			for _, n := range c.Namespaces {
				if n.Blocks > 0 {
					c.Write(n.NSID, 0, marker)
					c.Write(n.NSID, n.Blocks-1, marker)
				}
			}
			clk := &fakeClock{t: time.Unix(0, 0)}
			r := erase.Erase(context.Background(), c, opts(clk))
			if r.Erased() != tc.erased || (tc.reason != "" && !strings.Contains(r.Err, tc.reason)) {
				t.Fatalf("erased %v (method %q, %d verified, err %q), want %v naming %q; attempts %v", r.Erased(), r.Method, r.VerifiedLBAs, r.Err, tc.erased, tc.reason, r.Attempts)
			}
			if !tc.erased && r.Method != "" {
				t.Errorf("not erased, yet the record names method %q", r.Method)
			}
			if tc.erased && r.VerifiedLBAs == 0 {
				t.Errorf("erased with nothing verified")
			}
			if tc.cleanNS != 0 && c.Dirty(tc.cleanNS) != 0 {
				t.Errorf("namespace %d keeps the tenant's blocks", tc.cleanNS)
			}
			var listed []uint32
			for _, n := range r.NS {
				listed = append(listed, n.NSID)
			}
			if len(listed) != len(c.Namespaces) {
				t.Errorf("record lists namespaces %v, the controller has %d", listed, len(c.Namespaces))
			}
		})
	}
}
