package decision

import (
	"context"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// eraseVerdict is what the erase step's report makes of a unit under the erase policy:
// nothing when the policy is off; otherwise a unit whose NVMe was not erased and
// verified, whose functions were not all reset, or that the report does not cover (the
// step errored, panicked, timed out, or was skipped), is failed under require and
// degraded under auto.
//
// Under a command that does not erase, the decision gave the verdict (markSteps) and the
// report adds nothing.
func (d *Decision) eraseVerdict(id topology.UnitID, rep *erase.Report, stepErr error) (topology.Status, []string) {
	if !d.Erase.Active() || !d.For.Erases() {
		return "", nil
	}
	s := d.erasePolicyStatus()
	var reasons []string
	switch ur := rep.Unit(id); {
	case rep == nil:
		reasons = append(reasons, "erase: did not complete: "+errText(stepErr))
	case ur == nil:
		reasons = append(reasons, "erase: not erased: no report for the unit")
	default:
		for _, p := range ur.Problems() {
			reasons = append(reasons, "erase ("+string(d.Erase)+"): "+p)
		}
	}
	if len(reasons) == 0 {
		return "", nil
	}
	return s, reasons
}

// erasePolicyStatus is what a unit not erased becomes under the active policy: failed
// under require, degraded under auto.
func (d *Decision) erasePolicyStatus() topology.Status {
	if d.Erase == erase.PolicyRequire {
		return topology.StatusFailed
	}
	return topology.StatusDegraded
}

// ErasePlan are the units the erase step works on after the ACS step reported acs: the
// ones the decision passes through whose ports all reached a state they may be passed
// through in. Nil when the policy is off or the command does not erase.
func (d *Decision) ErasePlan(acs *apply.Report) []*topology.Unit {
	if !d.Erase.Active() || !d.For.Erases() {
		return nil
	}
	return d.passable(acs)
}

// Bindable are the units to bind after the ACS step reported acs and the erase step
// reported er (nil: no erase step ran): those the decision passes through whose ports
// all reached a state they may be passed through in, less those the erase policy fails.
// Under require a unit with any erase or reset problem, or none reported, is not bound.
func (d *Decision) Bindable(acs *apply.Report, er *erase.Report) []*topology.Unit {
	var out []*topology.Unit
	for _, u := range d.passable(acs) {
		if s, _ := d.eraseVerdict(u.ID, er, nil); s == topology.StatusFailed {
			continue
		}
		out = append(out, u)
	}
	return out
}

// ExecuteBind binds the units Bindable gives to vfio-pci.
func (d *Decision) ExecuteBind(ctx context.Context, sys vfiobind.Sysfs, acs *apply.Report, er *erase.Report, opts vfiobind.Options) (*vfiobind.Report, error) {
	return vfiobind.Bind(ctx, sys, d.Tree, d.Bindable(acs, er), opts)
}

// Unvouched are the verdicts of units a run cannot vouch for: failed, with the reason.
// Recycle gives them to the units it takes out of service before anything is done to
// them, so that the generation signed before the release can never be read as ready
// whatever happens after it, and to units it has no verified earlier record of. The
// verdicts that follow an execution come from Conclude.
func (d *Decision) Unvouched(ids []topology.UnitID, reason string) []Verdict {
	out := make([]Verdict, 0, len(ids))
	for _, id := range ids {
		out = append(out, Verdict{Unit: id, Status: topology.StatusFailed, Reasons: []string{reason}})
	}
	return out
}
