package erase

import (
	"fmt"

	"github.com/passage-boot/passage/manifest"
)

// Record is a unit's erase in the manifest (manifest/SCHEMA.md, Erase); nil when the
// policy is off or nothing was reported for the unit (the verdict then says why).
func Record(p Policy, u *UnitReport) *manifest.UnitErase {
	if !p.Active() || u == nil {
		return nil
	}
	m := &manifest.UnitErase{Policy: string(p), Error: u.Err, ResetClears: manifest.ResetClears}
	for _, n := range u.NVMe {
		e := manifest.NVMeErase{BDF: n.Addr.String(), Controller: n.Controller, Model: n.Model, Serial: n.Serial,
			Firmware: n.Firmware, SANICAP: fmt.Sprintf("0x%08x", n.SANICAP), FNA: fmt.Sprintf("0x%02x", n.FNA),
			Method: string(n.Method), SanitizeStatus: n.SanitizeLog, Duration: n.Duration, VerifiedLBAs: n.VerifiedLBAs, Error: n.Err}
		for _, ns := range n.NS {
			e.Namespaces = append(e.Namespaces, manifest.NVMeNamespace{NSID: ns.NSID, Blocks: ns.Blocks, BlockSize: ns.BlockSize, VerifiedLBAs: ns.Verified})
		}
		for _, a := range n.Attempts {
			e.Attempts = append(e.Attempts, string(a.Method)+": "+a.Status)
		}
		for _, mv := range n.Moves {
			if mv.Err != "" && e.Error == "" {
				e.Error = mv.Err
			}
		}
		m.NVMe = append(m.NVMe, e)
	}
	for _, rr := range u.Resets {
		res := "done"
		if rr.Err != "" {
			res = rr.Err
		}
		m.Resets = append(m.Resets, manifest.Reset{BDF: rr.Addr.String(), Methods: rr.Methods, Result: res})
	}
	return m
}
