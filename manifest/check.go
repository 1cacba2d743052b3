package manifest

import (
	"errors"
	"fmt"
)

// VFIODriver is the driver every function of a unit that may be passed through is bound
// to when the boot ends.
const VFIODriver = "vfio-pci"

// ErasePolicyRequire is passage.erase=require as the erase record names it: a unit whose
// erase or reset did not complete is failed.
const ErasePolicyRequire = "require"

// Check is the semantic check of a payload: what a signature cannot catch, because the
// signer itself wrote a manifest that contradicts itself (a bug, or a stolen key). Verify
// runs it on every manifest it accepts, so verify, render, metrics and the units view see
// only payloads that pass it. It refuses, each with its reason:
//   - a unit ID empty or given twice, a status other than ready, degraded or failed
//     (exactly so spelled);
//   - a function address given twice, in one unit or in two;
//   - a unit that may be passed through (ready or degraded) with a function not on
//     vfio-pci or without an IOMMU group, or whose erase record under require says a
//     controller was not erased (no method, an error, no block read back), a reset not
//     done, or an error for the unit;
//   - a negative module_id, a module_id without its module_source or a module_source
//     with module_id 0, a Module ID given to two units;
//   - an nvlink partition that is empty, or names a Module ID below 1 or twice.
func Check(m *Manifest) error {
	var errs []error
	units := map[string]bool{}
	bdfs := map[string]string{}
	modules := map[int]string{}
	for i, u := range m.Units {
		name := fmt.Sprintf("unit %q", u.ID)
		switch {
		case u.ID == "":
			name = fmt.Sprintf("unit #%d", i)
			errs = append(errs, fmt.Errorf("%s: no id", name))
		case units[u.ID]:
			errs = append(errs, fmt.Errorf("%s: listed twice", name))
		}
		units[u.ID] = true
		switch {
		case u.ModuleID < 0:
			errs = append(errs, fmt.Errorf("%s: module_id %d: want 0 (unknown) or a Module ID from 1", name, u.ModuleID))
		case u.ModuleID > 0 && u.ModuleSource == "":
			errs = append(errs, fmt.Errorf("%s: module_id %d with no module_source", name, u.ModuleID))
		case u.ModuleID == 0 && u.ModuleSource != "":
			errs = append(errs, fmt.Errorf("%s: module_source %q with module_id 0 (unknown)", name, u.ModuleSource))
		case u.ModuleID > 0:
			if other, dup := modules[u.ModuleID]; dup {
				errs = append(errs, fmt.Errorf("%s: Module ID %d also unit %q's", name, u.ModuleID, other))
			}
			modules[u.ModuleID] = u.ID
		}
		usable := false
		switch u.Status {
		case StatusReady, StatusDegraded:
			usable = true
		case StatusFailed:
		default:
			errs = append(errs, fmt.Errorf("%s: status %q: want %s, %s or %s", name, u.Status, StatusReady, StatusDegraded, StatusFailed))
		}
		for _, f := range u.Functions {
			if other, dup := bdfs[f.BDF]; dup {
				errs = append(errs, fmt.Errorf("%s: function %q also in unit %q", name, f.BDF, other))
			}
			bdfs[f.BDF] = u.ID
			if !usable {
				continue
			}
			if f.DriverAfter != VFIODriver {
				errs = append(errs, fmt.Errorf("%s is %s: function %s: driver_after %q, want %s", name, u.Status, f.BDF, f.DriverAfter, VFIODriver))
			}
			if f.IOMMUGroup < 0 {
				errs = append(errs, fmt.Errorf("%s is %s: function %s: iommu_group %d: no IOMMU group", name, u.Status, f.BDF, f.IOMMUGroup))
			}
		}
		if usable && u.Erase != nil && u.Erase.Policy == ErasePolicyRequire {
			for _, p := range u.Erase.Problems() {
				errs = append(errs, fmt.Errorf("%s is %s under erase policy require: %s", name, u.Status, p))
			}
		}
	}
	if m.NVLink != nil {
		for i, set := range m.NVLink.Partitions {
			if len(set) == 0 {
				errs = append(errs, fmt.Errorf("nvlink partition %d: empty", i))
			}
			seen := map[int]bool{}
			for _, id := range set {
				if id < 1 || seen[id] {
					errs = append(errs, fmt.Errorf("nvlink partition %d: Module ID %d below 1 or given twice", i, id))
				}
				seen[id] = true
			}
		}
	}
	return errors.Join(errs...)
}

// Problems are what the record says was not done: the unit's error, each controller
// not known erased (no method, an error, or no block read back: zero blocks verified is
// never erased) and each reset not done.
func (e *UnitErase) Problems() []string {
	var out []string
	if e.Error != "" {
		out = append(out, "erase: "+e.Error)
	}
	for _, n := range e.NVMe {
		switch {
		case n.Error != "":
			out = append(out, fmt.Sprintf("erase %s: %s", n.BDF, n.Error))
		case n.Method == "":
			out = append(out, fmt.Sprintf("erase %s: not erased", n.BDF))
		case n.VerifiedLBAs <= 0:
			out = append(out, fmt.Sprintf("erase %s: %d blocks verified", n.BDF, n.VerifiedLBAs))
		}
	}
	for _, r := range e.Resets {
		if r.Result != "done" {
			out = append(out, fmt.Sprintf("reset %s: %s", r.BDF, r.Result))
		}
	}
	return out
}
